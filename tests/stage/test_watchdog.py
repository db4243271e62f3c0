"""Liveness: the step watchdog (``_watchdog.py``), ``stalled``/``resumed`` on the wire,
``kill_after``, and ``client.health()`` through both clients (docs/stage.md, "Operating a
stage")."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from enginecore.stage import EngineDeadError, StageHealth
from enginecore.stage._watchdog import STEP_TIMEOUT, StepWatchdog, check_watchdog
from enginecore.stage.testing import ScriptedEngine

from .conftest import SCRIPTED, Launch, wait_until
from .raw import InProcessStage, RawClient


class Recorder:
    """The watchdog's *post* and *kill*: what it sent, with an event per kind."""

    def __init__(self) -> None:
        self.posted: list[tuple[Any, ...]] = []
        self.killed: list[str] = []
        self.seen: dict[str, threading.Event] = {
            k: threading.Event() for k in ("stalled", "resumed", "kill")
        }

    def post(self, event: tuple[Any, ...]) -> None:
        self.posted.append(event)
        self.seen[event[0]].set()

    def kill(self, message: str) -> None:
        self.killed.append(message)
        self.seen["kill"].set()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def watchdog(recorder: Recorder, step_timeout: float, kill_after: float | None = None) -> Any:
    wd = StepWatchdog(step_timeout, kill_after, post=recorder.post, kill=recorder.kill)
    wd.start()
    return wd


class TestStepWatchdog:
    @pytest.mark.parametrize("kill_after", [None, 1e300])
    def test_seconds_past_what_a_thread_can_wait_mean_never(
        self, recorder: Recorder, kill_after: float | None
    ) -> None:
        # launch(step_timeout=1e300) through the library (serve caps it on its command
        # line): the watchdog's wait raised OverflowError and ended its thread.
        wd = watchdog(recorder, 1e300, kill_after)
        try:
            wd.begin()
            wd._thread.join(0.3)  # it takes the step, then waits on it
            assert wd._thread.is_alive()
        finally:
            wd.close()
        wd._thread.join(5)
        assert not wd._thread.is_alive()
        assert recorder.posted == []

    def test_a_long_step_is_reported_once_with_the_stacks_then_resumed(
        self, recorder: Recorder, capfd: pytest.CaptureFixture[str]
    ) -> None:
        wd = watchdog(recorder, 0.05)
        try:
            wd.begin()
            assert recorder.seen["stalled"].wait(5)
            time.sleep(0.2)  # the step goes on past several more periods: still one report
            wd.end()
            assert recorder.seen["resumed"].wait(5)
        finally:
            wd.close()
        [(kind, ran, timeout), (kind2, took)] = recorder.posted
        assert (kind, kind2, timeout) == ("stalled", "resumed", 0.05)
        assert 0.05 <= ran < took
        err = capfd.readouterr().err
        assert "Current thread" in err  # faulthandler's dump of every thread
        assert err.count("Current thread") == 1
        assert wd.stalled is False

    def test_quick_steps_are_never_reported(self, recorder: Recorder) -> None:
        wd = watchdog(recorder, 0.05)
        try:
            for _ in range(10_000):
                wd.begin()
                wd.end()
        finally:
            wd.close()
        assert recorder.posted == []

    def test_no_wake_up_while_idle(self, recorder: Recorder) -> None:
        wd = watchdog(recorder, 0.01)
        try:
            for _ in range(3):  # steps, then idle
                wd.begin()
                wd.end()
            # The thread disarms once it finds no step running, and then blocks.
            assert wait_until(lambda: not wd.armed, 5)
            woke = wd.wakeups
            time.sleep(0.3)  # 30 periods of step_timeout: a negative check has to wait
            assert wd.wakeups == woke
            # The next step arms it again, and a stall is still caught.
            wd.begin()
            assert recorder.seen["stalled"].wait(5)
            wd.end()
        finally:
            wd.close()

    def test_kill_after_is_called_once_with_a_message(self, recorder: Recorder) -> None:
        wd = watchdog(recorder, 0.05, kill_after=0.15)
        try:
            wd.begin()
            assert recorder.seen["kill"].wait(5)
            time.sleep(0.1)
        finally:
            wd.end()
            wd.close()
        [message] = recorder.killed
        assert "kill_after=0.15 s" in message
        assert recorder.posted[0][0] == "stalled"

    @pytest.mark.parametrize(
        ("step_timeout", "kill_after", "error"),
        [
            (0, None, ValueError),
            (-1.0, None, ValueError),
            (float("nan"), None, ValueError),
            (None, 5.0, ValueError),
            (2.0, 1.0, ValueError),
            ("1", None, TypeError),
            (True, None, TypeError),
        ],
    )
    def test_bad_settings_are_refused(
        self, step_timeout: Any, kill_after: Any, error: type[Exception]
    ) -> None:
        with pytest.raises(error):
            check_watchdog(step_timeout, kill_after)


