"""The packed step (services/llm/packed.py) against the per-chunk reference, on the CPU.

Two runners on the same weights (fp32) take the same steps: prefill chunks that start, continue
and complete sequences, decodes beside them, a prefix page shared by sequences in one step, image
features written over placeholders, several blocks of 128 query rows with full blocks among
them, decodes riding in the packed rows. After every step the tokens are equal and every
layer's K/V in the pool is close: each row's attention fed the layers after it, so a row that
saw a wrong position would show there.
On CUDA the packed forward is graph-captured; here it runs eagerly, with flex compiled alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from services.common.sampling import Sampling
from services.llm.kv_cache import KvConfig
from services.llm.packed import row_buckets
from services.llm.packed_mask import Q_BLOCK
from services.llm.request import Request
from services.llm.runner import ModelRunner, RunnerConfig
from services.llm.scheduler import Chunk
from services.model.spec import load_spec

PAGE = 16
GREEDY = Sampling(max_tokens=None, temperature=0.0, top_p=1.0, seed=None, stop=(), min_tokens=0, ignore_eos=True)


@dataclass
class Seq:
    """What the runner reads of a request."""

    prompt_ids: list[int]
    blocks: list[int]
    computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    image_positions: list[int] = field(default_factory=list)
    image_features: list = field(default_factory=list)
    copy_features: bool = False
    kv_copy: tuple[int, int] | None = None
    features_end: int = 0
    sampling: Sampling = GREEDY
    unseen: int = 0  # every token is back (the engine's step ahead is not in these tests)

    @property
    def prefill_target(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def generated(self) -> int:
        return len(self.output_ids)

    token_at = Request.token_at


def runner(spec, packed: bool, budget: int = 400) -> ModelRunner:
    return ModelRunner(
        spec, torch.device("cpu"), torch.float32, RunnerConfig(6, KvConfig(PAGE, 0.0, 0.6), budget, packed=packed)
    )


def test_row_buckets():
    assert row_buckets(100) == [128]
    assert row_buckets(2048) == [128, 256, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048]
    assert row_buckets(3000)[-3:] == [2048, 2816, 3072]
    assert all(b % Q_BLOCK == 0 for b in row_buckets(5000))


@pytest.fixture(scope="module")
def pair(tiny_model):
    spec = load_spec(tiny_model)
    return spec, runner(spec, packed=False), runner(spec, packed=True)


def test_packed_steps_equal_the_per_chunk_reference(pair):
    spec, ref, packed = pair
    assert ref.packed is None and packed.packed is not None
    gen = torch.Generator().manual_seed(5)
    vocab, hidden = spec.text.vocab, spec.text.hidden

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    def pages(first: int, n: int) -> list[int]:
        return list(range(first, first + n))

    shared = prompt(PAGE)  # one full page two prompts begin with
    ids = [prompt(300), shared + prompt(21), shared + prompt(9), prompt(5), prompt(40), shared + prompt(12)]
    feats = torch.randn(8, hidden, generator=gen)
    runs = {}
    for name, r in (("ref", ref), ("packed", packed)):
        a = Seq(ids[0], pages(1, 20))  # 300 positions in two chunks: 2 query blocks, full blocks
        b = Seq(ids[1], pages(30, 3), image_positions=[4], image_features=[feats], features_end=12)
        c = Seq(ids[2], [30, *pages(40, 2)])  # shares b's first page (the prefix cache)
        d = Seq(ids[3], pages(50, 2))
        e = Seq(ids[5], [30, 45])  # shares it too, in the same step as c
        steps = [
            ([Chunk(a, 0, 160), Chunk(b, 0, 37), Chunk(d, 0, 5)], []),  # a starts; b, d complete
            # a continues and completes; c and e after the shared page; b and d decode beside them
            ([Chunk(a, 160, 300), Chunk(c, PAGE, 25), Chunk(e, PAGE, 28)], [b, d]),
            ([], [a, b, c, d]),  # decodes alone: the decode step in both runners
            ([Chunk(Seq(ids[4], pages(60, 4)), 0, 40)], [a, c]),
        ]
        tokens = []
        for chunks, decodes in steps:
            out = r.step(chunks, decodes)
            if name == "packed" and chunks:  # the decodes rode in the packed rows (6: max_batch)
                assert r.packed.decode_rows == (6 if decodes else 0)
            for req, tok in zip([c.req for c in chunks if c.completes] + decodes, out, strict=True):
                req.output_ids.append(tok)
            tokens.append(out)
            pool = torch.stack([torch.stack([k, v]) for k, v in zip(r.kv.k, r.kv.v, strict=True)])
            runs.setdefault(name, []).append((out, pool.clone()))
    for step, ((want, pool_ref), (got, pool_packed)) in enumerate(zip(runs["ref"], runs["packed"], strict=True)):
        assert got == want, f"step {step}"
        torch.testing.assert_close(pool_packed[:, :, :, PAGE:], pool_ref[:, :, :, PAGE:], atol=1e-4, rtol=1e-4)


def test_the_block_mask_lists_each_page_once_and_whole_pages_as_full(pair):
    step = pair[2].packed
    a = Seq(list(range(3, 303)), list(range(1, 20)), computed=160)
    b = Seq(list(range(3, 30)), [1, 25])  # shares a's first page
    assert step.stage([Chunk(a, 160, 300), Chunk(b, PAGE, 27)])
    h = step._host
    # Block 0: rows of a only (positions 160..287): pages 0..9 of a are wholly before 160.
    assert h["full_num"][0] == 10 and sorted(h["full_idx"][0, :10]) == list(range(1, 11))
    assert sorted(h["kv_idx"][0, : h["kv_num"][0]]) == list(range(11, 19))
    # Block 1: a's last rows, then b's: page 1 (shared) is listed once.
    listed = list(h["kv_idx"][1, : h["kv_num"][1]])
    assert h["full_num"][1] == 0 and len(listed) == len(set(listed)) and 1 in listed and 25 in listed
    assert step.rows == 256 and (h["rank"][151:256] == -1).all()  # padding: in no page's range
    # Ranked by block table: a ([1, 2, ...]) before b ([1, 25]); page 1 is held by both ranks.
    assert list(h["rank"][[0, 150]]) == [0, 1] and (h["lo"][1], h["hi"][1]) == (0, 1)
    assert (h["lo"][25], h["hi"][25], h["logical"][25]) == (1, 1, 1) and (h["lo"][5], h["hi"][5]) == (0, 0)


def test_a_full_prefill_budget_still_carries_the_decodes(pair, tiny_model):
    """A step whose prompt takes the whole budget (384, a row bucket's size) and decodes beside it:
    the top bucket leaves room for them (budget + max_batch rows), and the tokens are the reference's."""
    spec, ref, _ = pair
    packed = runner(spec, packed=True, budget=384)
    gen = torch.Generator().manual_seed(9)
    a_ids, b_ids = (torch.randint(3, spec.text.vocab, (n,), generator=gen).tolist() for n in (20, 384))
    out = {}
    for name, r in (("ref", ref), ("packed", packed)):
        a, b = Seq(a_ids, list(range(70, 73))), Seq(b_ids, list(range(80, 105)))
        first = r.step([Chunk(a, 0, 20)], [])
        a.output_ids.append(first[0])
        out[name] = r.step([Chunk(b, 0, 384)], [a])
        if name == "packed":
            assert r.packed.decode_rows == 6 and r.packed.rows == 512
    assert out["packed"] == out["ref"]


def test_pages_shared_other_than_as_a_leading_run_are_not_packed(pair):
    step = pair[2].packed
    a, b, c = Seq(list(range(3, 40)), [1, 2, 3]), Seq(list(range(3, 40)), [1, 5, 6]), Seq(list(range(3, 40)), [4, 2])
    assert not step.stage([Chunk(a, 0, 37), Chunk(b, 0, 37), Chunk(c, 0, 20)])  # page 2: ranks 1 and 2, not 0
    assert step.stage([Chunk(a, 0, 37), Chunk(b, 0, 37)])
    assert not step.stage([Chunk(Seq(list(range(3, 900)), list(range(1, 60))), 0, 897)])  # over the top bucket


def test_the_engine_answers_alike_with_packed_and_chunked_prefill(tiny_model):
    """Through the engine and its scheduler: images, chunked prompts (a small budget), decodes mixed
    into prefill steps, repeated images sharing prefix pages, preemption-free batching of 3."""
    from services.llm.config import NativeEngineConfig
    from tests.helpers import PROMPTS, Parts, record_decode_rows

    answers = {}
    for mode in ("chunks", "packed"):
        parts = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(prefill=mode, max_prefill_tokens=24))
        try:
            assert (parts.engine.runner.packed is not None) == (mode == "packed")
            rode = record_decode_rows(parts.engine.runner)
            pairs = [parts.request(i % 3, p, max_tokens=12, min_tokens=12) for i, p in enumerate(PROMPTS * 2)]
            parts.run(*pairs)
            answers[mode] = [box["ids"] for _, box in pairs]
            assert parts.engine.scheduler.blocks.free == parts.engine.scheduler.blocks.capacity
            assert mode == "chunks" or any(rode), "no decodes rode in a packed step"
        finally:
            parts.engine.stop()
    assert answers["packed"] == answers["chunks"]


