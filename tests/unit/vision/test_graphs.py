"""The graphed vision tower's buffers and buckets, run eagerly on the CPU (CUDA replays the same
forward from graphs): each image's features equal the tower's own, whatever the batch and its
padding, and a result keeps its values after the next batch reuses the static output. For every
family: LLaVA's one input, DeepSeek-VL hybrid's two; Qwen2.5-VL's graphs per batch of picture grids."""

from __future__ import annotations

import pytest
import torch

from services.model.checkpoint import load_vision_tower
from services.model.spec import load_spec
from services.vision.graphs import GraphedTower


def fake_captures(monkeypatch, fails: tuple = ()) -> list:
    """GridGraphs' captures on the CPU: a "graph" replays by running the same function (CUDA
    replays what it captured of it); keys in `fails` fail to capture. -> the keys captured."""
    import types

    from services.vision import graphs

    captured = []

    def capture(sizes, run, what, stream=None, pool=None, error_mode="global"):
        (key,) = sizes
        if key in fails:
            raise RuntimeError("capture failed")
        captured.append(key)
        run(key)
        return {key: types.SimpleNamespace(replay=lambda: run(key))}

    monkeypatch.setattr(graphs, "capture_graphs", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "stream")
    return captured


def random_patches(grids, tower, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random patches [N, P] for pictures of these grids, and the grids [n, 3]."""
    patches = torch.randn(sum(t * h * w for t, h, w in grids), tower.patch_width, generator=gen)
    return patches, torch.tensor(grids)


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


def test_grid_graphs_give_each_picture_its_towers_tokens(tiny_qwen, monkeypatch):
    """GridGraphs' bookkeeping on the CPU, a capture that replays by running the same function
    (CUDA replays what it captured of it): a batch's grids captured the second time they come, in
    any order (the key is sorted, the pictures reordered into the graph and back), batches past
    the caps and a batch whose capture failed run eagerly, and every picture gets the tokens the
    tower gives it."""
    from services.model.qwen2_5_vl import QwenImageConfig, QwenProcessor
    from services.vision import graphs

    captured = fake_captures(monkeypatch, fails=(((1, 4, 8),),))
    spec = load_spec(tiny_qwen)
    tower = load_vision_tower(spec, torch.device("cpu"), torch.float32)
    proc = QwenProcessor(QwenImageConfig.load(tiny_qwen))
    gen = torch.Generator().manual_seed(0)
    # (h, w) -> grids 4x4, 4x8, 8x4, 6x12 (72 patches: over the cap of 64 below)
    px = {
        s: (torch.randint(0, 256, (*s, 3), generator=gen, dtype=torch.uint8),)
        for s in [(56, 56), (56, 112), (112, 56), (84, 168)]
    }
    a, b, c, big = px.values()
    batches = [
        [a, c, a],  # grids (4x4, 8x4, 4x4)
        [c, a, a],  # the same grids in another order: one key
        [b],  # its capture fails, once
        [a],
        [big],  # over the patch cap: never captured
    ]
    grided = graphs.GridGraphs(tower, max_graphs=2, max_patches=64)
    with torch.inference_mode():
        for n in range(3):
            for batch in batches:
                patches, grid = proc.tower_inputs(batch, torch.device("cpu"))
                want = tower.pictures(patches, grid)
                got = grided.pictures(patches, grid)
                assert len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
            if n == 0:  # the first two batches are one key, seen twice: captured at the second
                assert captured == [((1, 4, 4), (1, 4, 4), (1, 8, 4))]
    assert captured == [((1, 4, 4), (1, 4, 4), (1, 8, 4)), ((1, 4, 4),)]  # 4x8 failed (tried once)
    assert ((1, 4, 8),) in grided._failed and ((1, 4, 8),) not in grided._graphs
    assert ((1, 6, 12),) not in grided._graphs and ((1, 6, 12),) not in grided._seen


def test_the_blocks_compile_once_for_pictures_of_any_size(tiny_qwen):
    """Qwen2.5-VL's blocks compiled with the rows dynamic (services/model/qwen_vit.py
    compiled_block_fns): the same tokens as eager, and one graph each for the work before and after
    attention, whatever the pictures' sizes (a recompile per size would stall the vision)."""
    from services.model.qwen_vit import compiled_block_fns

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fns = compiled_block_fns(backend=counting)
    tower = load_vision_tower(load_spec(tiny_qwen), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for grids in [[(1, 16, 16)], [(1, 4, 8), (1, 8, 12)], [(1, 6, 10)]]:
            patches, grid = random_patches(grids, tower, gen)
            torch.testing.assert_close(tower(patches, grid, fns=fns), tower(patches, grid), atol=1e-5, rtol=1e-5)
    assert len(graphs) == 2, [g.code for g in graphs]


def test_compiled_blocks_that_fail_leave_the_batch_to_the_eager_ones(tiny_qwen, caplog):
    """A compile error at a size the start-up did not see fails no batch: logged, eager from then on."""
    from services.model.qwen_vit import EAGER, BlockFns
    from services.vision import graphs

    def broken(*args):
        raise RuntimeError("inductor could not lower it")

    tower = load_vision_tower(load_spec(tiny_qwen), torch.device("cpu"), torch.float32)
    grided = graphs.GridGraphs(tower)
    grided.fns = BlockFns(broken, broken)
    grid = torch.tensor([(1, 4, 8)])
    patches = torch.randn(32, tower.patch_width, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = grided.pictures(patches, grid)
        want = tower.pictures(patches, grid)
    torch.testing.assert_close(got[0], want[0])
    assert grided.fns is EAGER and "run eagerly from now on" in caplog.text


def test_graphs_stop_at_the_patches_they_may_hold_in_all(tiny_qwen, monkeypatch):
    """Keys past MAX_GRAPHED_PATCHES in all run eagerly, however often they come (GPU memory stays flat)."""
    from services.vision import graphs

    captured = fake_captures(monkeypatch)
    monkeypatch.setattr(graphs, "MAX_GRAPHED_PATCHES", 60)
    tower = load_vision_tower(load_spec(tiny_qwen), torch.device("cpu"), torch.float32)
    grided = graphs.GridGraphs(tower)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for grids in [[(1, 4, 4)], [(1, 4, 8)], [(1, 4, 4), (1, 4, 4)]] * 3:  # 16, 32 and 32 patches
            patches, grid = random_patches(grids, tower, gen)
            torch.testing.assert_close(grided.pictures(patches, grid)[0], tower.pictures(patches, grid)[0])
    assert captured == [((1, 4, 4),), ((1, 4, 8),)]  # 48 held: the third key's 32 would pass 60


def test_a_graph_idle_for_long_gives_its_place_to_a_key_that_comes_again(tiny_qwen, monkeypatch):
    """With the caps full, a key seen twice takes the place of the graph idle longest, if that one
    has been idle for more than STALE_BATCHES batches; while every graph is in use, it runs eagerly."""
    from services.vision import graphs

    captured = fake_captures(monkeypatch)
    monkeypatch.setattr(graphs, "STALE_BATCHES", 3)
    tower = load_vision_tower(load_spec(tiny_qwen), torch.device("cpu"), torch.float32)
    grided = graphs.GridGraphs(tower, max_graphs=2)
    a, b, c, d = ((1, 4, 4),), ((1, 4, 8),), ((1, 8, 4),), ((1, 8, 8),)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n, key in enumerate([a, a, b, b, c, c, b, d, d], start=1):
            patches, grid = random_patches(key, tower, gen)
            torch.testing.assert_close(grided.pictures(patches, grid)[0], tower.pictures(patches, grid)[0])
            if n == 6:  # a idle for 4 batches (> 3): dropped for c
                assert captured == [a, b, c] and set(grided._graphs) == {b, c}
    assert captured == [a, b, c] and set(grided._graphs) == {b, c}  # d: b and c used within 3 batches