class TestOnTheWire:
    def test_stalled_then_resumed_events(
        self, no_leftovers: str, capfd: pytest.CaptureFixture[str]
    ) -> None:
        stage = InProcessStage(ScriptedEngine(), no_leftovers, step_timeout=0.1)
        try:
            with RawClient(stage.address) as client:
                assert client.hello()[0] == "welcome"
                client.call(1, "stall_next_step", 0.5)
                events = client.until(lambda ev: ev[0] == "resumed")
                answer = client.call(2, "echo", "after")
        finally:
            stage.stop()
        [stalled] = [ev for ev in events if ev[0] == "stalled"]
        assert stalled[2] == 0.1
        assert 0.1 <= stalled[1] < events[-1][1]
        assert events[-1][1] >= 0.5
        assert answer[-1] == ["utility", 2, ["after"], None]
        assert "Current thread" in capfd.readouterr().err  # every thread's stack


class TestHealth:
    def test_ok_stalled_ok(self, launch: Launch, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.WARNING, logger="enginecore")
        client = launch(SCRIPTED, step_timeout=0.1)
        assert client.health() == StageHealth.OK
        assert client.health() == "ok"  # a str
        client.call_utility("stall_next_step", 1.0, timeout=5)
        assert wait_until(lambda: client.health() == StageHealth.STALLED, 5)
        assert wait_until(lambda: client.health() == StageHealth.OK, 5)
        assert client.call_utility("echo", 1, timeout=5) == [1]
        messages = [r.getMessage() for r in caplog.records]
        assert any("a step has run for" in m and "step_timeout 0.1 s" in m for m in messages)
        assert any("the stalled step returned after" in m for m in messages)

    def test_dead_after_close(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        client.close()
        assert client.health() == StageHealth.DEAD

    def test_kill_after_makes_a_stall_fatal(self, launch: Launch) -> None:
        client = launch(SCRIPTED, step_timeout=0.1, kill_after=0.3)
        stream = client.add("r", 10**9)
        stream.get(5)
        client.call_utility("stall_next_step", 60, timeout=5)
        with pytest.raises(EngineDeadError, match=r"kill_after=0\.3 s") as info:
            stream.collect(timeout=10)
        assert info.value.exit_code == 1
        assert "StepTimeout" in (info.value.fatal or "")
        assert client.health() == StageHealth.DEAD

    def test_a_stopped_stage_reads_as_stalled(
        self, launch: Launch, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="enginecore")
        client = launch(SCRIPTED)
        assert client.call_utility("echo", 1, timeout=5) == [1]
        os.kill(client.pid, signal.SIGSTOP)
        try:
            # Two ping intervals of silence (2 s), and it says so: no silent wait.
            assert wait_until(lambda: client.health() == StageHealth.STALLED, 10)
            assert wait_until(
                lambda: any("has not answered for" in r.getMessage() for r in caplog.records), 5
            )
        finally:
            os.kill(client.pid, signal.SIGCONT)
        assert wait_until(lambda: client.health() == StageHealth.OK, 10)
        assert client.call_utility("echo", 2, timeout=5) == [2]

    @pytest.mark.parametrize(("step_timeout", "kill_after"), [(0.0, None), (1.0, 0.5)])
    def test_bad_watchdog_settings_raise_before_anything(
        self, launch: Launch, step_timeout: float, kill_after: float | None
    ) -> None:
        with pytest.raises(ValueError, match=r"step_timeout|kill_after"):
            launch(SCRIPTED, step_timeout=step_timeout, kill_after=kill_after)


class TestServe:
    def test_default_step_timeout_matches_the_library(self) -> None:
        from enginecore import __main__

        assert __main__._STEP_TIMEOUT == STEP_TIMEOUT

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--step-timeout", "-1"], "--step-timeout must be"),
            (["--step-timeout", "1", "--kill-after", "0.5"], "--kill-after must be"),
            (["--step-timeout", "0", "--kill-after", "5"], "--kill-after needs a --step-timeout"),
        ],
    )
    def test_bad_flags_are_usage_errors(self, args: list[str], message: str) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "enginecore", "serve", "--engine", SCRIPTED,
             "--bind", "tcp://127.0.0.1:*", *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 2
        assert message in proc.stderr
