"""The benchmark harness checked on its own: percentiles, arrivals, and accounting."""

from __future__ import annotations

import asyncio
import io
import math
import random
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from services.bench.load import poisson_offsets, run_open_loop
from services.bench.report import qos_table, summarize_run
from services.bench.stats import exponential_ks, percentile, summarize
from services.bench.targets import Outcome
from services.bench.workloads import WORKLOADS, RequestFactory, padded_prompt
from services.common.timings import Timings


@pytest.mark.parametrize("q", [0, 1, 10, 50, 90, 99, 99.9, 100])
def test_percentiles_match_numpy(q):
    sample = list(np.random.default_rng(1).lognormal(3, 1, 1001))
    assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def test_percentiles_on_a_known_sample():
    sample = list(range(1, 101))  # 1..100
    s = summarize(sample)
    assert (s["p50"], s["p90"], s["p99"], s["mean"]) == (50.5, 90.1, 99.01, 50.5)
    assert math.isnan(percentile([], 50))


def test_poisson_interarrivals():
    rate, duration = 20.0, 500.0
    offsets = poisson_offsets(rate, duration, np.random.default_rng(7))
    gaps = np.diff([0.0, *offsets])
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert len(offsets) == pytest.approx(rate * duration, rel=0.05)
    # Kolmogorov-Smirnov against Exponential(rate): critical value at alpha = 0.01 is 1.63 / sqrt(n).
    assert exponential_ks(gaps, rate) < 1.63 / math.sqrt(len(gaps))
    # ...and the test has teeth: uniform gaps with the same mean fail it.
    uniform = np.random.default_rng(7).uniform(0, 2 / rate, len(gaps))
    assert exponential_ks(uniform, rate) > 1.63 / math.sqrt(len(gaps))


class FlakyTarget:
    """Answers OK, errors, or raises, at random; never loses a request."""

    def __init__(self) -> None:
        self.rng = random.Random(3)

    async def send(self, req):
        await asyncio.sleep(self.rng.uniform(0, 0.02))
        roll = self.rng.random()
        if roll < 0.1:
            raise RuntimeError("target bug")
        if roll < 0.3:
            return Outcome("RESOURCE_EXHAUSTED", 0.001)
        return Outcome("OK", 0.01, 0.004, 16, Timings(prefill=0.001))


def test_sent_equals_sum_of_statuses(tiny_model):
    from transformers import AutoTokenizer

    factory = RequestFactory(WORKLOADS["W3"], AutoTokenizer.from_pretrained(tiny_model), 0, (0.2, 0.6, 0.2))
    records, client = asyncio.run(run_open_loop(FlakyTarget(), factory, 200.0, 1.0, seed=0, progress=False))
    summary = summarize_run(records, 200.0, 1.0, 0.2, client)
    assert summary["sent"] == sum(summary["statuses"].values()) > 150
    assert summary["lost"] == 0
    assert set(summary["statuses"]) == {"OK", "RESOURCE_EXHAUSTED", "CLIENT_RuntimeError"}
    assert summary["tpot_ms"]["p50"] == pytest.approx(6 / 15)
    qos = [r.request.qos for r in records]
    assert 0.1 < sum(q.wire == "realtime" for q in qos) / len(qos) < 0.3
    by_qos = summary["by_qos"]
    assert set(by_qos) == {"realtime", "standard", "best-effort"}
    assert by_qos["realtime"]["sent"] == sum(q.wire == "realtime" for q in qos)
    assert sum(c["sent"] for c in by_qos.values()) == summary["sent"]
    for wire, c in by_qos.items():  # each class's statuses are its own requests'
        assert c["statuses"] == dict(Counter(r.outcome.status for r in records if r.request.qos.wire == wire))
    assert sum(c["e2e_ms"]["n"] for c in by_qos.values()) == summary["e2e_ms"]["n"]
    run = {"target": "flaky", "workload": "W3", "summary": summary}
    lines = qos_table([run]).splitlines()
    assert [line.split()[3] for line in lines[1:4]] == ["realtime", "standard", "best-effort"]
    assert qos_table([{**run, "summary": {**summary, "by_qos": {"standard": by_qos["standard"]}}}]) == ""


