"""fuse_linears (services/model/fuse.py): one projection whose output is the layers' outputs, in order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.model.fuse import fuse_linears


@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_layer_gives_each_layer_s_output_in_order(bias):
    torch.manual_seed(0)
    layers = [nn.Linear(8, n, bias=bias) for n in (8, 4, 4)]
    x = torch.randn(3, 8)
    fused = fuse_linears(*layers)
    assert (fused.bias is not None) == bias
    q, k, v = fused(x).split([8, 4, 4], dim=-1)
    for got, layer in zip((q, k, v), layers, strict=True):
        torch.testing.assert_close(got, layer(x))


def test_layers_that_disagree_on_a_bias_are_refused():
    with pytest.raises(ValueError, match="bias"):
        fuse_linears(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
