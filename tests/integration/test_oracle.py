"""The mesh's greedy tokens equal transformers' LlavaForConditionalGeneration.generate."""

from __future__ import annotations

import io

import grpc
import pytest
import torch
from PIL import Image

from tests.conftest import image_bytes, pil_clip_processor_class
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

CASES = [
    (image_bytes(1, (48, 40), "PNG"), "What is in the image?"),
    (image_bytes(2, (64, 96), "JPEG"), "Describe the picture in detail."),
    (image_bytes(3, (40, 40), "WEBP"), "What color is the shape?"),
    (image_bytes(4, (100, 37), "PNG"), "What is in the image?"),
]


def hf_inputs(model_dir, data: bytes, prompt: str):
    """transformers' own processor on the same bytes: input_ids and pixel_values."""
    from transformers import AutoTokenizer, LlavaProcessor

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = LlavaProcessor(
        image_processor=pil_clip_processor_class().from_pretrained(model_dir),
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        chat_template=tok.chat_template,
        num_additional_image_tokens=1,
    )
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return proc(images=Image.open(io.BytesIO(data)), text=text, return_tensors="pt")


def hf_greedy(model_dir, data: bytes, prompt: str, n: int) -> list[int]:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    inputs = hf_inputs(model_dir, data, prompt)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def test_greedy_tokens_match_transformers(mesh, tiny_model, stub):
    check_against_transformers(stub, tiny_model)


def check_against_transformers(stub, tiny_model) -> None:
    """16 greedy tokens per case through `stub` (a gateway) equal transformers' on the checkpoint."""
    ours = []
    for data, prompt in CASES:
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=data)],
            prompt=prompt,
            sampling=pb.SamplingParams(max_tokens=16, min_tokens=16),
        )
        ids: list[int] = []
        final = None
        for msg in stub.Generate(req, timeout=60):
            ids.extend(msg.token_ids)
            final = msg
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.output_tokens == 16
        assert final.usage.image_tokens == 16
        ref = hf_greedy(tiny_model, data, prompt, 16)
        assert ids == ref, f"prompt {prompt!r}: mesh {ids} != transformers {ref}"
        ours.append(tuple(ids))
    # The image matters: the same prompt on different pictures gives different tokens,
    # so the comparison above would catch features that are lost or mixed up.
    assert ours[0] != ours[3]