def test_workload_requests(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok(padded_prompt(tok, 32), add_special_tokens=False)["input_ids"]) == 32
    w3 = RequestFactory(WORKLOADS["W3"], tok, 0, (0.2, 0.6, 0.2))
    keys = [w3.make(i).image_key for i in range(400)]
    assert set(keys) <= set(range(50)) and keys.count(0) > keys.count(49)  # Zipf: rank 1 is most common
    w1 = RequestFactory(WORKLOADS["W1"], tok, 0, (0.2, 0.6, 0.2))
    assert len({w1.make(i).images for i in range(20)}) == 20  # all distinct
    assert w1.make(3).images == w1.make(3).images  # but reproducible
    # The next run of a sweep sends images of its own (else a KV pool still holding the first
    # run's pages answers W1 prompts from the prefix cache); a W3 pool is the same in every run.
    w1_next = RequestFactory(WORKLOADS["W1"], tok, 0, (0.2, 0.6, 0.2), run=1)
    assert not {w1.make(i).images for i in range(20)} & {w1_next.make(i).images for i in range(20)}
    assert not {w1.make(i).image_key for i in range(20)} & {w1_next.make(i).image_key for i in range(20)}
    w3_next = RequestFactory(WORKLOADS["W3"], tok, 0, (0.2, 0.6, 0.2), run=1)
    assert w3_next.image(7) == w3.image(7)
    # W4: two distinct 1280x720 pictures a request, none shared with another request.
    w4 = RequestFactory(WORKLOADS["W4"], tok, 0, (0.2, 0.6, 0.2))
    pictures = [d for i in range(5) for d in w4.make(i).images]
    assert len(pictures) == len(set(pictures)) == 10
    assert Image.open(io.BytesIO(pictures[0])).size == (1280, 720)


def test_closed_loop_keeps_n_in_flight_and_counts_everything(tiny_model):
    from transformers import AutoTokenizer

    from services.bench.load import run_closed_loop

    class Counting(FlakyTarget):
        in_flight = peak = 0

        async def send(self, req):
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                return await super().send(req)
            finally:
                self.in_flight -= 1

    target = Counting()
    factory = RequestFactory(WORKLOADS["W1"], AutoTokenizer.from_pretrained(tiny_model), 0, (0.0, 1.0, 0.0))
    records, _ = asyncio.run(run_closed_loop(target, factory, 4, 0.5, progress=False))
    # Each client sends again as its last request ends: more than one round in 0.5 s of ~10 ms sends
    # (not a rate: building each request's picture is CPU work, slow on a loaded CI machine).
    assert target.peak == 4 and len(records) > 2 * 4
    assert len({r.request.index for r in records}) == len(records)  # every request is its own
    summary = summarize_run(records, 0.0, 0.5, 0.0, {"send_lag_ms": 0})
    assert summary["lost"] == 0 and summary["sent"] == sum(summary["statuses"].values())


def test_peer_checkpoint_renames_vision_keys_and_adds_bos(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from services.bench.peer import prepare_checkpoint

    src = tmp_path / "ckpt"
    src.mkdir()
    save_file(
        {
            "vision_tower.embeddings.class_embedding": torch.zeros(2),
            "vision_tower.vision_model.encoder.layers.0.x": torch.zeros(1),  # already in vLLM's layout
            "language_model.model.embed_tokens.weight": torch.ones(3, 2),
        },
        str(src / "model.safetensors"),
    )
    (src / "config.json").write_text("{}")
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m }}{% endfor %}")
    out = prepare_checkpoint(str(src), tmp_path / "peer")
    assert sorted(load_file(out / "model.safetensors")) == [
        "language_model.model.embed_tokens.weight",
        "vision_tower.vision_model.embeddings.class_embedding",
        "vision_tower.vision_model.encoder.layers.0.x",
    ]
    assert (out / "chat_template.jinja").read_text().startswith("{{ bos_token }}{% for")
    assert (out / "config.json").is_file()
    assert prepare_checkpoint(str(src), tmp_path / "peer") == out  # made once


