"""Two minutes of a QoS mix after a minute's warm-up, from 6 clients in a closed loop on the demo
mesh (8 sequences a batch: some 70% of its capacity; python -m bench.soak, run as its users run
it): nothing lost, no descriptor or shared-memory segment left over, and no service's memory
growing past a leak's bound after the warm-up. A closed loop, not Poisson arrivals at a rate measured once: the host may
be busy with other work (another test run beside this one), and a rate it could keep at the start
would build a queue later, which is load, not a leak.

The caches are small here (an 8 MiB feature cache, a 0.02 GiB KV pool, 256 image keys in the
gateway), so that they are full within the warm-up: a cache that fills up to its bound is not a
leak, but at the default sizes the vision's and the llm's private memory rise by some 10 MiB over
the first five minutes while they fill, and then stay flat (docs/PERF.md, "Soak, 30 minutes"),
and the gateway's by 0.5-0.9% in two minutes, an image key per fresh picture (8,192 of about 250
bytes at most).

Growth is the Theil-Sen trend of a sample a second (bench/soak.py, `growth_of`), held to issue
19's 1%. The services cap glibc's malloc arenas (`--malloc-arenas`, 4 by default): with glibc's
own limit the llm's private memory rose by 1.0-1.5% in 3 of 8 such runs on the 2-core host while
its bytes in use stayed flat, free space stranded across its threads' arenas (docs/PERF.md, "CPU:
the llm's memory drift in the 2-minute soak was glibc's arenas"). They also hold glibc's heap
(`--malloc-hold-mib`): with its moving thresholds each batch's blocks were mapped and unmapped and
the heap trimmed, and
CI saw the llm's private memory at +1.8% at two minutes, +1.46% at four (docs/perf/
2026-12-06-cpu-held-heap.md). A held heap rises to its working set in steps, the last of them up
to about a minute into the load (once at 61 s on CI's host): the warm-up is 60 s, after which no
run of that record rose by more than 0.6%, and this test's own runs since by at most 0.62%.

Even so the vision's private memory swings between about 271 and 284 MiB from one second to the
next (a batch's tensors, glibc's heap growing and trimmed), and CI's host saw a 100-second trend of
+1.13% once, where a 300-second run here put no 100-second window past +0.33% (docs/perf/
2026-12-06-cpu-soak-sequential.md). So the soak is a sequential test (`--extend-to`): past the bound
two minutes after the warm-up, the load goes on to five; then the two fresh minutes must hold the
same 1% and the four minutes after the warm-up 2% (bench/soak.py `verdict`, RSS and private
memory both). A leak rises in both;
a step the held heap took once does not: a clean clone of `a296e3d` failed with the llm flat at
304-306 MiB, a step to 309-313 at 110 s, flat again after (+2.04% over 60-180 s, +1.04% over
60-300 s, -0.03% over 180-300 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

MAX_GROWTH = 0.01
pytestmark = pytest.mark.timeout(600)  # five minutes of load when it goes on, and the mesh's start
SMALL_CACHES = ["--", "--feature-cache-mib", "8", "--kv-cache-gib", "0.02", "--image-key-cache", "256"]


def test_two_minutes_of_a_qos_mix_lose_nothing_and_leak_nothing(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.soak", "--model", str(ROOT / "models" / "demo"), "--duration", "180"]
    cmd += ["--warmup", "60", "--clients", "6", "--sample-s", "1", "--max-growth", str(MAX_GROWTH), "--out", str(out)]
    cmd += ["--extend-to", "300", "--judge-memory", "rss,private"]
    cmd += SMALL_CACHES
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), result.stderr[-3000:]
    soak = json.loads(out.read_text())
    keys = (
        "capacity_rps",
        "offered_rps",
        "sent",
        "statuses",
        "lost",
        "growth_after_warmup",
        "growth_fresh",
        "extended",
    )
    summary = {k: soak[k] for k in keys}
    print(json.dumps(summary))
    assert soak["sent"] > 100 and soak["lost"] == 0, summary
    assert soak["statuses"].get("OK", 0) >= 0.9 * soak["sent"], summary  # below capacity: nearly all answered
    series = {n: [round(x[n]["private_mib"]) for x in soak["samples"]] for n in soak["growth_after_warmup"]}
    assert not soak["problems"], (soak["problems"], series)  # the series: what a failure leaves to read
    assert soak["shm_segments"]["end"] <= soak["shm_segments"]["start"] + 1, soak["shm_segments"]
    assert result.returncode == 0, result.stderr[-3000:]
