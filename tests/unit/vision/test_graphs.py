"""The graphed vision tower's buffers and buckets, run eagerly on the CPU (CUDA replays the same
forward from graphs): each image's features equal the tower's own, whatever the batch and its
padding, and a result keeps its values after the next batch reuses the static output."""

from __future__ import annotations

import torch

from services.model.checkpoint import load_vision_tower
from services.model.spec import load_spec
from services.vision.graphs import GraphedTower


def test_graphed_tower_equals_the_tower_for_every_batch(tiny_model):
    spec = load_spec(tiny_model)
    tower = load_vision_tower(spec, torch.device("cpu"), torch.float32)
    size = spec.vision.image_size
    graphed = GraphedTower(tower, 4, size, spec.image_tokens, spec.text.hidden, torch.float32)
    assert graphed.buckets == [1, 2, 4]
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, size, size, generator=gen)
    with torch.inference_mode():
        want = tower(images)
    got = [graphed(images[:3]), graphed(images[3:]), graphed(images[1:3])]  # bucket 4 (1 padding row), 1, 2
    torch.testing.assert_close(got[0], want[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[1:3], atol=1e-5, rtol=1e-5)
    assert got[0].data_ptr() != graphed.output.data_ptr()  # its own memory: later batches leave it alone
