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


def test_a_w4_request_alone_takes_its_prompt_in_chunks_of_the_budget():
    # Two pictures of 1,196 positions and 64 text: chunks of 1,024, 1,024 and 408 rows, in the
    # row buckets 1,024, 1,024 and 512 at 14 ms for 640 rows and 26/1,408 ms a row more, plus 2 a step.
    def step(bucket: int) -> float:
        return 14 + (bucket - 640) * 26 / 1408 + 2

    prompt = 2 * step(1024) + step(512)
    (row,) = run("--workload", "W4", "--rates", "0.05", "--duration", "200")
    e2e = round(15 + prompt + 15 * 4 + 2)
    assert row[1] == f"{e2e} / {e2e} ({e2e}-{e2e})"
    assert row[2].split(" / ")[0] == f"{round(15 + prompt)}"


def test_pictures_on_the_llms_gpu_take_their_time_there_and_hold_up_other_requests():
    # Alone: the tower's 10 ms come between the front and the prompt.
    (alone,) = run("--rates", "0.05", "--duration", "200", "--tower-ms", "10")
    assert alone[1] == "103 / 103 (103-103)"
    # Under load a tower also holds up the steps of the requests already in the llm: the same
    # 10 ms a request on the GPU's lane instead of in the front make the P99 far worse.
    front, lane = (
        run("--rates", "30", "--duration", "60", *flags)[0] for flags in (["--front-ms", "25"], ["--tower-ms", "10"])
    )
    front_p99, lane_p99 = (int(row[1].split(" / ")[1].split()[0]) for row in (front, lane))
    assert lane_p99 > 1.5 * front_p99, (front[1], lane[1])


def test_under_load_every_request_finishes_and_latency_grows_with_the_rate():
    low, high = run("--rates", "5,30", "--duration", "60")
    done, sent = map(int, re.match(r"(\d+) of (\d+)", high[4]).groups())
    assert done == sent > 1500  # none is lost in the schedule
    assert int(high[1].split(" / ")[0]) > int(low[1].split(" / ")[0])
