"""The quantized projections on a GPU: the int8 kernel against fp64, compiled and in a CUDA graph,
int4 (tinygemm) close to bf16, and both kinds' prompt path (the weight converted to bf16, cuBLAS)
against their decode path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common.buckets import capture_graphs
from services.model import int8_mm
from services.model.qlinear import Int4Linear, Int8Linear
from services.model.quantize import quantize_decoder, weight_bytes

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 64, 65, 640])
@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 11008), (22016, 4096), (72, 200)])
def test_the_int8_kernel_equals_the_dequantized_matmul(dtype, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    s = torch.rand(n, device="cuda", generator=gen) / (127 * k**0.5)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    assert int8_mm.applies(x)
    y = int8_mm.linear(x, q, s)
    ref = (x.double() @ q.double().T) * s.double()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err}"


@pytest.mark.parametrize("weight", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("cfg", [int8_mm.Config(16, 32, 128, 4, 4, 4), int8_mm.Config(32, 64, 64, 4, 3, 3)], ids=str)
@pytest.mark.parametrize("m, n, k", [(8, 4096, 11008), (32, 4096, 4096), (20, 72, 200)])
def test_a_split_along_k_adds_its_shares_to_the_whole_sum(weight, cfg, m, n, k):
    """Each share of K's loads, and the second kernel's sum, against fp64 (a K not a multiple of the
    shares' loads included); every output written (NaN to start)."""
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    q = (torch.randn(n, k, device="cuda", generator=gen) * 64).clamp(-127, 127).to(weight)
    s = torch.rand(n, device="cuda", generator=gen) / (127 * k**0.5)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    int8_mm.launch(x, q, s, y, cfg)
    ref = (x.double() @ q.double().T) * s.double()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err}"


def _layers(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4096, 1024, bias=False), nn.Linear(1024, 512, bias=False)).to(CUDA, dtype)


def test_int8_compiled_and_captured_gives_new_results_per_replay():
    layers = _layers(torch.bfloat16)
    quantize_decoder(layers, "int8", CUDA, torch.bfloat16)
    assert all(isinstance(layer, Int8Linear) for layer in layers)
    step = torch.compile(lambda t: layers(t) + 1.0, dynamic=False)
    sizes = (1, 8, 32)
    ins = {m: torch.zeros(m, 4096, device="cuda", dtype=torch.bfloat16) for m in sizes}
    outs = {m: torch.zeros(m, 512, device="cuda", dtype=torch.bfloat16) for m in sizes}
    graphs = capture_graphs(sizes, lambda m: outs[m].copy_(step(ins[m])), "test_quantized")
    for m, graph in graphs.items():
        for trial in range(2):
            ins[m].normal_()
            graph.replay()
            ref = layers(ins[m]).float() + 1.0  # eager: the same kernel, uncompiled
            err = ((outs[m].float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"batch {m}, trial {trial}: relative error {err}"


@pytest.mark.parametrize("how, bytes_per_weight", [("int8", 1.0), ("int4", 0.5)])
def test_each_kind_stays_close_to_bf16_and_stores_its_bytes(how, bytes_per_weight):
    layers = _layers(torch.bfloat16)
    x = torch.randn(40, 4096, device="cuda", dtype=torch.bfloat16)
    want = layers(x).float()
    weights = sum(p.numel() for p in layers.parameters())
    quantize_decoder(layers, how, CUDA, torch.bfloat16)
    assert all(isinstance(layer, Int8Linear if how == "int8" else Int4Linear) for layer in layers)
    got = layers(x).float()
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < (0.02 if how == "int8" else 0.15), f"{how}: relative error {err}"
    stored = weight_bytes(layers) / weights
    assert bytes_per_weight <= stored < bytes_per_weight * 1.1, f"{how}: {stored:.3f} bytes a weight"


@pytest.mark.parametrize("how", ["int8", "int4"])
@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 11008), (200, 256), (512, 192)])  # 192: int4 groups of 64
def test_the_prompt_path_agrees_with_the_decode_path(how, n, k):
    """Past INT8_KERNEL_ROWS / INT4_TINYGEMM_ROWS rows a projection converts its weight to bf16 and
    runs cuBLAS: the same rows through the decode-sized kernel, a few at a time, give the same output."""
    from services.model.qlinear import INT4_TINYGEMM_ROWS, INT8_KERNEL_ROWS

    torch.manual_seed(n + k)
    layers = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    quantize_decoder(layers, how, CUDA, torch.bfloat16)
    few = INT8_KERNEL_ROWS if how == "int8" else INT4_TINYGEMM_ROWS
    x = torch.randn(4 * few + 8, k, device="cuda", dtype=torch.bfloat16)
    small = torch.cat([layers(x[i : i + few]) for i in range(0, x.shape[0], few)])
    many = layers(x)  # one call past the limit: the converted weight
    err = ((many.float() - small.float()).norm() / small.float().norm()).item()
    assert err < 1e-2, f"{how}: the decode path against the prompt path: relative error {err}"
    compiled = torch.compile(lambda t: layers(t), dynamic=True)(x)  # as the prefill's layer halves run
    err = ((compiled.float() - many.float()).norm() / many.float().norm()).item()
    assert err < 1e-2, f"{how}: compiled prompt path: relative error {err}"


@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 11008), (200, 256), (512, 192)])
def test_int4s_unpacked_codes_are_tinygemms_weight(n, k):
    """The int4 prompt path's codes reproduce tinygemm's own dequantization of its tiles."""
    from services.model.qlinear import int4_dequantize

    torch.manual_seed(n + k)
    layers = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    quantize_decoder(layers, "int4", CUDA, torch.bfloat16)
    layer = layers[0]
    eye = torch.eye(layer.in_padded, device="cuda", dtype=torch.bfloat16)
    tiles = torch.ops.aten._weight_int4pack_mm(eye, layer.qdata, layer.group, layer.scale_and_zero)[:, :n].t()
    mine = int4_dequantize(layer.nibbles, layer.scale_and_zero[:, :n], layer.group)
    assert (mine.float() - tiles.float()).abs().max() <= 2e-2 * tiles.float().abs().max()
    assert layer.nibbles.numel() == n * layer.in_padded // 2
