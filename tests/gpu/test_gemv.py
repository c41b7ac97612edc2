"""The batch-1 decode step's matmul (services/model/gemv.py) against F.linear in fp64, on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.common.buckets import capture_graphs
from services.model import gemv

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 11008), (22016, 4096), (1000, 1032), (72, 4104), (40, 24)])
def test_the_kernel_equals_f_linear(dtype, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    assert gemv.applies(x, w)
    y = gemv.linear(x, w)
    ref = F.linear(x.double(), w.double())
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err}"


def test_a_strided_input_compiled_and_captured_in_a_graph_gives_new_results_per_replay():
    # As the decode step runs it: inside torch.compile (the op traced into inductor's graph), in a
    # CUDA graph, over an input that is a strided view.
    w = torch.randn(512, 256, device="cuda") / 16
    buf = torch.zeros(1, 2, 256, device="cuda")
    step = torch.compile(lambda t: gemv.linear(t[:, 1], w) + 1.0, dynamic=False)
    outs = []
    graph = capture_graphs([1], lambda _: outs.append(step(buf)), "test")[1]
    out = outs[-1]  # the captured run's (after two warm-up runs)
    for seed in (1, 2):
        buf.copy_(torch.randn(1, 2, 256, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        ref = F.linear(buf[:, 1].double(), w.double()) + 1.0
        assert torch.allclose(out.double(), ref, atol=1e-4)


def test_what_the_kernel_does_not_take_goes_to_f_linear():
    x, w = torch.randn(2, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    assert not gemv.applies(x, w)  # a batch: cuBLAS
    assert not gemv.applies(x[:1], w, torch.zeros(32, device="cuda"))  # a bias
    assert not gemv.applies(x[:1].half(), w)  # mixed dtypes
    assert torch.allclose(gemv.linear(x, w), F.linear(x, w))
