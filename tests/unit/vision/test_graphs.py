"""The graphed vision tower's buffers and buckets, run eagerly on the CPU (CUDA replays the same
forward from graphs): each image's features equal the tower's own, whatever the batch and its
padding, and a result keeps its values after the next batch reuses the static output. For every
family: LLaVA's one input, DeepSeek-VL hybrid's two."""

from __future__ import annotations

import pytest
import torch

from services.model.checkpoint import load_vision_tower
from services.model.spec import load_spec
from services.vision.graphs import GraphedTower


@pytest.mark.parametrize("model", ["tiny_model", "tiny_deepseek_hybrid"])
def test_graphed_tower_equals_the_tower_for_every_batch(model, request):
    spec = load_spec(request.getfixturevalue(model))
    tower = load_vision_tower(spec, torch.device("cpu"), torch.float32)
    shapes = tower.input_shapes()
    graphed = GraphedTower(tower, 4, shapes, (spec.image_tokens, spec.text.hidden), torch.float32)
    assert graphed.buckets == [1, 2, 4]
    gen = torch.Generator().manual_seed(0)
    images = [torch.randn(4, *shape, generator=gen) for shape in shapes]
    with torch.inference_mode():
        want = tower(*images)
    # bucket 4 (1 padding row), 1, 2
    got = [graphed(*(x[:3] for x in images)), graphed(*(x[3:] for x in images)), graphed(*(x[1:3] for x in images))]
    torch.testing.assert_close(got[0], want[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[1:3], atol=1e-5, rtol=1e-5)
    assert got[0].data_ptr() != graphed.output.data_ptr()  # its own memory: later batches leave it alone
