"""The vision tower (the family's ViT(s) + projector) in CUDA graphs: one per batch bucket
(`GraphedTower`), or, where pictures take tokens by their size, one per batch of picture grids
(`GridGraphs`).

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
import math
import time
from collections import Counter
from dataclasses import dataclass

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
            limit = max(torch._dynamo.config.recompile_limit, kinds * len(self.buckets))
            with torch._dynamo.config.patch(recompile_limit=limit):
                self._graphs = capture_graphs(self.buckets, self._forward, "vision tower, batch")
        except Exception:
            log.exception("the vision tower could not be captured in CUDA graphs: it runs eagerly")
            return None
        return self


# A graph holds its batch's input, output and layout (some 4 KB a patch in bf16 for Qwen2.5-VL-7B);
# its activations share one pool. A batch of more patches than MAX_GRAPH_PATCHES (a 1280x720
# picture is 4,800) runs eagerly, since pictures that large are bound by arithmetic. So do
# batches past MAX_GRID_GRAPHS graphs or MAX_GRAPHED_PATCHES in all (about 130 MB): traffic of
# mixed sizes must not grow the GPU memory for long.
MAX_GRID_GRAPHS = 32
MAX_GRAPH_PATCHES = 8192
MAX_GRAPHED_PATCHES = 32768
# A batch's grids are captured the second time they come: a one-off does not take a graph's place.
CAPTURE_AT_SIGHT = 2
SEEN_KEYS = 4096  # sightings (and failed captures) kept before they are forgotten
# A graph not replayed for this many batches gives its place to a key that comes again, so that
# traffic whose sizes change is not left eager behind the graphs of the sizes that came first.
STALE_BATCHES = 2048

BatchKey = tuple[tuple[int, int, int], ...]  # a batch's picture grids (t, h, w), sorted
WARM_GRID = (1, 16, 16)  # a 224x224 picture's, to compile the blocks on before serving


@dataclass
class _GridGraph:
    graph: torch.cuda.CUDAGraph
    patches: torch.Tensor  # [N, P]: the static input, pictures in the key's order
    tokens: torch.Tensor  # [N / m^2, H]: the static output
    grid: torch.Tensor  # [n, 3] (host): the key's grids
    layout: object  # the tower's device layout, which the graph reads: kept alive with it
    used: int = 0  # the batch count at its last replay


class GridGraphs:
    """A tower whose pictures take tokens by their size (Qwen2.5-VL) in a CUDA graph per batch of grids.

    Eager, such a tower launches some fifty kernels a layer from Python, and for small pictures
    the launching sets the vision's time (docs/PERF.md). The grids of a batch's pictures (t, h, w
    in patches) fix every shape and window, so one graph per set of grids replays the batch.
    Captured, a small picture is still bound by its many small kernels, so a replay per picture
    made a batch cost more than one eager forward of it packed (docs/PERF.md): the key is the
    whole batch's grids, sorted (the pictures are reordered into the graph and their tokens back).
    A key is captured the second time it comes (some three eager runs' time, once), within the
    caps above (count, patches each, patches in all), all in one memory pool and replayed one at a
    time (the vision's one encoding thread). When the caps are full, graphs not replayed for
    STALE_BATCHES batches are dropped to make room (their memory returns to the pool for the next
    capture). A batch without a graph (new, past the caps, or its capture failed: logged) runs
    as one eager forward. On CUDA the blocks' work around their attention is compiled first, once
    for any size (the rows dynamic), to cut the kernels a block launches (its elementwise ops fused).
    """

    def __init__(
        self, tower: nn.Module, max_graphs: int = MAX_GRID_GRAPHS, max_patches: int = MAX_GRAPH_PATCHES
    ) -> None:
        self.tower, self.max_graphs, self.max_patches = tower, max_graphs, max_patches
        self.device = next(tower.parameters()).device
        self._pool = self._stream = None  # made at the first capture
        self._graphs: dict[BatchKey, _GridGraph] = {}
        self._failed: set[BatchKey] = set()  # keys whose capture failed: eager, not tried again
        self._seen: Counter[BatchKey] = Counter()
        self._batches = 0  # batches served, the clock of STALE_BATCHES
        self.eager_fns = tower.block_fns(compiled=False)  # type: ignore[operator]
        self.fns = self._compile() if self.device.type == "cuda" else self.eager_fns

    @torch.inference_mode()
    def _compile(self):
        """The tower's blocks compiled, and run once on a picture's grid (so no request waits for
        the compile); on failure logged, and eager."""
        t0 = time.perf_counter()
        try:
            fns = self.tower.block_fns(compiled=True)  # type: ignore[operator]
            grid = torch.tensor([WARM_GRID])
            patches = torch.zeros(math.prod(WARM_GRID), self.tower.patch_width, device=self.device)  # type: ignore[attr-defined]
            self.tower(patches, grid, fns=fns)
        except Exception:
            log.exception("the vision tower's blocks could not be compiled: they run eagerly")
            return self.eager_fns
        log.info("vision tower's blocks compiled in %.1f s", time.perf_counter() - t0)
        return fns

    @torch.inference_mode()
    def pictures(self, patches: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """`tower.pictures`: packed patches [N, P] of pictures with grids [n, 3] (host) -> one
        [rows, cols, H] each, in the batch's order."""
        grids = [tuple(g) for g in grid.tolist()]
        order = sorted(range(len(grids)), key=grids.__getitem__)
        key = tuple(grids[i] for i in order)
        parts = patches.split([t * h * w for t, h, w in grids])
        entry = self._graph(key, [parts[i] for i in order], grid[order])
        if entry is None:
            return self._eager(patches, grid)
        torch.cat([parts[i] for i in order], out=entry.patches)  # into the graph, in the key's order
        entry.graph.replay()
        tokens = self.tower.split(entry.tokens.clone(), entry.grid)  # the key's order
        out: list[torch.Tensor] = [tokens[0]] * len(grids)
        for j, i in enumerate(order):
            out[i] = tokens[j]
        return out

    def _eager(self, patches: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """One forward of the batch, its blocks compiled; should the compiled blocks fail at a size
        the start-up did not see, logged, and eager from then on."""
        try:
            return self.tower.pictures(patches, grid, fns=self.fns)
        except Exception:
            if self.fns is self.eager_fns:
                raise
            log.exception("the vision tower's compiled blocks failed: they run eagerly from now on")
            self.fns = self.eager_fns
            return self.tower.pictures(patches, grid, fns=self.fns)

    def _graph(self, key: BatchKey, parts: list[torch.Tensor], grids: torch.Tensor) -> _GridGraph | None:
        """The batch's graph (`parts` and `grids` in the key's order), captured now if this is its
        time; None: it runs eagerly."""
        self._batches += 1
        entry = self._graphs.get(key)
        if entry is not None:
            entry.used = self._batches
            return entry
        n = sum(p.shape[0] for p in parts)
        if n > self.max_patches or key in self._failed:
            return None
        if len(self._seen) >= SEEN_KEYS:  # batches of mixed sizes make keys without end: forget the sightings
            self._seen.clear()
            self._failed.clear()
        self._seen[key] += 1
        if self._seen[key] < CAPTURE_AT_SIGHT or not self._make_room(n):
            return None
        entry = self._capture(key, parts, grids)
        if entry is None:
            self._failed.add(key)
            return None
        entry.used = self._batches
        self._graphs[key] = entry
        return entry

    def _make_room(self, n: int) -> bool:
        """Whether a graph of `n` patches fits the caps, dropping graphs idle for STALE_BATCHES
        (the longest idle first) where that makes it fit, and nothing otherwise."""
        count, held = len(self._graphs), sum(g.patches.shape[0] for g in self._graphs.values())
        stale = sorted((g.used, k) for k, g in self._graphs.items() if self._batches - g.used > STALE_BATCHES)
        drop: list[BatchKey] = []
        while count >= self.max_graphs or held + n > MAX_GRAPHED_PATCHES:
            if len(drop) == len(stale):
                return False
            key = stale[len(drop)][1]
            drop.append(key)
            count, held = count - 1, held - self._graphs[key].patches.shape[0]
        for key in drop:  # idle that long, its last replay is long done on the GPU
            del self._graphs[key]
            log.info("vision tower: dropped the graph for grids %s, idle for over %d batches", key, STALE_BATCHES)
        return True

    def _capture(self, key: BatchKey, parts: list[torch.Tensor], grids: torch.Tensor) -> _GridGraph | None:
        try:
            if self._pool is None:
                self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            static = torch.cat(parts)
            layout = self.tower.device_layout(grids, self.device)
            out = {}

            def run(_) -> None:
                tokens = self.tower(static, grids, layout, fns=self.fns)
                if "tokens" not in out:  # the first warm-up run, outside the capture
                    out["tokens"] = torch.empty_like(tokens)
                out["tokens"].copy_(tokens)

            graph = capture_graphs(
                [key], run, "vision tower, grids", self._stream, self._pool, error_mode="thread_local"
            )[key]
            return _GridGraph(graph, static, out["tokens"], grids, layout)
        except Exception:
            log.exception("the vision tower could not be captured for grids %s: they run eagerly", key)
            return None
