"""Qwen2.5-VL on the GPU: the 7B-shaped preset cut to 2 decoder layers and 2 ViT layers (weights
saved by transformers) through the CUDA engine (graph-captured decode with its rotary offsets,
packed prefill with M-RoPE positions) and the vision encoder, against transformers, in fp32 and
in bf16."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    Parts,
    assert_idle,
    bf16_agreement,
    hf_inputs,
    hf_model_on_gpu,
    image_bytes,
    ours,
)

pytestmark = pytest.mark.gpu

# Pictures of several sizes: 224x224 (64 tokens), wide, tall, and one over max_pixels.
CASES = [
    (image_bytes(1, (224, 224), "JPEG"), "What is in the image?"),
    (image_bytes(2, (640, 200), "JPEG"), "Describe the picture in detail."),
    (image_bytes(3, (150, 500), "PNG"), "What shape is it?"),
    (image_bytes(4, (1600, 1200), "JPEG"), "Why?"),
]


@pytest.fixture(scope="module")
def cut_qwen(tmp_path_factory):
    from services.model.tiny import build_preset_checkpoint

    out = tmp_path_factory.mktemp("cut-qwen-7b")
    return build_preset_checkpoint(out, "qwen2.5-vl-7b-shaped", text_layers=2, vision_layers=2)


@pytest.fixture
def exact_fp32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def test_the_cut_preset_gives_transformers_greedy_tokens_fp32(cut_qwen, exact_fp32):
    from services.llm.config import NativeEngineConfig

    parts = Parts(
        cut_qwen, max_batch=4, device="cuda", dtype="float32", native=NativeEngineConfig(max_prefill_tokens=1024)
    )
    try:
        got = ours(parts, CASES)
        assert_idle(parts)
    finally:
        parts.engine.stop()
    model = hf_model_on_gpu(cut_qwen, torch.float32)
    for (data, prompt), ids in zip(CASES, got, strict=True):
        inputs = {k: v.to("cuda") for k, v in hf_inputs(cut_qwen, data, prompt).items()}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert ids == want, f"{prompt!r}: engine {ids} != transformers {want}"
    assert len({tuple(ids) for ids in got}) == len(got)


def test_bf16_tokens_agree_with_transformers_as_its_own_bf16_does_with_fp32(cut_qwen):
    parts = Parts(cut_qwen, max_batch=4, device="cuda", dtype="bfloat16")
    try:
        got = ours(parts, CASES)
    finally:
        parts.engine.stop()
    ours_vs_hf16, hf16_vs_hf32, ours_vs_hf32 = bf16_agreement(cut_qwen, CASES, got)
    print(
        f"Qwen2.5-VL cut preset, bf16, teacher-forced over {sum(map(len, got))} tokens: ours = transformers-bf16 "
        f"argmax {ours_vs_hf16:.1%}; transformers-bf16 = transformers-fp32 {hf16_vs_hf32:.1%}; "
        f"ours = transformers-fp32 {ours_vs_hf32:.1%}"
    )
    assert ours_vs_hf32 >= hf16_vs_hf32 - 0.03


def test_the_tower_on_cuda_gives_transformers_image_features_fp32(cut_qwen, exact_fp32):
    from services.model.spec import load_spec
    from services.vision.encoder import VisionEncoder

    enc = VisionEncoder(load_spec(cut_qwen), "cuda", "float32")
    got = enc.encode([enc.pixels(data) for data, _ in CASES])
    model = hf_model_on_gpu(cut_qwen, torch.float32)
    inputs = hf_inputs(cut_qwen, [data for data, _ in CASES], "x")
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=inputs["pixel_values"].cuda(), image_grid_thw=inputs["image_grid_thw"].cuda()
        ).pooler_output
    for g, w, (_, h, wd) in zip(got, want, inputs["image_grid_thw"].tolist(), strict=True):
        assert g.shape == (h // 2, wd // 2, w.shape[-1])
        torch.testing.assert_close(g.flatten(0, 1), w, atol=1e-4, rtol=1e-4)
