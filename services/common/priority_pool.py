"""A thread pool whose queue is ordered by QoS class (aged) then arrival, not first come first served.

The vision service decodes and resizes images on a few threads. With a plain
ThreadPoolExecutor a realtime image waits behind every best-effort image queued before it;
here the next free thread takes the highest class, aged as in the batcher and the llm
scheduler so that best-effort work still moves.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from services.common.qos import QosLevel, effective_class


class PriorityPool:
    def __init__(self, workers: int, name: str) -> None:
        self._queue: list[tuple[QosLevel, int, float, Callable[[], Any], Future]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, level: QosLevel, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._queue.append((level, next(self._seq), time.perf_counter(), lambda: fn(*args), future))
            self._cond.notify()
        return future

    def _take(self):
        """Pop the next call: lowest aged class, then arrival (a short list: a scan beats a heap with aging)."""
        now = time.perf_counter()

        def rank(i: int) -> tuple[int, int]:
            level, seq, queued, _, _ = self._queue[i]
            return effective_class(level, now - queued), seq

        return self._queue.pop(min(range(len(self._queue)), key=rank))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                *_, call, future = self._take()
            if not future.set_running_or_notify_cancel():
                continue  # the caller cancelled while it waited
            try:
                future.set_result(call())
            except BaseException as err:
                future.set_exception(err)

    def shutdown(self) -> None:
        """Stop taking work; queued calls are cancelled."""
        with self._cond:
            self._closed = True
            for *_, future in self._queue:
                future.cancel()
            self._queue.clear()
            self._cond.notify_all()
