"""A server's own Python, profiled while it serves (`--profile-host PATH`): where a loaded service
spends its host CPU, function by function and thread by thread, written when it stops.

yappi, the standard profiler for threaded and asyncio Python, counts each function's CPU time in
every thread: the asyncio loop, the engine or batcher thread, the preprocessing pool. It starts
once the server is serving, so loading and compiling the model stay out, and on stop writes PATH
(pstats format: `python -m pstats PATH`, or snakeviz) and PATH.threads (CPU seconds by thread).
Profiling slows the Python it counts, by some 1.5-3x: read the shares, not the times.
`python -m bench.host_profile PATH...` sums the files up.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_path: str | None = None


def check(path: str | None) -> None:
    """ValueError naming the flag when --profile-host is asked for without yappi installed."""
    if not path:
        return
    try:
        import yappi  # noqa: F401
    except ImportError:
        raise ValueError("--profile-host needs yappi (pip install yappi, or the project's dev extra)") from None


def start(path: str | None) -> None:
    """Profile every thread's CPU from now on (a no-op without a path)."""
    global _path
    if not path or _path is not None:
        return
    import yappi

    yappi.set_clock_type("cpu")
    yappi.set_context_name_callback(lambda: threading.current_thread().name)  # "llm-engine", not "Thread"
    yappi.start(builtins=False, profile_threads=True)
    _path = path
    log.info("profiling this server's Python until it stops: %s", path)


def stop() -> None:
    """Stop and write the profile, if one runs (on the way out: a failure is logged, not raised)."""
    global _path
    if _path is None:
        return
    import yappi

    path, _path = _path, None
    yappi.stop()
    try:
        yappi.get_func_stats().save(path, type="pstat")
        with open(f"{path}.threads", "w", encoding="utf-8") as f:
            for t in sorted(yappi.get_thread_stats(), key=lambda t: -t.ttot):
                f.write(f"{t.ttot:.3f}\t{t.sched_count}\t{t.name}\n")
        log.info("host profile written: %s", path)
    except OSError:
        log.exception("the host profile could not be written to %s", path)
    finally:
        yappi.clear_stats()
