"""services/model/gemv.py off a GPU: F.linear, exactly (the kernel itself: tests/gpu/test_gemv.py)."""

import torch
import torch.nn.functional as F

from services.model import gemv


def test_on_the_cpu_linear_is_f_linear():
    x, w, b = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24)
    assert not gemv.applies(x, w)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
