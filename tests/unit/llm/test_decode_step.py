"""The decode step as CUDA runs it (flex_attention over the block tables, compiled), here on the
CPU, against the eager step that gathers pages: same logits, same pool contents. (On CUDA each
layer is compiled whole around flex; inductor's CPU flex template cannot, so here flex alone is.)"""

from __future__ import annotations

import torch

from services.common.buckets import batch_buckets
from services.llm.attention import FlexDecode, GatherDecode
from services.llm.decode import DecodeStep
from services.llm.kv_cache import PagedKvCache
from services.model.checkpoint import load_decoder
from services.model.llama import rope_tables
from services.model.spec import load_spec

PAGE, N_PAGES, BATCH = 8, 70, 4  # the pool holds a full context (512 positions), as pool_pages ensures


def build(spec, compiled: bool):
    cpu = torch.device("cpu")
    model = load_decoder(spec, cpu, torch.float32)
    kv = PagedKvCache(spec, cpu, torch.float32, N_PAGES, PAGE)
    gen = torch.Generator().manual_seed(3)
    for t in (*kv.k, *kv.v):  # earlier positions: random K/V already in the pool
        t.copy_(torch.randn(t.shape, generator=gen))
    width = -(-spec.text.max_context // PAGE)
    inputs = (
        torch.zeros(BATCH, dtype=torch.int32),
        torch.zeros(BATCH, dtype=torch.int32),
        torch.zeros(BATCH, width, dtype=torch.int32),
        torch.zeros(BATCH, dtype=torch.int32),
    )
    t = spec.text
    attn = (
        FlexDecode(PAGE, t.heads, t.kv_heads, N_PAGES, BATCH, cpu, fuse_layer=False)
        if compiled
        else GatherDecode(PAGE, t.heads, t.kv_heads)
    )
    step = DecodeStep(
        model, kv, attn, rope_tables(spec, cpu, torch.float32), inputs, torch.tensor(t.eos_token_ids), BATCH
    )
    return step, inputs, kv


def test_compiled_flex_step_equals_the_eager_gather_step(tiny_model):
    spec = load_spec(tiny_model)
    tables = [[3, 9, 1], [12], [30, 31, 32, 33]]
    positions = [17, 5, 24]
    results = []
    for compiled in (False, True):
        step, (tok, pos, tab, ban), kv = build(spec, compiled)
        for i, (row, p) in enumerate(zip(tables, positions, strict=True)):
            tok[i], pos[i] = 7 + i, p
            tab[i, : len(row)] = torch.tensor(row)
        ban[1] = 1  # min_tokens not reached: its EOS may not win
        step.forward(len(tables), max_len=max(positions) + 1)
        written = torch.stack(
            [kv.k[0][:, tables[i][positions[i] // PAGE] * PAGE + positions[i] % PAGE] for i in range(3)]
        )
        results.append((step.logits[:3].clone(), step.greedy[:3].clone(), written))
    (logits, greedy, written), (logits_c, greedy_c, written_c) = results
    torch.testing.assert_close(logits_c, logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(greedy_c, greedy)
    torch.testing.assert_close(written_c, written)  # the compiled step stored its K/V in the pool, in place
    assert torch.isinf(logits[1, list(spec.text.eos_token_ids)]).all()


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]


def test_compiled_prefill_halves_equal_eager_for_any_token_count(tiny_model):
    """The prefill's layer halves, compiled once with a dynamic token count (as on CUDA)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from services.llm.attention import prefill_in, prefill_out

    spec = load_spec(tiny_model)
    cpu = torch.device("cpu")
    model = load_decoder(spec, cpu, torch.float32)
    layer = model.layers[0]
    counter = CompileCounterWithBackend("inductor")
    compiled_in, compiled_out = (torch.compile(f, dynamic=True, backend=counter) for f in (prefill_in, prefill_out))
    cos_t, sin_t = rope_tables(spec, cpu, torch.float32)
    for n in (37, 90):
        kv = PagedKvCache(spec, cpu, torch.float32, N_PAGES, PAGE)
        kv_c = PagedKvCache(spec, cpu, torch.float32, N_PAGES, PAGE)
        x = torch.randn(n, spec.text.hidden)
        pos, slots = torch.arange(n), torch.arange(n) + PAGE
        cos, sin = cos_t[pos], sin_t[pos]
        q, k, v = prefill_in(layer, x, cos, sin, kv.k[0], kv.v[0], slots)
        qc, kc, vc = compiled_in(layer, x, cos, sin, kv_c.k[0], kv_c.v[0], slots)
        for a, b in ((q, qc), (k, kc), (v, vc), (kv.k[0], kv_c.k[0]), (kv.v[0], kv_c.v[0])):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        o = torch.randn_like(q)
        torch.testing.assert_close(compiled_out(layer, x, o), prefill_out(layer, x, o), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 2  # one graph each for the two halves, whatever the token count
