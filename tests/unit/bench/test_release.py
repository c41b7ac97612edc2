"""`vlmesh bench` gives back one target's GPU memory before the next target starts (the CUDA calls faked)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from services.bench import cli, targets
from services.bench.targets import Outcome


class Weights:
    """Stands for an engine's tensors: held by the target, and holding it back (as an engine's thread
    and callbacks do), so only the cycle collector frees it."""

    def __init__(self, owner: object) -> None:
        self.owner = owner


@pytest.fixture
def no_automatic_gc():
    """The cycle is freed when the bench collects it, not whenever Python's collector happens to run."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_the_in_process_target_is_closed_and_freed_and_the_cache_emptied_before_the_mesh_starts(
    tiny_model, tmp_path, monkeypatch, capsys, no_automatic_gc
):
    events: list[str] = []
    weights: list[weakref.ref] = []

    class InProcess:
        name = "inprocess"

        def __init__(self, *args) -> None:
            self.weights = Weights(self)
            weights.append(weakref.ref(self.weights))
            events.append("inprocess built")

        async def send(self, req) -> Outcome:
            return Outcome("OK", 0.01, 0.005, req.max_tokens)

        async def close(self) -> None:
            events.append(f"{self.name} closed")

    class Mesh(InProcess):
        name = "mesh"

        def __init__(self, *args) -> None:
            events.append("mesh client built")

    @contextlib.contextmanager
    def serve(name, args, say, http=False):
        freed = all(ref() is None for ref in weights)
        events.append(f"{name} started, the in-process weights {'freed' if freed else 'alive'}")
        yield ({"mesh": "127.0.0.1:1"} if name == "mesh" else {}), []

    monkeypatch.setattr(targets, "InprocessTarget", InProcess)
    monkeypatch.setattr(targets, "MeshTarget", Mesh)
    monkeypatch.setattr(cli, "serve", serve)
    # A CUDA process: the allocator's cache is what the release must empty.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("cache emptied"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60, 100))

    argv = ["--model", str(tiny_model), "--target", "inprocess,mesh", "--rates", "8", "--duration", "0.5"]
    assert cli.main([*argv, "--warmup", "0", "--out", str(tmp_path)]) == 0
    assert events == [
        "inprocess started, the in-process weights freed",  # none built yet
        "inprocess built",
        "inprocess closed",
        "cache emptied",
        "mesh started, the in-process weights freed",
        "mesh client built",
        "mesh closed",
        "cache emptied",
    ]
    assert "GPU memory released: this process holds 1.50 GiB through PyTorch; the device is 40.0% in use" in (
        capsys.readouterr().err
    )
