"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def exact_fp32():
    """fp32 as the CPU computes it: TF32 convolutions and matmuls would differ in the last bits."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
