"""python -m bench.schedule_sim: the engine's scheduler under a model of each step's time."""

import re
import subprocess
import sys

STEPS = [
    *("--decode-ms", "1:4,8:5,32:7", "--prompt-640-ms", "14", "--prompt-2048-ms", "40", "--prompt-extra-ms", "2"),
    *("--front-ms", "15", "--back-ms", "2", "--warmup", "0", "--seeds", "1"),
]


def run(*args: str) -> list[list[str]]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.schedule_sim", *STEPS, *args], capture_output=True, text=True, check=True
    ).stdout
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()[2:] if line.startswith("|")]


def test_alone_a_request_takes_front_prefill_its_decode_steps_and_back():
    # 0.05 req/s for 200 s: requests never overlap, so each one's latency is exact:
    # 15 before, 14 + 2 for the 608-position prompt (640 rows), 15 decode steps of 4, 2 after.
    (row,) = run("--rates", "0.05", "--duration", "200")
    assert row[1] == "93 / 93 (93-93)"
    assert row[2] == "31 / 31" and row[3] == "4.0 / 4.0"


def test_under_load_every_request_finishes_and_latency_grows_with_the_rate():
    low, high = run("--rates", "5,30", "--duration", "60")
    done, sent = map(int, re.match(r"(\d+) of (\d+)", high[4]).groups())
    assert done == sent > 1500  # none is lost in the schedule
    assert int(high[1].split(" / ")[0]) > int(low[1].split(" / ")[0])


def test_split_lanes_alone_cost_the_scaled_prefill_then_decode_steps_apart():
    # Alone: 15 before, (14 + 2) x 1.5 for the prompt on its SMs, 15 decode steps of 4 x 1.25, 2 after.
    (row,) = run("--lanes", "split", "--split-prefill-scale", "1.5", "--split-decode-scale", "1.25",
                 "--rates", "0.05", "--duration", "200")  # fmt: skip
    assert row[1] == "116 / 116 (116-116)"
    assert row[2] == "39 / 39" and row[3] == "5.0 / 5.0"


def test_split_lanes_under_load_finish_every_request_and_keep_decodes_from_waiting():
    (shared,) = run("--rates", "30", "--duration", "60")
    (split,) = run("--lanes", "split", "--split-prefill-scale", "1.2", "--rates", "30", "--duration", "60")
    done, sent = map(int, re.match(r"(\d+) of (\d+)", split[4]).groups())
    assert done == sent > 1500
    # TPOT p99: a decode step never waits for a prompt in the split lanes.
    assert float(split[3].split(" / ")[1]) < float(shared[3].split(" / ")[1])