def test_cache_summary_splits_hits_from_misses_and_bounds_the_hit_ratio():
    from services.bench.load import Record
    from services.bench.report import cache_table
    from services.bench.workloads import BenchRequest
    from services.common.qos import QosLevel

    def record(i: int, t: float, key: int, hit: bool, ttft: float, cached: int = 0) -> Record:
        stages = Timings() if hit else Timings(preprocess=0.002, vision=0.01)
        outcome = Outcome("OK", 0.1, ttft, 4, stages, cached_tokens=cached)
        return Record(BenchRequest(i, b"", key, "p", 4, QosLevel.STANDARD), t, t, outcome)

    records = [
        record(0, 0.5, 1, False, 0.050),  # warm-up
        record(1, 2.0, 1, True, 0.010, cached=128),
        record(2, 3.0, 2, False, 0.060),
        record(3, 4.0, 2, True, 0.020, cached=128),
        record(4, 5.0, 3, False, 0.040),
    ]
    summary = summarize_run(records, rate=1.0, duration_s=6.0, warmup_s=1.0, client={})
    c = summary["cache"]
    assert c["feature_hit_ratio"] == 0.5 and c["prefix_hit_ratio"] == 0.5
    assert c["repeat_ratio"] == 0.5  # keys 1 (seen in warm-up) and 2 (seen at 3.0) repeat; 2 and 3 are new
    assert c["ttft_ms_hit"]["p50"] == pytest.approx(15.0) and c["ttft_ms_miss"]["p50"] == pytest.approx(50.0)
    text = cache_table([{"target": "mesh", "workload": "W3", "summary": summary}])
    assert "50.0%" in text and "0.30" in text  # the hit/miss TTFT ratio
    assert cache_table([{"target": "mesh", "workload": "W1", "summary": {**summary, "cache": {}}}]) == ""


def test_mesh_flags_are_checked_as_vlmesh_up_flags_before_anything_starts(capsys):
    from services.bench.args import build_parser, parse_args

    parser = build_parser("bench")
    args = parse_args(parser, ["--model", "m", "--mesh-flags", "--switch-interval-ms 0.1 --kv-page-size 64"])
    assert args.mesh_flags == "--switch-interval-ms 0.1 --kv-page-size 64"
    for flags, said in (
        ("--no-such-flag 1", "are not flags of vlmesh up"),
        ("--kv-page-size 3", "--kv-page-size 3 must be 0 (auto) or a power of two"),
        # The bench sets these itself: its own value would win unseen.
        ("--kv-cache-gib 2 --max-prefill-tokens 1024", "--max-prefill-tokens is set by the bench itself"),
        ("--kv-page-size 64 --max-vision-batch=2", "--max-vision-batch is set by the bench itself"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(parser, ["--model", "m", "--mesh-flags", flags])
        assert exit_.value.code == 2
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(parser, ["--model", "m", "--gateway", "h:1", "--mesh-flags", "--kv-page-size 64"])
    assert "not with --gateway" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny_model", "tiny_deepseek_hybrid", "tiny_qwen"])
def test_the_transformers_target_runs_every_family(model, request):
    """`--target hf`: transformers' own model class of the family, fed the family's pixels by
    transformers' names, generates the forced number of tokens."""
    from services.bench.targets import HfTarget
    from services.bench.workloads import BenchRequest
    from services.common.qos import QosLevel
    from tests.helpers import image_bytes

    target = HfTarget(str(request.getfixturevalue(model)), "cpu")
    req = BenchRequest(0, (image_bytes(3, (120, 80), "JPEG"),), 0, "What is in the image?", 6, QosLevel.STANDARD)
    outcome = asyncio.run(target.send(req))
    assert (outcome.status, outcome.output_tokens) == ("OK", 6)
    assert outcome.ttft_s is not None and 0 < outcome.ttft_s <= outcome.e2e_s
