"""The vision tower (the family's ViT(s) + projector) in CUDA graphs, one per batch bucket.

Eager, the tower launches some fifteen kernels per ViT layer from Python, and for one image
the launching, not the GPU's arithmetic, sets the vision stage's time (docs/PERF.md). Captured,
a batch is one replay.

Before capturing, the function that runs a layer is compiled (torch.compile, reused by every
layer of a kind): it fuses the layer norms, residual adds and activations, which eager runs as
separate kernels. Compiled with static shapes, one graph per layer kind and bucket: dynamo's
automatic dynamic shapes made every size symbolic as soon as a second shape came (a second
bucket; SAM's windowed and global layers and SigLIP's share the function, so the hybrid's
towers ran with symbolic batch, sides and width), and the fused kernels then index by
division with sizes known only at run time.

A batch of n images is copied into the first n rows of the static inputs, the smallest captured
bucket b >= n replays (rows n..b hold whatever they held: an image's features depend on its
own pixels only), and the first n rows of the static output are cloned out, since the next
batch overwrites them. Off CUDA the same runs eagerly over the same buffers (the tests).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.common.buckets import batch_buckets, capture_graphs
from services.model.family import run_layer

log = logging.getLogger(__name__)


class GraphedTower:
    def __init__(
        self,
        tower: nn.Module,
        max_batch: int,
        input_shapes: list[tuple[int, ...]],
        output_shape: tuple[int, int],
        dtype: torch.dtype,
    ) -> None:
        """`input_shapes`: one picture's shape per tower input; `output_shape`: (tokens, hidden)."""
        device = next(tower.parameters()).device
        self.tower, self.max_batch = tower, max_batch
        self.buckets = batch_buckets(max_batch)
        self.inputs = [torch.zeros(max_batch, *shape, device=device, dtype=dtype) for shape in input_shapes]
        self.output = torch.zeros(max_batch, *output_shape, device=device, dtype=dtype)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._run_layer = run_layer  # compiled in `capture`

    def _forward(self, b: int) -> None:
        self.output[:b].copy_(self.tower(*(x[:b] for x in self.inputs), run_layer=self._run_layer))

    @torch.inference_mode()
    def __call__(self, *pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, 3, S, S] per input (the tower's dtype and device), n <= max_batch -> features
        [n, tokens, H] in their own memory."""
        n = pixels[0].shape[0]
        b = next(size for size in self.buckets if size >= n)
        for static, x in zip(self.inputs, pixels, strict=True):
            static[:n].copy_(x)
        graph = self._graphs.get(b)
        if graph is None:
            self._forward(b)
        else:
            graph.replay()
        return self.output[:n].clone()

    @torch.inference_mode()
    def capture(self) -> GraphedTower | None:
        """Compile a layer, capture every bucket (services/common/buckets.py); on failure log it and
        return None (eager)."""
        kinds = 3  # the most layer shapes a tower has per batch (the hybrid: SigLIP, SAM windowed, SAM global)
        try:
            self._run_layer = torch.compile(run_layer, dynamic=False)
            with torch._dynamo.config.patch(recompile_limit=kinds * len(self.buckets)):
                self._graphs = capture_graphs(self.buckets, self._forward, "vision tower, batch")
        except Exception:
            log.exception("the vision tower could not be captured in CUDA graphs: it runs eagerly")
            return None
        return self