def test_a_fresh_prompt_attends_by_sdpa_and_equals_flex(pair):
    """One chunk from position 0 (decodes riding) takes SDPA over its own rows; with that path off,
    flex over the pool: the same tokens and pool. A continued chunk, or two prompts, take flex."""
    spec, _, packed = pair
    gen = torch.Generator().manual_seed(11)
    a_ids, b_ids = (torch.randint(3, spec.text.vocab, (n,), generator=gen).tolist() for n in (30, 150))
    out = {}
    try:
        for fresh_sdpa in (True, False):
            packed.packed.fresh_sdpa = fresh_sdpa
            a, b = Seq(a_ids, list(range(70, 73))), Seq(b_ids, list(range(80, 90)))
            a.output_ids.append(packed.step([Chunk(a, 0, 30)], [])[0])
            assert packed.packed.fresh == fresh_sdpa
            tokens = packed.step([Chunk(b, 0, 150)], [a])  # fresh, a decode riding
            assert packed.packed.fresh == fresh_sdpa and packed.packed.decode_rows > 0
            pool = torch.stack([torch.stack([k, v]) for k, v in zip(packed.kv.k, packed.kv.v, strict=True)])
            out[fresh_sdpa] = tokens, pool[:, :, :, 70 * PAGE : 90 * PAGE].clone()
            c = Seq(b_ids, list(range(95, 105)))
            packed.step([Chunk(c, 0, 100)], [])
            packed.step([Chunk(c, 100, 150)], [])  # continues: reads its first rows from the pool
            assert not packed.packed.fresh
            packed.step([Chunk(Seq(a_ids, [110, 111]), 0, 30), Chunk(Seq(a_ids, [112, 113]), 0, 30)], [])
            assert not packed.packed.fresh
    finally:
        packed.packed.fresh_sdpa = True
    assert out[True][0] == out[False][0]
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-4, rtol=1e-4)
