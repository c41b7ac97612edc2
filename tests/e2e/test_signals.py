"""SIGTERM to `vlmesh up` at any stage stops every child and frees its ports; a launcher killed
outright (SIGKILL) leaves no child behind either."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from services.launcher import free_port

VLMESH = [sys.executable, "-m", "services.cli"]
# `vlmesh up` minus services/cli.py's check of the weights' headers, which would block on the
# stalled model's FIFO before up() starts anything.
UP_ONLY = [sys.executable, "-c", "import sys; from services.launcher import up; sys.exit(up(sys.argv[1:]))"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SERVICES = ("gateway", "vision", "llm")


class Launcher:
    """`vlmesh up` on fixed ports, its output (children's included) collected line by line."""

    def __init__(self, model: Path, tmp: Path, *extra: str, command: list[str] | None = None) -> None:
        self.ports = {name: free_port("127.0.0.1") for name in SERVICES}
        self.metrics = {name: free_port("127.0.0.1") for name in SERVICES}
        flags = [f"--{name}-port={port}" for name, port in self.ports.items()]
        flags += ["--metrics-ports", ",".join(str(self.metrics[name]) for name in SERVICES)]
        self.proc = subprocess.Popen(
            [
                *(command or [*VLMESH, "up"]),
                "--model",
                str(model),
                *flags,
                "--threads",
                "1",
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**ENV, "TMPDIR": str(tmp)},  # a launcher killed outright leaves its directory there
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.seen: list[psutil.Process] = []

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        until(lambda: text in self.output(), timeout, f"{text!r} in the output:\n{self.output()}")

    def children(self, n: int) -> list[psutil.Process]:
        """The launcher's first `n` children, once it has started them."""
        parent = psutil.Process(self.proc.pid)
        until(lambda: len(parent.children()) >= n, 60, f"{n} children:\n{self.output()}")
        self.seen = parent.children()
        return self.seen

    def all_ports(self) -> list[int]:
        return [*self.ports.values(), *self.metrics.values()]

    def cleanup(self) -> None:
        """Kill whatever a failed test left running."""
        for p in self.seen:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.kill()
        self.proc.wait(timeout=30)


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def can_serve_on(port: int) -> bool:
    """Whether a new server could bind and listen on `port` (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def port_file(child: psutil.Process) -> Path:
    argv = child.cmdline()
    return Path(argv[argv.index("--port-file") + 1])


def assert_all_gone(launcher: Launcher, kids: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, f"children left running: {[c.pid for c in alive]}\n{launcher.output()}"
    busy = [port for port in launcher.all_ports() if not can_serve_on(port)]
    assert not busy, f"ports still held: {busy}"


@pytest.fixture
def launch(tmp_path):
    """Start `vlmesh up` (Launcher's arguments); whatever is left is killed at the end."""
    started: list[Launcher] = []
    (tmp_path / "tmp").mkdir()

    def start(model: Path, *extra: str, command: list[str] | None = None) -> Launcher:
        started.append(Launcher(model, tmp_path / "tmp", *extra, command=command))
        return started[-1]

    yield start
    for launcher in started:
        launcher.cleanup()


@pytest.fixture
def stalled_model(tiny_model, tmp_path) -> Path:
    """The tiny checkpoint with weights that never arrive: each *.safetensors is a FIFO nobody
    writes, so a child that loads weights blocks there until a signal ends it."""
    model = tmp_path / "stalled"
    shutil.copytree(tiny_model, model)
    weights = list(model.glob("*.safetensors"))
    assert weights
    for path in weights:
        path.unlink()
        os.mkfifo(path)
    return model


def loading(launch, stalled_model: Path) -> tuple[Launcher, list[psutil.Process]]:
    """A launcher whose vision and llm are loading weights (for ever): both bound their metrics
    port, which they do before loading, and neither wrote its port file."""
    launcher = launch(stalled_model, command=UP_ONLY)
    launcher.wait_for("starting vision")
    kids = launcher.children(2)
    until(lambda: listening(launcher.metrics["vision"]) and listening(launcher.metrics["llm"]), 120, "metrics ports")
    assert not any(port_file(k).exists() for k in kids)
    return launcher, kids


def test_sigterm_while_loading_weights_stops_the_children(launch, stalled_model):
    launcher, kids = loading(launch, stalled_model)
    run_dir = port_file(kids[0]).parent
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=60) == 0, launcher.output()
    assert "vlmesh up: SIGTERM before the mesh was ready; stopping" in launcher.output()
    assert_all_gone(launcher, kids)
    assert not run_dir.exists()  # the launcher's temporary directory went with it


def test_a_killed_launcher_leaves_no_child(launch, stalled_model):
    launcher, kids = loading(launch, stalled_model)
    launcher.proc.kill()
    launcher.proc.wait(timeout=30)
    assert_all_gone(launcher, kids)


def test_sigterm_during_warm_up_stops_the_children(launch, tiny_model):
    launcher = launch(tiny_model, "--warmup-requests", "200")
    launcher.wait_for("warming up")
    kids = launcher.children(3)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=90) == 0, launcher.output()
    out = launcher.output()
    assert "warm-up done" not in out and "gateway ready" not in out
    assert "vlmesh up: SIGTERM before the mesh was ready; stopping" in out
    assert_all_gone(launcher, kids)
