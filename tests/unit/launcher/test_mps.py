"""`vlmesh up --cuda-mps`: the launcher's own MPS control daemon, against a stand-in binary."""

from __future__ import annotations

import stat

import pytest

from services.launcher import cli, supervisor
from services.launcher.mps import CONTROL, CudaMps
from services.launcher.options import MeshOptions
from services.launcher.ports import MeshError

FAKE = """#!/bin/sh
# records each call: its arguments, the pipe directory it was given, and what came on stdin
{ echo "args=$*"; echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; [ -z "$*" ] && echo "stdin=$(cat)"; } >> "$FAKE_MPS_LOG"
[ -n "$FAKE_MPS_FAIL" ] && { echo "$FAKE_MPS_FAIL" >&2; exit 1; }
exit 0
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    binary = bin_dir / CONTROL
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    return log


def test_the_mesh_starts_a_daemon_gives_its_children_the_pipe_and_quits_it(fake_control, monkeypatch):
    envs = {}

    class FakeProc:
        pid = 0  # no process: no shared memory of its own to remove at stop

        def __init__(self, cmd, env, start_new_session):
            envs[cmd[6].removeprefix("services.")] = env

        def poll(self):
            return 0

    opts = MeshOptions.from_flags(
        model="/m", gateway_port=0, vision_port=0, llm_port=0, cuda_mps=True, vision_mps_percent=40
    )
    mesh = supervisor.Mesh(opts)
    said = []
    try:
        mesh._mps.start(said.append)  # what Mesh.start does first
        with monkeypatch.context() as m:  # the children only: the daemon's control runs for real
            m.setattr(supervisor.subprocess, "Popen", FakeProc)
            mesh._spawn("vision", opts.vision)
            mesh._spawn("llm", mesh._llm_config())
        pipe = str(mesh._mps.pipe)
    finally:
        mesh.stop()
    assert envs["vision"]["CUDA_MPS_PIPE_DIRECTORY"] == envs["llm"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert envs["vision"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"  # --vision-mps-percent: the vision alone
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in envs["llm"]
    assert "MPS control daemon started" in said[0]
    calls = fake_control.read_text()
    assert calls.splitlines() == ["args=-d", f"pipe={pipe}", "args=", f"pipe={pipe}", "stdin=quit"]


def test_without_the_flag_no_daemon_and_no_mps_variables(fake_control, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    mesh = supervisor.Mesh(MeshOptions.from_flags(model="/m", gateway_port=0, vision_port=0, llm_port=0))
    mesh.stop()
    assert mesh._mps is None and not fake_control.exists()


def test_a_missing_binary_or_a_failed_start_is_a_clear_error(fake_control, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "An instance of this daemon is already running")
    mps = CudaMps(tmp_path / "mps")
    with pytest.raises(MeshError, match=r"-d failed .*already running"):
        mps.start(print)
    mps.stop()  # not started: no quit sent
    assert "stdin=" not in fake_control.read_text()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MeshError, match=f"{CONTROL} is not on PATH"):
        CudaMps(tmp_path / "mps2").start(print)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--device", "cpu"], "not with --device cpu"),
        (["--device", "cuda", "--variants", "full=70,int8=30"], "not with --variants"),
        (["--device", "cuda", "--vision-mps-percent", "101"], "--vision-mps-percent 101: give 1-100"),
        (["--device", "cuda", "--no-cuda-mps", "--vision-mps-percent", "40"], "with --cuda-mps"),
    ],
)
def test_up_refuses_cuda_mps_where_it_cannot_work(flags, why, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli._checked_options(["--model", "/m", "--cuda-mps", *flags])
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err
