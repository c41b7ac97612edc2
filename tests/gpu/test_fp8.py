"""fp8 on a GPU (compute capability 8.9+): the 1-byte kernel over e4m3 weights (decode rows) and
`torch._scaled_mm` with row-wise scales (prompt rows), each against the fp64 sums of the codes it
read; compiled and in CUDA graphs; half of bf16's weight bytes; close to bf16. The same arithmetic
emulated on the CPU: tests/unit/model/test_fp8.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common.buckets import capture_graphs
from services.model.qlinear import FP8_KERNEL_ROWS, Fp8Linear, fp8_rows
from services.model.quantize import FP8_CAPABILITY, quantize_decoder, weight_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_CAPABILITY,
        reason="fp8 needs compute capability 8.9+",
    ),
]
CUDA = torch.device("cuda")


def _codes_sum(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """What either path must compute, in fp64 from the codes it reads."""
    wq, ws = layer.qdata.double(), layer.scale.double()
    if x.shape[0] <= FP8_KERNEL_ROWS:
        return (x.double() @ wq.T) * ws
    xq, xs = fp8_rows(x)
    return (xq.double() @ wq.T) * xs.double() * ws


@pytest.mark.parametrize("m", [1, 8, 32, 64, 65, 640, 2048])
@pytest.mark.parametrize("n, k", [(4096, 4096), (12288, 4096), (4096, 11008), (512, 192)])
def test_each_path_is_the_sum_of_its_codes(m, n, k):
    torch.manual_seed(n + k + m)
    layer = Fp8Linear.of(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = layer(x).double()
    want = _codes_sum(layer, x)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, f"{m} rows: relative error {err}"


def test_fp8_compiled_and_captured_gives_new_results_per_replay():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4096, 1024, bias=False), nn.Linear(1024, 512, bias=False)).to(CUDA, torch.bfloat16)
    quantize_decoder(layers, "fp8", CUDA, torch.bfloat16)
    step = torch.compile(lambda t: layers(t) + 1.0, dynamic=False)
    sizes = (1, 32, 256)  # decode rows through the kernel, prompt rows through _scaled_mm
    ins = {m: torch.zeros(m, 4096, device="cuda", dtype=torch.bfloat16) for m in sizes}
    outs = {m: torch.zeros(m, 512, device="cuda", dtype=torch.bfloat16) for m in sizes}
    graphs = capture_graphs(sizes, lambda m: outs[m].copy_(step(ins[m])), "test_fp8")
    for m, graph in graphs.items():
        for trial in range(2):
            ins[m].normal_()
            graph.replay()
            ref = layers(ins[m]).float() + 1.0  # eager
            err = ((outs[m].float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"batch {m}, trial {trial}: relative error {err}"


def test_fp8_stays_close_to_bf16_and_stores_a_byte_a_weight():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4096, 1024, bias=False), nn.Linear(1024, 512, bias=False)).to(CUDA, torch.bfloat16)
    weights = sum(p.numel() for p in layers.parameters())
    bf16_bytes = weight_bytes(layers)
    for rows in (8, 640):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        want = layers(x).float()
        fp8 = nn.Sequential(*(Fp8Linear.of(layer) for layer in layers))
        got = fp8(x).float()
        err = ((got - want).norm() / want.norm()).item()
        assert 0 < err < 0.06, f"{rows} rows: relative error {err}"
    quantize_decoder(layers, "fp8", CUDA, torch.bfloat16)
    assert weight_bytes(layers) / weights < 1.01 and weight_bytes(layers) < 0.51 * bf16_bytes


def test_a_checkpoint_stored_in_fp8_runs_its_codes_on_both_paths(tmp_path):
    """compressed-tensors fp8 loaded with --quantize fp8: the stored codes in Fp8Linear, decode rows
    (the 1-byte kernel) and prompt rows (_scaled_mm) both close to the codes multiplied out in bf16."""
    from services.model.checkpoint import load_decoder, preflight
    from services.model.stored_fp8 import store_fp8
    from services.model.tiny import build_tiny_llava

    model = build_tiny_llava(tmp_path / "m", seed=0)
    store_fp8(model)
    spec = preflight(model)
    kept = load_decoder(spec, CUDA, torch.bfloat16, keep_fp8=True)
    quantize_decoder(kept.layers, "fp8", CUDA, torch.bfloat16)  # checks the device; the stored layers stay
    plain = load_decoder(spec, CUDA, torch.bfloat16)
    assert isinstance(kept.layers[0].mlp.gate_up_proj, Fp8Linear)
    for rows in (8, 100):
        x = torch.randn(rows, spec.text.hidden, device="cuda", dtype=torch.bfloat16)
        want = plain.layers[0].mlp(x).float()
        err = ((kept.layers[0].mlp(x).float() - want).norm() / want.norm()).item()
        assert err < (0.02 if rows <= FP8_KERNEL_ROWS else 0.06), f"{rows} rows: relative error {err}"
