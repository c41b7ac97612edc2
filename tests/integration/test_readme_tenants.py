"""The tenants example of docs/CONFIGURATION.md, run as a new user runs it: the JSON file and the
commands of its code blocks, as written.

The test writes the example's JSON to the file its `vlmesh up` line names, in a fresh directory
where `models/` is the repository's and `.cache/demo-sample-7.png` is the picture `make demo`
renders; starts `vlmesh up` as written; then runs each `vlmesh generate` line: the one with
`--api-key` must be answered, the one without must fail with UNAUTHENTICATED.

Ports: the example's commands use the default ports (gateway 50051, vision 50052, llm 50053,
metrics 9464-9466). When one of them is taken on this machine (a CI runner, another mesh), the
test adds port flags to `vlmesh up` (`--gateway-port 0 --vision-port 0 --llm-port 0
--metrics-ports 0,0,0`) and `--target` with the gateway's address to `vlmesh generate`, and
changes nothing else.

`vlmesh up` warms the mesh up with its own per-run key (VLMESH_WARMUP_KEY): without it, its
warm-up requests are refused and the mesh never reports ready.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common.config import MESH_METRICS_PORTS, MESH_PORTS
from services.demo import sample_picture
from tests.helpers import ROOT

ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}
ENV.pop("VLMESH_API_KEY", None)  # the example's keyless call must be keyless
START_TIMEOUT_S = 240


def tenants_section() -> tuple[str, list[list[str]]]:
    """(the JSON file's text, the commands) of the **Tenants.** paragraph of docs/CONFIGURATION.md and its
    code blocks, up to the next heading."""
    text = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    start = text.index("**Tenants.**")
    end = text.find("\n#", start)
    blocks = re.findall(r"```(\w*)\n(.*?)```", text[start : end if end >= 0 else None], re.DOTALL)
    (config,) = [body for lang, body in blocks if lang == "json"]
    commands = []
    for lang, body in blocks:
        if lang in ("sh", "bash", "shell"):
            for line in body.replace("\\\n", " ").splitlines():
                if words := shlex.split(line, comments=True):
                    commands.append(words)
    return config, commands


def option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def port_free(port: int) -> bool:
    """Whether a server could listen there (SO_REUSEADDR, as gRPC binds: TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def vlmesh(words: list[str]) -> list[str]:
    assert words[0] == "vlmesh", words
    return [sys.executable, "-m", "services.cli", *words[1:]]


def test_the_readme_tenants_example_runs_as_written(tmp_path):
    config, commands = tenants_section()
    ups = [w for w in commands if w[:2] == ["vlmesh", "up"]]
    calls = [w for w in commands if w[:2] == ["vlmesh", "generate"]]
    assert len(ups) == 1 and len(calls) == 2, commands
    (up,) = ups
    with_key = [w for w in calls if "--api-key" in w]
    without = [w for w in calls if "--api-key" not in w]
    assert len(with_key) == len(without) == 1, calls
    help_text = subprocess.run(vlmesh(["vlmesh", "generate", "--help"]), capture_output=True, text=True, env=ENV)
    if "--api-key" not in help_text.stdout:
        pytest.skip("vlmesh generate has no --api-key yet")

    # The files the commands name, where they name them.
    json.loads(config)  # the example's JSON is JSON
    (tmp_path / option(up, "--tenants")).write_text(config)
    (tmp_path / "models").symlink_to(ROOT / "models")
    image = Path(option(with_key[0], "--image"))
    assert option(without[0], "--image") == str(image)
    seed = re.fullmatch(r"demo-sample-(\d+)\.png", image.name)
    assert seed, f"{image}: not the picture `make demo` renders"
    sample_picture(tmp_path / image, int(seed.group(1)))

    defaults = [*MESH_PORTS.values(), *MESH_METRICS_PORTS.values()]
    moved = not all(port_free(p) for p in defaults)
    ports = ["--gateway-port", "0", "--vision-port", "0", "--llm-port", "0", "--metrics-ports", "0,0,0"]
    as_written = up
    for _ in range(2):  # a port free when checked may be taken by now (another test run beside this one)
        up = [*as_written, *ports] if moved else as_written
        proc, lines, log = start(up, tmp_path)
        if moved or "the port is in use" not in (tmp_path / "up.log").read_text():
            break
        proc.wait(timeout=30)
        log.close()
        moved = True
    try:
        target = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while target is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line.startswith("gateway ready on "):
                target = line.split()[-1]
        tail = (tmp_path / "up.log").read_text()[-3000:]
        assert target is not None, f"`{shlex.join(up)}` never said `gateway ready`; its stderr ends:\n{tail}"
        if not moved:
            assert target == f"127.0.0.1:{MESH_PORTS['gateway']}"

        def run(words: list[str]) -> subprocess.CompletedProcess:
            words = [*words, "--target", target] if moved else words
            return subprocess.run(vlmesh(words), cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=120)

        answered = run(with_key[0])
        assert answered.returncode == 0, answered.stderr
        assert answered.stdout.strip() and "tokens" in answered.stderr
        refused = run(without[0])
        assert refused.returncode != 0
        assert "UNAUTHENTICATED" in refused.stderr, refused.stderr
    finally:
        stop(proc)
        log.close()  # type: ignore[attr-defined]


def start(up: list[str], cwd: Path) -> tuple[subprocess.Popen, queue.Queue, object]:
    """`vlmesh up` as the example writes it (plus ports); (it, its stdout lines, its log file). Returns
    once it has said something on stdout or exited: a taken port ends it at once, with exit 2."""
    log = (cwd / "up.log").open("w")
    proc = subprocess.Popen(
        vlmesh(up), cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True, env=ENV, start_new_session=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline and not (cwd / "up.log").read_text():
        time.sleep(0.1)  # its first line (starting vision and llm) comes after its port check
    return proc, lines, log


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops it; kill it and its children if that does not end it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            pass
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
    for pid in [int(p) for p in out.split()]:
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
