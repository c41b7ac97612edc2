"""fp8 (e4m3) quantization, its arithmetic emulated in fp32 on the CPU: the codes and scales the
GPU path makes, a projection's two paths against the fp64 sums of those codes, the demo model
still answering its task, and the errors where fp8 cannot run. The GPU kernels themselves:
tests/gpu/test_fp8.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from services.llm.config import LlmConfig, NativeEngineConfig
from services.model import quantize, shapes
from services.model.qlinear import FP8, FP8_KERNEL_ROWS, FP8_MAX, Fp8Linear, fp8_rows
from services.model.quantize import quantize_decoder, weight_bytes
from tests.helpers import ROOT, Parts

CPU = torch.device("cpu")


def test_each_row_takes_the_e4m3_range_and_rounds_as_torch_casts():
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]
    x[3] = 0.0  # an all-zero row
    q, s = fp8_rows(x)
    assert q.dtype == FP8 and s.shape == (6, 1) and s.dtype == torch.float32
    amax = q.float().abs().amax(dim=1)
    assert torch.equal(amax[[0, 1, 2, 4, 5]], torch.full((5,), FP8_MAX))  # each row's largest at 448
    assert s[3].item() == 1.0 and not q[3].float().any()
    assert torch.equal(q.float(), (x / s).to(FP8).float())  # round to nearest even, as the cast does
    rel = ((q.float() * s - x).abs() / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)).max()
    assert rel <= 2**-4  # 3 mantissa bits: half an ulp of the row's largest magnitude at most


def _layer(n: int = 96, k: int = 128, bias: bool = True) -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("rows", [1, FP8_KERNEL_ROWS, FP8_KERNEL_ROWS + 1, 200])
def test_both_paths_are_the_sums_of_their_codes(rows):
    """Up to FP8_KERNEL_ROWS rows x stays as it is and meets the dequantized weight (W8A16); more
    rows are quantized per row too (W8A8). Each equals the fp64 sum over its own codes."""
    layer = _layer()
    fp8 = Fp8Linear.of(layer)
    x = torch.randn(rows, 128)
    wq, ws = fp8.qdata.double(), fp8.scale.double()
    if rows <= FP8_KERNEL_ROWS:
        want = (x.double() @ wq.T) * ws
    else:
        xq, xs = fp8_rows(x)
        want = (xq.double() @ wq.T) * xs.double() * ws
    want = want + layer.bias.double()
    got = fp8(x)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    full = layer(x).double()
    err = ((got.double() - full).norm() / full.norm()).item()
    assert 0 < err < 0.05, err  # it did quantize, and stays close to full precision


def test_fp8_stores_a_byte_a_weight():
    layers = nn.Sequential(_layer(bias=False), nn.Linear(96, 64, bias=False))
    before = weight_bytes(layers)
    quantize._replace(layers, Fp8Linear.of)
    assert all(isinstance(m, Fp8Linear) and m.qdata.dtype == FP8 for m in layers)
    assert weight_bytes(layers) == before // 4 + 4 * (96 + 64)  # fp32 weights -> 1 byte, + an fp32 scale a row


def test_fp8_is_refused_with_the_device_named_where_it_cannot_run():
    layer = nn.Linear(128, 128)
    with pytest.raises(ValueError, match=r"fp8 needs a CUDA GPU of compute capability 8.9.*runs on cpu.*int8"):
        quantize_decoder(layer, "fp8", CPU, torch.float32)
    with pytest.raises(ValueError, match=r"fp8 needs a CUDA GPU.*not the CPU"):
        LlmConfig(native=NativeEngineConfig(quantize="fp8"), model=_cpu_model()).check()


def _cpu_model():
    from services.common.config import ModelConfig

    return ModelConfig(path="models/demo", device="cpu")


def test_odd_widths_are_refused_before_any_weight_changes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    layers = nn.Sequential(nn.Linear(128, 200), nn.Linear(200, 64))
    with pytest.raises(ValueError, match=r"multiples of 16 \(fp8 GEMMs\), not \[200\]"):
        quantize.check_fp8(torch.device("cuda"), torch.bfloat16, list(layers))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"8.9 or newer; NVIDIA A100 \(cuda\) has 8.6"):
        quantize.check_fp8(torch.device("cuda"), torch.bfloat16, [nn.Linear(128, 128)])


def test_the_demo_model_in_fp8_emulation_still_sees(monkeypatch):
    """The native engine with every decoder projection in fp8 (the GPU's codes and scales, the
    products emulated in fp32 on the CPU: fp8 is refused here otherwise) answers the demo task."""
    monkeypatch.setattr(quantize, "check_fp8", lambda *a: None)
    pics = [shapes.render(np.random.default_rng([5150, i])) for i in range(24)]
    prompts = list(shapes.PROMPTS)
    jobs = [(shapes.encode(p.image, "PNG"), prompts[i % len(prompts)]) for i, p in enumerate(pics)]
    parts = Parts(ROOT / "models" / "demo", max_batch=8, native=NativeEngineConfig(quantize="fp8"))
    try:
        pairs = [parts.request(data, prompt, max_tokens=8) for data, prompt in jobs]
        parts.run(*pairs)
    finally:
        parts.engine.stop()
    assert type(parts.engine.runner.model.layers[0].mlp.down_proj).__name__ == "Fp8Linear"
    right = sum(box["text"] == pic.answer(prompt) for (_, box), pic, (_, prompt) in zip(pairs, pics, jobs, strict=True))
    print(f"fp8 (emulated) demo model: {right} of {len(jobs)} right")
    assert right >= 22, f"{right} of {len(jobs)} right in fp8"
