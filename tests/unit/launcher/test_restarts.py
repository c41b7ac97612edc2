"""The launcher's watch over a mesh's children (services/launcher/restarts.py), on a fake clock
and fake children, and what `vlmesh up --help` says it does."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from grpc_health.v1 import health_pb2

from services.launcher import restarts
from services.launcher.cli import build_parser
from services.launcher.ports import MeshError
from services.launcher.restarts import HEALTH_TIMEOUT_S, STALL_CHECKS, TICK_S, Watch
from services.launcher.supervisor import Child


@dataclass
class HungProcess:
    """A child that runs and answers nothing until killed."""

    killed: bool = False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def kill(self) -> None:
        self.killed = True

    def wait(self) -> int:
        return -9


@dataclass
class FakeMesh:
    children: list[Child] = field(default_factory=lambda: [Child("llm", HungProcess())])

    def target(self, name: str) -> str:
        return "127.0.0.1:1"

    def credentials(self) -> None:
        return None


class Clock:
    """The watch's clock, moved by the fake health checks and the test's ticks."""

    def __init__(self) -> None:
        self.now = 100.0
        self.answers: list[int] = []  # the next health checks' answers, then UNKNOWN (no answer)

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """Every health check goes unanswered for its whole HEALTH_TIMEOUT_S, as on a stopped child."""
    fake = Clock()

    def health_status(target, timeout, creds):
        fake.now += timeout
        return fake.answers.pop(0) if fake.answers else health_pb2.HealthCheckResponse.UNKNOWN

    monkeypatch.setattr(restarts, "health_status", health_status)
    return fake


def watch_until_stalled(watch: Watch, clock: Clock) -> str:
    """Poll as `Mesh.wait` does (a poll, then TICK_S) until the watch gives up; its message."""
    for _ in range(4 * STALL_CHECKS):
        try:
            watch.poll()
        except MeshError as err:
            return str(err)
        clock.now += TICK_S
    raise AssertionError("the stalled child was never killed")


def test_a_stall_reports_how_long_the_child_went_unanswered(clock):
    mesh = FakeMesh()
    message = watch_until_stalled(Watch(mesh, restarts=0, window_s=300, clock=clock), clock)
    unanswered = STALL_CHECKS * HEALTH_TIMEOUT_S + (STALL_CHECKS - 1) * TICK_S  # each check's wait, and the ticks
    want = f"the llm process stalled (no health answer for {unanswered:.1f} s, {STALL_CHECKS} checks in a row)"
    assert want in message, message
    assert mesh.children[0].proc.killed


def test_an_answer_starts_the_count_again(clock):
    """Two unanswered checks, one SERVING, then silence: the time counts from the silence."""
    s = health_pb2.HealthCheckResponse
    clock.answers.extend([s.UNKNOWN, s.UNKNOWN, s.SERVING])
    message = watch_until_stalled(Watch(FakeMesh(), restarts=0, window_s=300, clock=clock), clock)
    unanswered = STALL_CHECKS * HEALTH_TIMEOUT_S + (STALL_CHECKS - 1) * TICK_S
    assert f"no health answer for {unanswered:.1f} s" in message, message


def test_up_help_says_a_dead_or_stalled_child_is_restarted():
    text = " ".join(build_parser().format_help().split())
    assert "a child that dies or stalls is restarted on the ports it had" in text
    assert "past that limit, or with --restarts 0, the launcher names the child, stops the others" in text
