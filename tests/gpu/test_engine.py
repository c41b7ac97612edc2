"""The paged, graph-captured engine on the GPU, on production-sized matrices (the 7B-shaped
preset cut to 2 decoder layers, weights saved by transformers): against transformers, alone
against batched, and its pool after cancels and preemption."""

from __future__ import annotations

import time

import pytest
import torch

from services.common.qos import QosLevel
from services.llm.request import Finish
from tests.helpers import CASES, Parts, hf_inputs, image_bytes

pytestmark = pytest.mark.gpu
TOKENS = 32


@pytest.fixture(scope="module")
def cut_preset(tmp_path_factory):
    from services.model.tiny import build_preset_checkpoint

    return build_preset_checkpoint(tmp_path_factory.mktemp("cut-7b"), "llava-7b-shaped", text_layers=2, vision_layers=3)


@pytest.fixture(scope="module")
def fp32_parts(cut_preset):
    # TF32 would make fp32 matmuls differ from transformers' in the last bits.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    parts = Parts(cut_preset, max_batch=16, device="cuda", dtype="float32")
    yield parts
    parts.engine.stop()


@pytest.fixture(scope="module")
def bf16_parts(cut_preset):
    parts = Parts(cut_preset, max_batch=4, device="cuda", dtype="bfloat16")
    yield parts
    parts.engine.stop()


def assert_idle(parts) -> None:
    engine = parts.engine
    assert engine.stats().running == engine.stats().waiting == 0
    pages = engine.scheduler.blocks
    assert pages.free == pages.capacity, f"{pages.capacity - pages.free} KV pages still held"


def ours(parts, cases, **sampling) -> list[list[int]]:
    pairs = [parts.request(data, prompt, max_tokens=TOKENS, min_tokens=TOKENS, **sampling) for data, prompt in cases]
    parts.run(*pairs)
    return [box["ids"] for _, box in pairs]


def hf_model(model_dir, dtype):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


def test_greedy_tokens_equal_transformers_fp32(fp32_parts, cut_preset):
    model = hf_model(cut_preset, torch.float32)
    got = ours(fp32_parts, CASES[:2])
    for (data, prompt), ids in zip(CASES[:2], got, strict=True):
        inputs = {k: v.to("cuda") for k, v in hf_inputs(cut_preset, data, prompt).items()}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert ids == want, f"{prompt!r}: engine {ids} != transformers {want}"
    assert got[0] != got[1]
    assert_idle(fp32_parts)


def test_a_request_alone_and_in_a_batch_of_16_give_the_same_tokens_fp32(fp32_parts):
    alone = ours(fp32_parts, CASES[:1])[0]
    others = [(image_bytes(100 + i), CASES[i % len(CASES)][1]) for i in range(15)]
    batched = ours(fp32_parts, CASES[:1] + others)
    assert batched[0] == alone
    assert_idle(fp32_parts)


def test_bf16_tokens_are_transformers_argmax_teacher_forced(bf16_parts, cut_preset):
    """Our bf16 greedy tokens, fed to transformers in bf16: each should be its argmax (>= 99%)."""
    model = hf_model(cut_preset, torch.bfloat16)
    got = ours(bf16_parts, CASES)
    agree = total = 0
    for (data, prompt), ids in zip(CASES, got, strict=True):
        inputs = {k: v.to("cuda") for k, v in hf_inputs(cut_preset, data, prompt).items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            first = model(**inputs, use_cache=True)
            rest = model(input_ids=torch.tensor([ids[:-1]], device="cuda"), past_key_values=first.past_key_values)
        logits = torch.cat([first.logits[0, -1:], rest.logits[0]]).float()
        logits[:, model.generation_config.eos_token_id] = float("-inf")  # min_tokens = 32
        agree += (logits.argmax(-1).cpu() == torch.tensor(ids)).sum().item()
        total += len(ids)
    print(f"bf16 teacher-forced: {agree}/{total} tokens are transformers' argmax ({agree / total:.1%})")
    assert agree / total >= 0.99


def test_cancel_and_preemption_give_every_page_back(bf16_parts):
    parts = bf16_parts
    best_effort = [
        parts.request(200 + i, CASES[i][1], QosLevel.BEST_EFFORT, max_tokens=400, min_tokens=400) for i in range(4)
    ]
    for req, _ in best_effort:
        parts.engine.add(req)
    deadline = time.monotonic() + 60
    while min(len(box["ids"]) for _, box in best_effort) < 3:  # the batch of 4 is full and decoding
        assert time.monotonic() < deadline
        time.sleep(0.005)
    realtime = parts.request(300, CASES[0][1], QosLevel.REALTIME, max_tokens=8, min_tokens=8)
    parts.run(realtime)
    assert realtime[1]["finish"] is Finish.LENGTH
    assert sum(bool(req.preempted_at) for req, _ in best_effort) == 1
    for req, _ in best_effort[:2]:
        parts.engine.abort(req.id)
    for _, box in best_effort:
        assert box["done"].wait(120)
    assert [box["finish"] for _, box in best_effort] == [Finish.ABORT] * 2 + [Finish.LENGTH] * 2
    assert all(len(box["ids"]) == 400 for _, box in best_effort[2:])
    assert_idle(parts)
