"""Shared fixtures and test engines for the core-loop tests, and the no-leftovers check of
the tests that start processes (``tests/stage`` has a conftest of its own)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from enginecore import CountdownEngine, EngineCoreLoop, Event

Call = tuple[Any, ...]


class RecordingEngine(CountdownEngine):
    """A CountdownEngine that records every call (and the thread that made it).

    ``on_step`` / ``on_idle`` hooks run at the top of ``step()`` / when ``has_work()`` answers
    False, which lets a test act at an exact point of the loop without sleeping.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.threads: set[int] = set()
        self.has_work_calls = 0
        self.steps = 0
        self.on_step: Callable[[int], None] | None = None
        self.on_idle: Callable[[], None] | None = None
        self.stepped = threading.Event()

    def has_work(self) -> bool:
        self.threads.add(threading.get_ident())
        self.has_work_calls += 1
        answer = super().has_work()
        if not answer and self.on_idle is not None:
            self.on_idle()
        return answer

    def add(self, req_id: str, data: Any) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("add", req_id, data))
        super().add(req_id, data)

    def abort(self, req_ids: Sequence[str]) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("abort", tuple(req_ids)))
        super().abort(req_ids)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        self.threads.add(threading.get_ident())
        self.calls.append(("utility", name, args))
        return super().utility(name, args)

    def step(self) -> list[tuple[str, int]]:
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps)
        self.calls.append(("step",))
        outputs = super().step()
        self.stepped.set()
        return outputs


class EventLog:
    """An ``emit`` that records events and lets a test wait for one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[Event]], bool], timeout: float = 5.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.events), timeout):
                raise AssertionError(f"timed out waiting; events so far: {self.events!r}")

    def outputs(self) -> list[Any]:
        return [e[1] for e in self.events if e[0] == "output"]


class LoopThread:
    """Runs ``loop.run()`` on a background thread and joins it on teardown."""

    def __init__(self, loop: EngineCoreLoop) -> None:
        self.loop = loop
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._target, name="test-loop", daemon=True)

    def _target(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:
            self.error = exc

    def start(self) -> LoopThread:
        self.thread.start()
        return self

    def join(self, timeout: float = 5.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run() did not return"
        if self.error is not None:
            raise self.error


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine()


@pytest.fixture
def log() -> EventLog:
    return EventLog()


@pytest.fixture
def loop(engine: RecordingEngine, log: EventLog) -> EngineCoreLoop:
    return EngineCoreLoop(engine, log)


@pytest.fixture
def running(loop: EngineCoreLoop) -> Iterator[LoopThread]:
    """A loop running on a background thread; shut down and joined after the test."""
    lt = LoopThread(loop).start()
    yield lt
    loop.request_shutdown()
    lt.join()


def child_pids() -> set[int]:
    """Children of this process (running or zombie), except multiprocessing's resource
    tracker, which spawn starts once per interpreter on purpose."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"resource_tracker" not in cmdline:
            found.add(int(entry))
    return found


@pytest.fixture
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private temp dir for the ipc sockets; afterwards, no new child and no file left."""
    before = child_pids()
    private = tempfile.mkdtemp(prefix="ecB", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", private)
    try:
        yield private
        assert not child_pids() - before, "child processes left behind"
        assert not os.listdir(private), f"left behind: {os.listdir(private)}"
    finally:
        shutil.rmtree(private, ignore_errors=True)
