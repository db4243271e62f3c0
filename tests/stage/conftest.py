"""Fixtures for the stage-process tests: real processes, real sockets, nothing left behind.

Every test runs with ``tempfile.tempdir`` pointed at a private, short directory (ipc socket
paths must fit in 107 bytes), and afterwards asserts that no child process of the test
process is left (running or unreaped) and that no ipc directory or socket file is left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

import pytest

from enginecore.stage import (
    AsyncRequestStream,
    AsyncStageClient,
    StageClient,
    StageEvent,
    StageHealth,
    StageLoad,
    StageStatistics,
    StreamTimings,
    _shm,
)

SCRIPTED = "enginecore.stage.testing:scripted"
COUNTDOWN = "enginecore.stage.testing:countdown"
ECHO = "enginecore.stage.testing:echo"


def child_pids() -> dict[int, str]:
    """Children of this process (running or zombie), pid -> command line, except the
    multiprocessing resource tracker, which spawn starts once per interpreter on purpose."""
    me = os.getpid()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and "resource_tracker" not in cmdline:
            found[int(entry)] = cmdline
    return found


def pid_gone(pid: int) -> bool:
    """Whether *pid* no longer runs (absent, or a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(predicate: object, timeout: float) -> bool:
    """Poll *predicate* (a callable) until true or *timeout*; for process-table checks,
    where no event exists to wait on."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def settled_engine(
    read: Callable[[], Mapping[str, float]],
    settled: Callable[[Mapping[str, float]], bool],
    timeout: float = 10.0,
) -> Mapping[str, float]:
    """A stage's engine numbers (*read*: its ``stats().engine``) once *settled* holds for
    them, or the last ones read after *timeout* seconds.

    A stage's engine numbers are a sample its loop takes when it goes idle
    (``docs/observability.md``): a result that the stage already sent on can reach the test
    before the sample that counts it, on a loaded machine. *settled* says that the sample
    is one taken after the event under test (a counter the event moves); the test then
    asserts the exact numbers on it, so that a wrong count still fails."""
    deadline = time.monotonic() + timeout
    while True:
        numbers = read()
        if settled(numbers) or time.monotonic() > deadline:
            return numbers
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Private temp dir for ipc sockets; after the test, no child, no socket file and no
    shared-memory segment of this process's pipelines left."""
    before = set(child_pids())
    private = tempfile.mkdtemp(prefix="ecT", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", private)
    try:
        yield private
        leftover_children = {pid: cmd for pid, cmd in child_pids().items() if pid not in before}
        leftover_files = [
            os.path.join(root, name)
            for root, dirs, files in os.walk(private)
            for name in dirs + files
        ]
        leftover_segments = _shm.unlink_prefix(f"enginecore-{os.getpid()}-")
        assert not leftover_children, f"child processes left behind: {leftover_children}"
        assert not leftover_files, f"ipc files or dirs left behind: {leftover_files}"
        assert not leftover_segments, f"shared-memory segments left: {leftover_segments}"
    finally:
        shutil.rmtree(private, ignore_errors=True)


@pytest.fixture
def client(no_leftovers: str) -> Iterator[StageClient]:
    """A launched ScriptedEngine stage with the ordered event stream on."""
    with StageClient.launch(SCRIPTED, ordered_events=True, startup_timeout=30) as c:
        yield c


# -- one suite for both clients ---------------------------------------------------------------

T = TypeVar("T")


class EventLoopThread:
    """An asyncio event loop running in a thread of its own, for as long as the test runs,
    so an AsyncStageClient's receiver task and timers run all the time, as a StageClient's
    receiver thread does."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-event-loop")
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self.submit(coro).result()
        except StopAsyncIteration:
            raise StopIteration from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class BlockingAsyncStream:
    """An AsyncRequestStream behind RequestStream's blocking interface."""

    def __init__(self, runner: EventLoopThread, stream: AsyncRequestStream) -> None:
        self._runner = runner
        self._stream = stream
        self.req_id = stream.req_id

    @property
    def finished(self) -> bool:
        return self._stream.finished

    @property
    def aborted(self) -> bool:
        return self._stream.aborted

    @property
    def timings(self) -> StreamTimings:
        return self._stream.timings  # read from this thread, as any thread may

    def __iter__(self) -> BlockingAsyncStream:
        return self

    def __next__(self) -> Any:
        return self._runner.run(self._stream.__anext__())

    def get(self, timeout: float | None = None) -> Any:
        return self._runner.run(self._stream.get(timeout))

    def collect(self, timeout: float | None = None) -> list[Any]:
        return self._runner.run(self._stream.collect(timeout))


class BlockingAsyncClient:
    """An AsyncStageClient behind StageClient's blocking interface: every call runs as a
    coroutine on the client's event loop (in another thread) and the caller waits for it.
    A thin adapter: the behaviour under test is the async client's."""

    def __init__(self, runner: EventLoopThread, client: AsyncStageClient) -> None:
        self._runner = runner
        self._client = client

    pid = property(lambda self: self._client.pid)
    address = property(lambda self: self._client.address)
    exit_code = property(lambda self: self._client.exit_code)
    closed = property(lambda self: self._client.closed)

    def _streams(self, streams: list[AsyncRequestStream] | None) -> list[Any] | None:
        return None if streams is None else [BlockingAsyncStream(self._runner, s) for s in streams]

    def add(self, req_id: str, data: Any, stream: bool = True) -> Any:
        added = self._runner.run(self._client.add(req_id, data, stream))
        return None if added is None else BlockingAsyncStream(self._runner, added)

    def add_many(self, items: Iterable[tuple[str, Any]], *, streams: bool = True) -> Any:
        return self._streams(self._runner.run(self._client.add_many(items, streams=streams)))

    def abort(self, req_ids: Any) -> None:
        self._runner.run(self._client.abort(req_ids))

    def call_utility(self, name: str, /, *args: Any, timeout: float | None = None) -> Any:
        return self._runner.run(self._client.call_utility(name, *args, timeout=timeout))

    def call_utility_future(self, name: str, /, *args: Any) -> concurrent.futures.Future[Any]:
        return self._runner.submit(self._client.call_utility(name, *args))

    def get_event(self, timeout: float | None = None) -> StageEvent:
        return self._runner.run(self._client.get_event(timeout))

    def get_events(self, timeout: float | None = None) -> list[StageEvent]:
        return self._runner.run(self._client.get_events(timeout))

    def events(self) -> Iterator[StageEvent]:
        while True:
            try:
                event = self.get_event()
            except StopIteration:
                return
            yield event

    def health(self) -> StageHealth:
        return self._client.health()

    def stats(self, timeout: float | None = 10.0) -> StageStatistics:
        return self._runner.run(self._client.stats(timeout))

    def load(self) -> StageLoad | None:
        return self._client.load()

    def shutdown(self, timeout: float = 5.0, *, drain: float | None = None) -> int | None:
        return self._runner.run(self._client.shutdown(timeout, drain=drain))

    def close(self) -> None:
        self._runner.run(self._client.close())

    def __enter__(self) -> BlockingAsyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Launch = Callable[..., StageClient]


@contextlib.contextmanager
def _clients(kind: str, opener: str) -> Iterator[Callable[..., StageClient]]:
    """``open(*args, **kwargs)``: ``StageClient.<opener>`` (*kind* ``"sync"``) or
    ``AsyncStageClient.<opener>`` behind :class:`BlockingAsyncClient` (``"async"``), on an
    event loop thread of its own. Every client opened is closed afterwards."""
    runner = EventLoopThread() if kind == "async" else None
    opened: list[StageClient] = []

    def open_(*args: Any, **kwargs: Any) -> StageClient:
        if runner is None:
            client: StageClient = getattr(StageClient, opener)(*args, **kwargs)
        else:
            aclient = runner.run(getattr(AsyncStageClient, opener)(*args, **kwargs))
            client = cast(StageClient, BlockingAsyncClient(runner, aclient))
        opened.append(client)
        return client

    try:
        yield open_
    finally:
        try:
            for client in opened:
                client.close()
        finally:
            if runner is not None:
                runner.stop()


@pytest.fixture(params=["sync", "async"])
def launch(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Launch]:
    """``launch(factory=SCRIPTED, **kwargs)``: a launched stage with the client under test,
    the blocking :class:`StageClient` or the :class:`AsyncStageClient` behind a thin blocking
    adapter (typed as a StageClient: it has the same interface). Closed after the test."""
    with _clients(request.param, "launch") as open_:

        def launch_(factory: str = SCRIPTED, **kwargs: Any) -> StageClient:
            kwargs.setdefault("startup_timeout", 30)
            return open_(factory, **kwargs)

        yield launch_


Connect = Callable[..., StageClient]


@pytest.fixture(params=["sync", "async"])
def connect(request: pytest.FixtureRequest, no_leftovers: str) -> Iterator[Connect]:
    """``connect(address, **kwargs)``: :meth:`StageClient.connect` or
    :meth:`AsyncStageClient.connect` behind the blocking adapter, as :func:`launch` does for
    launched stages. Closed after the test."""
    with _clients(request.param, "connect") as open_:
        yield open_


@pytest.fixture
def stage_client(launch: Launch) -> StageClient:
    """A launched ScriptedEngine stage with the ordered event stream on, through each client
    in turn (``[sync]``, ``[async]``)."""
    return launch(SCRIPTED, ordered_events=True)


class Server:
    """A headless ``python -m enginecore serve`` subprocess."""

    def __init__(self, *args: str, stderr: Any = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "enginecore", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready line; EOF if it failed to start
        self.ready_line = line
        match = re.search(r"listening on (\S+)", line)
        if match is None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            raise AssertionError(f"serve did not start: {line!r}")
        self.address = match.group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()
        return code


@pytest.fixture
def server(no_leftovers: str) -> Iterator[Server]:
    """A headless stage serving ScriptedEngine on a free loopback TCP port."""
    srv = Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--session-timeout", "1")
    try:
        yield srv
    finally:
        srv.stop()
