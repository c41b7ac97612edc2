"""DeepSeek-VL on the GPU (its tiny checkpoints through the whole mesh: tests/gpu/test_cuda.py):
the 7B-shaped preset cut to 2 decoder layers and 3 layers per tower (SigLIP at 384 px, SAM at
1024 px; weights saved by transformers) against transformers, in fp32 and in bf16, with both
towers captured in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    CASES,
    Parts,
    assert_idle,
    bf16_agreement,
    hf_inputs,
    hf_model_on_gpu,
    image_bytes,
    ours,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cut_deepseek(tmp_path_factory):
    from services.model.tiny import build_preset_checkpoint

    out = tmp_path_factory.mktemp("cut-deepseek-7b")
    return build_preset_checkpoint(out, "deepseek-vl-7b-shaped", text_layers=2, vision_layers=3)


@pytest.fixture
def exact_fp32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def test_the_cut_preset_gives_transformers_greedy_tokens_fp32(cut_deepseek, exact_fp32):
    from services.llm.config import NativeEngineConfig

    parts = Parts(
        cut_deepseek, max_batch=4, device="cuda", dtype="float32", native=NativeEngineConfig(max_prefill_tokens=1024)
    )
    try:
        got = ours(parts, CASES[:2])
        assert_idle(parts)
    finally:
        parts.engine.stop()
    model = hf_model_on_gpu(cut_deepseek, torch.float32)
    for (data, prompt), ids in zip(CASES[:2], got, strict=True):
        inputs = {k: v.to("cuda") for k, v in hf_inputs(cut_deepseek, data, prompt).items()}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert ids == want, f"{prompt!r}: engine {ids} != transformers {want}"
    assert got[0] != got[1]


def test_bf16_tokens_agree_with_transformers_as_its_own_bf16_does_with_fp32(cut_deepseek):
    """As the LLaVA test of the same name: random weights have near-ties that bf16 rounding flips,
    so our bf16 tokens are held to transformers' own bf16 agreement with fp32 (and the figures printed)."""
    parts = Parts(cut_deepseek, max_batch=4, device="cuda", dtype="bfloat16")
    try:
        got = ours(parts, CASES)
    finally:
        parts.engine.stop()
    ours_vs_hf16, hf16_vs_hf32, ours_vs_hf32 = bf16_agreement(cut_deepseek, CASES, got)
    print(
        f"DeepSeek-VL cut preset, bf16, teacher-forced over {sum(map(len, got))} tokens: ours = transformers-bf16 "
        f"argmax {ours_vs_hf16:.1%}; transformers-bf16 = transformers-fp32 {hf16_vs_hf32:.1%}; "
        f"ours = transformers-fp32 {ours_vs_hf32:.1%}"
    )
    assert ours_vs_hf32 >= hf16_vs_hf32 - 0.03


def test_both_towers_in_cuda_graphs_equal_them_eager_fp32(cut_deepseek, exact_fp32):
    from services.model.spec import load_spec
    from services.vision.encoder import VisionEncoder

    spec = load_spec(cut_deepseek)
    graphed = VisionEncoder(spec, "cuda", "float32", graphs_up_to=4)
    assert graphed.graphed is not None and graphed.graphed.buckets == [1, 2, 4]
    assert len(graphed.graphed.inputs) == 2  # SigLIP's 384 px and SAM's 1024 px
    pixels = [graphed.pixels(image_bytes(300 + i, (200 + 40 * i, 150))) for i in range(3)]
    want = VisionEncoder(spec, "cuda", "float32").encode(pixels)
    for n in (1, 2, 3):
        torch.testing.assert_close(graphed.encode(pixels[:n]), want[:n], atol=2e-4, rtol=2e-4)
