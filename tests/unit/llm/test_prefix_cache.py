"""Prefix KV reuse: page keys, shared and cached pages, and a hit that decodes exactly as a miss."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.llm.block_manager import BlockManager
from services.llm.config import NativeEngineConfig
from services.llm.prefix import PART, page_keys, part_keys
from tests.helpers import PROMPTS, Parts

IMG_A, IMG_B = b"a" * 16, b"b" * 16


# --- page keys ---


def test_keys_chain_over_full_pages_and_name_the_image():
    ids = list(range(20))
    with_a = page_keys(ids, [(4, 8, IMG_A)], 4)
    assert len(with_a) == 5  # full pages only
    assert page_keys(ids, [(4, 8, IMG_A)], 4) == with_a
    with_b = page_keys(ids, [(4, 8, IMG_B)], 4)
    assert with_b[0] == with_a[0] and with_b[1] != with_a[1]  # equal up to the image, apart from it on
    assert all(x != y for x, y in zip(with_a[1:], with_b[1:], strict=True))  # the chain carries it
    moved = page_keys(ids, [(5, 8, IMG_A)], 4)
    assert moved[1] != with_a[1]  # the same image elsewhere is another prompt
    other_text = page_keys([*ids[:18], 99, 98], [(4, 8, IMG_A)], 4)
    assert other_text[:4] == with_a[:4] and other_text[4] != with_a[4]


def test_part_keys_name_each_leading_part_and_the_prompts_end():
    ids = list(range(150))
    full = page_keys(ids, [(4, 8, IMG_A)], 64)
    # A full page: its parts every PART positions, longest first; the prompt's last page: up to its end.
    assert [n for n, _ in part_keys(ids, [(4, 8, IMG_A)], 64, 1, full[0])] == [48, 32, 16]
    assert [n for n, _ in part_keys(ids, [(4, 8, IMG_A)], 64, 0, b"")] == [48, 32, 16, 12]  # and the image's end
    tail = part_keys(ids, [(4, 8, IMG_A)], 64, 2, full[1])
    assert [n for n, _ in tail] == [22, 16] and PART == 16
    # Equal up to position 128 + 20: the parts that end before it are equal, the others are not.
    other = part_keys([*ids[:148], 7, 7], [(4, 8, IMG_A)], 64, 2, full[1])
    assert other[1] == tail[1] and other[0][1] != tail[0][1]
    # Another image before it changes every part (the chain), and so does a keyless one in it.
    assert part_keys(ids, [(4, 8, IMG_B)], 64, 2, page_keys(ids, [(4, 8, IMG_B)], 64)[1])[1] != tail[1]
    assert part_keys(ids, [(20, 8, b"")], 64, 0, b"") == [(16, part_keys(ids, [], 64, 0, b"")[-1][1])]
    assert part_keys(ids[:64], [], 64, 1, b"") == []  # the prompt holds nothing of page 1


def test_an_image_without_a_key_ends_the_chain():
    assert len(page_keys(list(range(20)), [(6, 8, b"")], 4)) == 1  # page 0 only: page 1 reads the image


# --- the block manager ---


def test_shared_pages_are_counted_and_cached_ones_count_as_free():
    bm = BlockManager(n_pages=5, page_size=4)  # 4 usable
    a = bm.allocate(2)
    bm.register(a[0], [b"k0"])
    bm.register(a[1], [b"k1"])
    assert bm.lookup([b"k0", b"k1", b"k2"]) == a
    bm.share(a)  # a second holder
    bm.release(a)
    assert bm.free == 2  # still held once
    bm.release(a)
    assert bm.free == 4 and bm.cached == 2  # cached, and free to take
    assert bm.can_allocate(3, sharing=a[:1]) is True
    assert bm.can_allocate(4, sharing=a[:1]) is False  # sharing a cached page takes it out of the free count


def test_allocation_takes_free_pages_first_then_evicts_the_least_recently_released():
    bm = BlockManager(n_pages=4, page_size=4)  # 3 usable
    p = bm.allocate(3)
    for page, key in zip(p, [b"x", b"y", b"z"], strict=True):
        bm.register(page, [key])
    bm.release([p[1]])
    bm.release([p[0]])
    bm.release([p[2]])  # released order: y, x, z
    assert bm.allocate(1) == [p[1]] and bm.lookup([b"y"]) == [] and bm.evictions == 1
    assert bm.lookup([b"x"]) == [p[0]]  # not evicted
    bm.share([p[0]])
    assert bm.allocate(1) == [p[2]]  # x is held: z goes
    with pytest.raises(RuntimeError):
        bm.allocate(1)


def test_a_key_held_by_another_page_stays_with_it():
    bm = BlockManager(n_pages=4, page_size=4)
    a, b = bm.allocate(2)
    bm.register(a, [b"k"])
    bm.register(b, [b"k"])  # computed the same prefix at the same time
    assert bm.lookup([b"k"]) == [a]
    bm.release([b])
    assert bm.free == 2 and bm.cached == 1  # b went back to the free list, uncached


def test_a_first_token_is_kept_per_eos_ban_while_its_key_is_and_goes_with_it():
    bm = BlockManager(n_pages=3, page_size=4)  # 2 usable
    (a,) = bm.allocate(1)
    bm.note_first(b"k", False, 7)  # a key the pool does not hold: nothing kept
    assert bm.first_token(b"k", False) is None
    bm.register(a, [b"k"])
    bm.note_first(b"k", False, 7)
    bm.note_first(b"k", False, 8)  # the first one noted stays
    assert bm.first_token(b"k", False) == 7 and bm.first_token(b"k", True) is None
    bm.note_first(b"k", True, 9)
    assert bm.first_token(b"k", True) == 9
    bm.release([a])
    assert bm.first_token(b"k", False) == 7  # cached, not evicted
    bm.allocate(2)  # evicts it
    assert bm.first_token(b"k", False) is None and bm.first_token(b"k", True) is None


# --- the engine: a hit decodes exactly as a miss (CPU, fp32) ---


def first_tokens() -> float:
    return REGISTRY.get_sample_value("vlmesh_prefix_first_tokens_total") or 0.0


def one_at_a_time(parts, jobs):
    """Each (picture seed, prompt) alone, in order, so that each finds what those before it computed:
    the tokens of each, and its Request."""
    got, reqs = [], []
    for seed, prompt in jobs:
        req, box = parts.request(seed, prompt, max_tokens=10, min_tokens=10)
        parts.run((req, box))
        got.append(box["ids"])
        reqs.append(req)
    return got, reqs


@pytest.fixture(scope="module")
def engines(tiny_model):
    on = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(kv_page_size=4))
    off = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(kv_page_size=4, prefix_cache=False))
    yield on, off
    on.engine.stop()
    off.engine.stop()


def test_hits_decode_exactly_as_misses_and_different_images_share_nothing(engines):
    on, off = engines
    jobs = [(0, PROMPTS[0]), (0, PROMPTS[0]), (0, PROMPTS[1]), (1, PROMPTS[0]), (0, PROMPTS[0])]
    answered = first_tokens()
    got, reqs = one_at_a_time(on, jobs)
    want, uncached = one_at_a_time(off, jobs)
    assert got == want and all(r.cached_tokens == 0 for r in uncached)
    assert first_tokens() - answered == 2  # the two repeats of the first job
    cached = [r.cached_tokens for r in reqs]
    req0, _ = on.request(0, PROMPTS[0])
    n, image_at = req0.prompt_len, req0.image_positions[0]
    assert cached[0] == 0
    assert cached[1] == n  # the whole prompt, with its first token: no forward before its decode
    assert image_at + 16 <= cached[2] < n  # the image and the shared leading text, not the question
    assert cached[3] == image_at // 4 * 4  # another image of equal size: only the text before it
    assert cached[4] == cached[1]
    pages = on.engine.scheduler.blocks
    assert pages.free == pages.capacity and pages.cached > 0


def test_concurrent_equal_prompts_share_once_registered_and_all_decode_alike(engines):
    on, _ = engines
    pairs = [on.request(5, PROMPTS[2], max_tokens=6, min_tokens=6) for _ in range(3)]
    on.run(*pairs)
    later = on.request(5, PROMPTS[2], max_tokens=6, min_tokens=6)
    on.run(later)
    assert all(box["ids"] == later[1]["ids"] for _, box in pairs)
    assert later[0].cached_tokens > 0


@pytest.fixture(scope="module", params=["chunks", "packed"])
def big_pages(tiny_model, request):
    """Pages of 64 positions, in which a prompt ends part-way through; both prefill paths."""
    on = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(kv_page_size=64, prefill=request.param))
    off = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(kv_page_size=64, prefix_cache=False))
    yield on, off
    on.engine.stop()
    off.engine.stop()


def test_parts_of_a_page_are_copied_and_decode_exactly_as_misses(big_pages):
    """A repeated prompt copies all its last page's positions but one; another question about the
    same picture copies the leading parts they have in common; another picture, nothing past the
    text before it. Each decodes as the pool without a cache does."""
    on, off = big_pages
    ask = "Look at the picture closely and tell me, in a few words, what "
    jobs = [(0, ask + "shape it is."), (0, ask + "shape it is."), (0, ask + "color it is."), (1, ask + "shape it is.")]
    got, reqs = one_at_a_time(on, jobs)
    want, _ = one_at_a_time(off, jobs)
    assert got == want
    cached, ids = [r.cached_tokens for r in reqs], [r.prompt_ids for r in reqs]
    req0, _ = on.request(*jobs[0])
    n, image_at = req0.prompt_len, req0.image_positions[0]
    assert image_at > 0
    common = next(i for i, (a, b) in enumerate(zip(ids[0], ids[2], strict=False)) if a != b)
    assert cached == [0, n, common // PART * PART, image_at // PART * PART]
    assert cached[2] >= image_at + 16  # the picture's positions were copied, not computed again
    # A repeat beside a new prompt: its decodes ride in the prompt's step.
    pairs = [
        on.request(*jobs[0], max_tokens=10, min_tokens=10),
        on.request(7, jobs[0][1], max_tokens=10, min_tokens=10),
    ]
    on.run(*pairs)
    assert pairs[0][1]["ids"] == want[0] and pairs[0][0].cached_tokens == n
    alone = off.request(7, jobs[0][1], max_tokens=10, min_tokens=10)
    off.run(alone)
    assert pairs[1][1]["ids"] == alone[1]["ids"]
    pages = on.engine.scheduler.blocks
    assert pages.free == pages.capacity and pages.cached > 0


def test_only_a_greedy_repeat_under_the_same_eos_ban_takes_its_first_token_from_the_cache(big_pages):
    """A sampled repeat computes its prompt's last position (as a decode row) and draws from it with
    its own generator. A greedy repeat with EOS banned (min_tokens) where the kept token's was not,
    or the reverse, computes it too. Each gives the tokens of the pool without a cache."""
    on, off = big_pages
    prompt = "Which shape do you see in this picture? Answer in one word."
    asked = [
        {"min_tokens": 6},
        {"min_tokens": 6, "temperature": 0.8, "seed": 4},  # sampled, and beside it
        {"min_tokens": 6, "temperature": 0.8, "seed": 4, "top_p": 0.9},
        {},  # EOS not banned: the kept token is the banned one's
        {},
        {"min_tokens": 6},
    ]

    def ask(parts, sampling):
        req, box = parts.request(11, prompt, max_tokens=6, **sampling)
        parts.run((req, box))
        return req, box["ids"]

    answered = first_tokens()
    got = [ask(on, s) for s in asked]
    assert [ids for _, ids in got] == [ask(off, s)[1] for s in asked]
    n = got[0][0].prompt_len
    assert [r.cached_tokens for r, _ in got] == [0, n - 1, n - 1, n - 1, n, n]
    assert first_tokens() - answered == 2
    pages = on.engine.scheduler.blocks
    assert pages.free == pages.capacity
