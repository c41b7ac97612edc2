"""The preprocessing pool serves higher classes first, ages lower ones, and cancels on shutdown."""

from __future__ import annotations

import threading
import time

from services.common.priority_pool import PriorityPool
from services.common.qos import QosLevel


def test_higher_class_first_then_arrival():
    pool = PriorityPool(1, "test")
    gate = threading.Event()
    order: list[str] = []
    blocker = pool.submit(QosLevel.STANDARD, gate.wait)  # holds the only thread while the queue fills
    futures = [
        pool.submit(level, order.append, name)
        for name, level in [
            ("be", QosLevel.BEST_EFFORT),
            ("st1", QosLevel.STANDARD),
            ("rt", QosLevel.REALTIME),
            ("st2", QosLevel.STANDARD),
        ]
    ]
    gate.set()
    blocker.result(5)
    for f in futures:
        f.result(5)
    assert order == ["rt", "st1", "st2", "be"]
    pool.shutdown()


def test_errors_reach_the_caller_and_shutdown_cancels_the_queue():
    pool = PriorityPool(1, "test")
    assert isinstance(pool.submit(QosLevel.STANDARD, lambda: 1 / 0).exception(5), ZeroDivisionError)
    gate = threading.Event()
    running = pool.submit(QosLevel.STANDARD, gate.wait)
    while not running.running():  # the thread has taken it
        time.sleep(0.001)
    queued = pool.submit(QosLevel.STANDARD, lambda: "never")
    pool.shutdown()
    gate.set()
    assert running.result(5) is True and queued.cancelled()
