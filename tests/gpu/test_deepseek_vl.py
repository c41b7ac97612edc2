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
    check_bf16_agreement,
    check_fp32_tokens_on_gpu,
    image_bytes,
    ours,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cut_deepseek(tmp_path_factory):
    from services.model.tiny import build_preset_checkpoint

    out = tmp_path_factory.mktemp("cut-deepseek-7b")
    return build_preset_checkpoint(out, "deepseek-vl-7b-shaped", text_layers=2, vision_layers=3)


def test_the_cut_preset_gives_transformers_greedy_tokens_fp32(cut_deepseek, exact_fp32):
    got = check_fp32_tokens_on_gpu(cut_deepseek, CASES[:2])
    assert got[0] != got[1]


def test_bf16_tokens_agree_with_transformers_as_its_own_bf16_does_with_fp32(cut_deepseek):
    """As the LLaVA test of the same name: random weights have near-ties that bf16 rounding flips,
    so our bf16 tokens are held to transformers' own bf16 agreement with fp32 (and the figures printed)."""
    parts = Parts(cut_deepseek, max_batch=4, device="cuda", dtype="bfloat16")
    try:
        got = ours(parts, CASES)
    finally:
        parts.engine.stop()
    check_bf16_agreement("DeepSeek-VL cut preset", cut_deepseek, CASES, got)


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
