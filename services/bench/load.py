"""Open-loop load: Poisson arrivals at a fixed rate, every request accounted for.

Arrival times are drawn before the run and each request is sent at its time whether or
not earlier ones finished (closed loops hide queueing). Requests are built before the
clock starts so that making JPEGs never delays a send. Every send is a task whose outcome
is recorded in all cases, so sent == sum of final statuses by construction.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import numpy as np

from services.bench.targets import Outcome
from services.bench.workloads import BenchRequest, RequestFactory


@dataclass
class Record:
    request: BenchRequest
    scheduled_s: float  # offset from the run's start
    sent_s: float  # when the client actually sent it
    outcome: Outcome


def poisson_offsets(rate: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets in [0, duration_s) of a Poisson process with `rate` per second."""
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration_s:
            return out
        out.append(t)


async def run_open_loop(
    target, factory: RequestFactory, rate: float, duration_s: float, seed: int, label: str = "", progress: bool = True
) -> tuple[list[Record], dict]:
    """Offer `rate` req/s for `duration_s`; return the records and the client's own costs."""
    offsets = poisson_offsets(rate, duration_s, np.random.default_rng([seed, 3, int(rate * 1000)]))
    requests = [factory.make(i) for i in range(len(offsets))]
    loop = asyncio.get_running_loop()
    records: list[Record | None] = [None] * len(offsets)
    done = 0

    async def one(i: int, scheduled: float, sent: float) -> None:
        nonlocal done
        try:
            outcome = await target.send(requests[i])
        except Exception as err:  # a target must not raise; if one does, it is still counted
            outcome = Outcome(f"CLIENT_{type(err).__name__}")
        records[i] = Record(requests[i], scheduled, sent, outcome)
        done += 1

    cpu0, wall0 = time.process_time(), time.perf_counter()
    start = loop.time()
    tasks = []
    last_print = 0.0
    for i, offset in enumerate(offsets):
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, offset, loop.time() - start)))
        now = loop.time() - start
        if progress and now - last_print >= 1.0:
            last_print = now
            print(
                f"\r  {label} {rate:g} req/s: {now:5.1f}/{duration_s:g}s sent {i + 1}/{len(offsets)} done {done}",
                end="",
                file=sys.stderr,
                flush=True,
            )
    while done < len(tasks):  # drain: every request ends with a result or a status
        if progress:
            print(
                f"\r  {label} {rate:g} req/s: draining, done {done}/{len(tasks)}        ",
                end="",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.wait(tasks, timeout=1.0)
    if progress:
        print(file=sys.stderr)
    return [r for r in records if r is not None], client_usage(cpu0, wall0)


def client_usage(cpu0: float, wall0: float) -> dict:
    """The load generator's own CPU since (process_time, perf_counter) = (cpu0, wall0)."""
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_s": cpu, "wall_s": wall, "cpu_share": cpu / wall}


async def run_closed_loop(
    target, factory: RequestFactory, concurrency: int, duration_s: float, label: str = "", progress: bool = True
) -> tuple[list[Record], dict]:
    """`concurrency` clients, each sending its next request when the last one ends, for `duration_s`."""
    loop = asyncio.get_running_loop()
    records: list[Record] = []
    counter = iter(range(10**9))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    start = loop.time()

    async def client() -> None:
        while loop.time() - start < duration_s:
            i = next(counter)
            req = factory.make(i)
            sent = loop.time() - start
            try:
                outcome = await target.send(req)
            except Exception as err:  # a target must not raise; if one does, it is still counted
                outcome = Outcome(f"CLIENT_{type(err).__name__}")
            records.append(Record(req, sent, sent, outcome))

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            print(
                f"\r  {label} closed loop x{concurrency}: {loop.time() - start:5.1f}/{duration_s:g}s "
                f"done {len(records)}",
                end="",
                file=sys.stderr,
                flush=True,
            )

    ticker = asyncio.create_task(report()) if progress else None
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        if ticker is not None:
            ticker.cancel()
            print(file=sys.stderr)
    return records, client_usage(cpu0, wall0)
