"""Launching a stage process: spawn, the startup handshake over a pipe, and cleanup.

:func:`launch_process` blocks its thread until the stage is ready (the blocking client);
:func:`launch_process_async` starts the process on the event loop's thread and awaits the
ready report with event-loop readers on the pipe and the process sentinel, so that no
thread is held while the factory builds the engine (the asyncio client and pool).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any, Final

import msgspec

from . import _aio, _codec, _logs, _wire
from ._curve import CurveKeys, ServerCurve
from ._errors import (
    EngineDeadError,
    StageClosedError,
    StageStartupError,
    describe_exit,
    positive_seconds,
)
from ._statistics import LOAD_INTERVAL, check_load_interval
from ._watchdog import STEP_TIMEOUT, check_watchdog
from ._wire import check_max_message_bytes

__all__ = [
    "Launched",
    "TcpListen",
    "kill_and_clean_async",
    "launch_process",
    "launch_process_async",
    "start_process",
]

# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_IPC_PATH: Final = 107
# How long a launched stage may take to admit new keys (Launched.authorize).
_AUTHORIZE_TIMEOUT: Final = 30.0
# The longest single wait for a process's exit: poll() takes at most INT_MAX ms (24.8 days).
_POLL_MAX_S: Final = 86400.0


@dataclass(frozen=True)
class TcpListen:
    """A launched stage that listens on TCP with CURVE instead of ipc: bound on *host* (a
    free port), with *server*'s key pair, admitting *server*'s authorized keys; *client* is
    the parent's own keys for it (its public key among those admitted, its ``server_key``
    the stage's public key). The parent makes all of them; the child gets *host*,
    *server* and the public half of *client* only, through the spawn (this host's pipe)."""

    host: str
    server: ServerCurve
    client: CurveKeys

    def __post_init__(self) -> None:
        if self.client.public_key not in self.server.authorized:
            raise ValueError("the parent's own key must be among the keys the stage admits")
        if self.client.server_key != self.server.public_key:
            raise ValueError("the parent's server_key must be the stage's public key")

    def bind(self) -> str:
        """The address the stage binds (both sockets): ``tcp://host:*``, any free port."""
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        return f"tcp://{host}:0"


@dataclass(eq=False)
class Launched:
    """A stage process that reported ready. The client takes ownership of all of it.

    The process may be waited for from two threads at once (a client's receiver thread and
    its closer). Waiting uses only the sentinel; reaping (``waitpid``) and signalling happen
    under :attr:`lock`, so a signal can never reach a pid that was reaped and reused.
    """

    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection  # parent end of the death pipe: keep open
    ipc_dir: str
    input_address: str
    stage: str  # the stage's name in its log records
    logs: _logs.LogSource | None = None  # its forwarded records, if forwarded
    lock: threading.Lock = field(default_factory=threading.Lock)
    # A stage that listens on TCP (TcpListen): the parent's CURVE keys for it, whose
    # server_key is the stage's public key; None: ipc, no CURVE.
    curve: CurveKeys | None = None
    control: threading.Lock = field(default_factory=threading.Lock)  # one authorize at a time
    _requests: int = 0  # authorize requests sent: each answer names its request's number
    _released: bool = False  # release() has run

    def authorize(self, keys: list[bytes], timeout: float = _AUTHORIZE_TIMEOUT) -> int:
        """A stage that listens on TCP with CURVE (:class:`TcpListen`): admit the parent's
        own key and *keys* (public keys, Z85) from now on, instead of those admitted so far
        (``StageRuntime.authorize``: new connections are checked against them, those
        made with a key removed lose their sessions). Returns once the stage says it has,
        with how many keys it admits. The request and the answer go over the death pipe,
        which only this process holds (a forked child closes its copy): no one else can
        change what the stage admits. :class:`~enginecore.stage.EngineDeadError` if the
        stage is gone, :class:`TimeoutError` past *timeout*, :class:`RuntimeError` with
        the stage's error if it refused, :class:`ValueError` for a stage without CURVE."""
        if self.curve is None:
            raise ValueError("this stage listens on ipc: it uses no CURVE")
        deadline = time.monotonic() + timeout
        with self.control:
            self._requests += 1
            number = self._requests
            message = ["authorize", number, [k.decode("ascii") for k in keys]]
            try:
                self.conn.send_bytes(msgspec.msgpack.encode(message))
                while True:  # an answer to an earlier request (past its timeout) is dropped
                    left = deadline - time.monotonic()
                    if left <= 0 or not self.conn.poll(left):
                        raise TimeoutError(
                            f"stage {self.stage!r} did not admit its new keys in {timeout:g} s"
                        )
                    reply = msgspec.msgpack.decode(self.conn.recv_bytes())
                    if reply[1] == number:
                        break
            except (EOFError, OSError) as exc:
                raise EngineDeadError(
                    f"stage {self.stage!r} is gone; it could not admit new keys"
                ) from exc
        if reply[0] != "authorized":
            raise RuntimeError(f"stage {self.stage!r} did not admit the keys: {reply[2]}")
        return int(reply[2])

    def wait_exit(self, timeout: float | None) -> bool:
        """Block until the process has exited (not reaped), at most *timeout* s (any
        number: ``shutdown(timeout=1e300)`` waits as ``None`` does)."""
        sentinel = [self.process.sentinel]
        if timeout is None or timeout <= _POLL_MAX_S:
            return bool(multiprocessing.connection.wait(sentinel, timeout))
        # poll() takes at most INT_MAX ms (24.8 days): a longer wait raised OverflowError.
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if multiprocessing.connection.wait(sentinel, min(max(left, 0.0), _POLL_MAX_S)):
                return True
            if left <= _POLL_MAX_S:
                return False

    def reap(self) -> int | None:
        """Reap the process if it has exited; return its exit code (``None``: still alive)."""
        with self.lock:
            # The sentinel (a pipe) reaches EOF a moment before the process turns into a
            # zombie, so once it has, wait for real; it takes microseconds.
            if self.wait_exit(0):
                self.process.join()
            return self.process.exitcode

    def send_signal(self, sig: signal.Signals) -> None:
        """Send *sig* unless the process has already exited and been reaped."""
        with self.lock:
            if self.process.exitcode is None:
                os.kill(self.process.pid, sig)  # type: ignore[arg-type]

    def release(self) -> None:
        """After the process has exited: close the pipe, remove the ipc dir, let the log
        thread finish with the stage's records. Idempotent, and safe from two threads at
        once (a reaper thread and the exit hook): the first does it, under :attr:`lock`,
        and a second returns once it is done (the exit hook must not find the files still
        there)."""
        with self.lock:
            if self._released:
                return
            self._released = True
            self.conn.close()
            if self.logs is not None:
                self.logs.release()
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            _live.discard(self)

    def kill_and_clean(self) -> None:
        """SIGKILL the process if alive, reap it, close the pipe, remove the ipc dir."""
        self.send_signal(signal.SIGKILL)
        self.wait_exit(None)
        self.reap()
        self.release()


# Stages whose client has not closed them yet. A program that exits without closing its
# client must not hang: multiprocessing's own exit hook joins non-daemon children forever
# (and a stage only ends when told to, or when its parent is gone). Stages are not daemonic,
# so an engine may start worker processes of its own; instead this hook, which runs before
# multiprocessing's (atexit is LIFO and multiprocessing.util is imported above), stops them.
_live: set[Launched] = set()
_exiting = False


def at_exit() -> bool:
    """Whether the interpreter's exit is stopping the stages that were never closed: a
    pool or pipeline that sees one of its stages end then reports no death and restarts
    nothing (the program is over)."""
    return _exiting


def _stop_live_stages_at_exit() -> None:
    global _exiting
    _exiting = True
    stages = list(_live)
    for stage in stages:
        stage.send_signal(signal.SIGTERM)
    for stage in stages:
        stage.wait_exit(2.0)
        stage.kill_and_clean()


atexit.register(_stop_live_stages_at_exit)


def _disown_stages_in_forked_child() -> None:
    # A process forked from a stage's parent (a worker pool, say) does not own its stages:
    # its exit hook must not stop them, and its copy of each death pipe must not keep a
    # stage from seeing EOF when the real parent dies.
    for stage in _live:
        stage.conn.close()
    _live.clear()


os.register_at_fork(after_in_child=_disown_stages_in_forked_child)


def factory_kwargs(kwargs: object) -> dict[str, Any]:
    """The engine factory's *kwargs* (``None``: none) as a new dict: :class:`TypeError`
    for anything but a mapping (a list once failed with "cannot convert dictionary update
    sequence element #0 to a sequence")."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"factory kwargs must be a dict, got {type(kwargs).__name__}")
    return dict(kwargs)


def _validate_factory(factory: str) -> None:
    """:class:`TypeError` unless *factory* is a ``str``, :class:`ValueError` unless it is
    ``pkg.module:factory``, each dotted part an identifier: checked before a process starts
    (``"m:a:b"`` or ``".rel:f"`` failed in the child, as a startup error). ``serve
    --engine`` checks the same. Whether it imports is the child's to find out."""
    if not isinstance(factory, str):
        raise TypeError(f"engine factory must be an import string, got {type(factory).__name__}")
    module, sep, attr = factory.partition(":")
    if not (
        sep
        and all(part.isidentifier() for part in module.split("."))
        and all(part.isidentifier() for part in attr.split("."))
    ):
        raise ValueError(
            f"engine factory must look like 'pkg.module:factory' (a dotted module path, a "
            f"colon, the factory's name), got {factory!r:.200}"
        )


def check_startup_timeout(startup_timeout: object) -> None:
    """:class:`TypeError` / :class:`ValueError` unless *startup_timeout* is a number of
    seconds > 0: checked before any process starts (a stage given no time to start would
    be spawned and killed, and the error would blame it)."""
    positive_seconds(startup_timeout, "startup_timeout")


def launch_process(
    factory: str,
    kwargs: dict[str, Any] | None,
    startup_timeout: float,
    name: str | None,
    *,
    step_timeout: float | None = STEP_TIMEOUT,
    kill_after: float | None = None,
    log_level: int | str | None = None,
    forward_logs: bool = False,
    load_interval: float | None = LOAD_INTERVAL,
    max_message_bytes: int | None = None,
    listen: TcpListen | None = None,
    cancel: multiprocessing.connection.Connection | None = None,
) -> Launched:
    """Spawn a stage process and wait until it is ready. Blocks up to *startup_timeout*.

    Raises :class:`StageStartupError` (no process left behind) if the factory raised, the child
    died, or it was not ready in time; :class:`ValueError` / :class:`TypeError` for bad
    arguments, before anything is started; :class:`StageClosedError` (the process killed)
    once *cancel* (the read end of a pipe: a pool's, written when it closes or removes
    the replica) is readable before the stage is ready. The other arguments are
    :func:`start_process`'s.
    """
    check_startup_timeout(startup_timeout)
    launched = start_process(
        factory,
        kwargs,
        name,
        step_timeout=step_timeout,
        kill_after=kill_after,
        log_level=log_level,
        forward_logs=forward_logs,
        load_interval=load_interval,
        max_message_bytes=max_message_bytes,
        listen=listen,
    )
    try:
        _wait_ready(launched, factory, startup_timeout, cancel)
    except BaseException:
        launched.kill_and_clean()
        raise
    return launched


async def launch_process_async(
    factory: str,
    kwargs: dict[str, Any] | None,
    startup_timeout: float,
    name: str | None,
    *,
    step_timeout: float | None = STEP_TIMEOUT,
    kill_after: float | None = None,
    log_level: int | str | None = None,
    forward_logs: bool = False,
    load_interval: float | None = LOAD_INTERVAL,
    max_message_bytes: int | None = None,
    listen: TcpListen | None = None,
) -> Launched:
    """:func:`launch_process`, awaited, holding no thread: the process is started on the
    event loop's thread (a spawn: one fork and exec, milliseconds), then its ready report is
    awaited with event-loop readers on its pipe and its sentinel, while the factory builds
    the engine. So any number of launches progress together, however small the loop's
    default executor. The same errors, with the same messages. Cancelled (or failed), it
    kills the half-started stage and awaits its exit before the exception propagates; if
    that wait is cancelled too, the stage is still reaped and its files removed once it
    has exited (:func:`kill_and_clean_async`)."""
    check_startup_timeout(startup_timeout)
    launched = start_process(
        factory,
        kwargs,
        name,
        step_timeout=step_timeout,
        kill_after=kill_after,
        log_level=log_level,
        forward_logs=forward_logs,
        load_interval=load_interval,
        max_message_bytes=max_message_bytes,
        listen=listen,
    )
    try:
        report = await _await_report(launched, startup_timeout)
        if report is None:
            raise _not_ready(launched, factory, startup_timeout)
        if report[0] != "ready":
            await _await_exit(launched, 5.0)  # for its exit code, as join(timeout=5)
            launched.reap()
            raise _startup_failure(launched, factory, report)
        _ready(launched, report)
    except GeneratorExit:
        # The coroutine closed unfinished (its loop closed, or it was dropped): no await
        # is possible any more, so the half-started stage is killed here and now.
        launched.kill_and_clean()
        raise
    except BaseException:
        await kill_and_clean_async(launched)
        raise
    return launched


def start_process(
    factory: str,
    kwargs: dict[str, Any] | None,
    name: str | None,
    *,
    step_timeout: float | None = STEP_TIMEOUT,
    kill_after: float | None = None,
    log_level: int | str | None = None,
    forward_logs: bool = False,
    load_interval: float | None = LOAD_INTERVAL,
    max_message_bytes: int | None = None,
    listen: TcpListen | None = None,
) -> Launched:
    """Spawn a stage process, without waiting for it: its ready report comes on
    ``Launched.conn`` (:func:`_read_report`). Never blocks for the stage's start.

    Raises :class:`ValueError` / :class:`TypeError` for bad arguments, before anything is
    started, and :class:`StageStartupError` for an ipc path too long. *step_timeout* and
    *kill_after* configure the stage's step watchdog (``StageRuntime``). The stage's log
    records carry *name* (default: *factory*) as ``stage``; *log_level* is its root logger's
    level; with *forward_logs*, its records are re-emitted in this process (``_logs``).
    *load_interval* is the least time between two load reports (``None``: none;
    ``_statistics``). *max_message_bytes* bounds a frame on the stage's input socket
    (``None``: unbounded; ``StageRuntime``). With *listen* (:class:`TcpListen`), the stage
    listens on TCP with CURVE instead of ipc; its addresses come with its ready report.
    """
    _validate_factory(factory)
    check_watchdog(step_timeout, kill_after)
    level = _logs.check_log_level(log_level)
    load_interval = check_load_interval(load_interval)
    check_max_message_bytes(max_message_bytes)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not isinstance(forward_logs, bool):
        raise TypeError(f"forward_logs must be a bool, got {type(forward_logs).__name__}")
    stage = name or factory
    kwargs = factory_kwargs(kwargs)
    _wire.check_encodable(kwargs, "factory kwargs")
    if not all(type(k) is str for k in kwargs):
        raise TypeError("factory kwargs must have str keys")
    kwargs_frame = _codec.encode_plain(kwargs, "factory kwargs")

    ipc_dir = tempfile.mkdtemp(prefix="enginecore-")  # mode 0700: only this user can connect
    input_path = os.path.join(ipc_dir, "in")
    if len(input_path) + 1 > _MAX_IPC_PATH:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise StageStartupError(
            f"ipc socket path {input_path!r} is too long for a Unix socket; "
            f"set TMPDIR to a shorter directory"
        )
    input_address = f"ipc://{input_path}"
    output_address = f"ipc://{os.path.join(ipc_dir, 'out')}"
    log_address, logs = None, None
    if forward_logs:
        try:
            log_address, logs = _logs.forward_to_parent(ipc_dir, stage)
        except BaseException:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise

    # The spawn target, imported here and not at the top: it loads the whole stage runtime,
    # which a client process never needs (the child imports it again, by name, anyway).
    from . import _process

    ctx = multiprocessing.get_context("spawn")  # fork + threads is unsafe
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(
        target=_process.run_launched,
        args=(
            factory,
            kwargs_frame,
            input_address,
            output_address,
            child_conn,
            ipc_dir,
            step_timeout,
            kill_after,
            stage,
            level,
            log_address,
            load_interval,
            None if listen is None else (listen.bind(), listen.server, listen.client.public_key),
            max_message_bytes,
        ),
        name=name or f"enginecore-stage[{factory}]",
        daemon=False,
    )
    launched = Launched(process, parent_conn, ipc_dir, input_address, stage, logs)
    if listen is not None:
        launched.curve = listen.client
    started = False
    try:
        # Started first if it is not running yet: its own start unblocks SIGINT on this
        # thread (multiprocessing's code), which would undo _sigint_held for our child.
        resource_tracker.ensure_running()
        with _sigint_held():
            process.start()
            _live.add(launched)
            started = True
    except BaseException:
        child_conn.close()
        if started:  # a Ctrl-C held back while it started: the stage goes
            launched.kill_and_clean()
        else:
            parent_conn.close()
            if logs is not None:
                logs.release()
            shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    child_conn.close()  # else the child could never see EOF from our side, nor we from its
    return launched


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back while a stage process is spawned, and raise it after.

    A terminal's Ctrl-C goes to the child too (same process group). The child ignores it
    once ``_process.run_launched`` runs, but it spends a while importing before that: a
    SIGINT then printed a KeyboardInterrupt traceback from the child. So this thread blocks
    SIGINT around the spawn, and the child, which inherits the mask through fork and exec,
    starts with it blocked; ``run_launched`` unblocks it once it ignores it (a pending one
    is then dropped). What ``multiprocessing.resource_tracker`` does for its own process.

    In the main thread the signal may still reach another thread, and its Python handler
    would raise in the middle of ``Process.start()``, with the child started and its pid
    not yet known (an orphan); so there the handler is swapped for one that notes the
    signal, and the real one is called once the start is over (``default_int_handler``:
    ``KeyboardInterrupt``, out of this block). Elsewhere a Ctrl-C is the main thread's.
    The same goes for a Python handler of SIGTERM (a program that turns it into an
    exception, as the benchmarks' ``run_main`` does: the child read half its start-up
    data and printed an ``EOFError``); SIGTERM is not masked, as it is no terminal's.
    """
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handlers: dict[signal.Signals, Any] = {}
    caught: list[tuple[int, Any]] = []
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):  # not SIG_IGN or SIG_DFL: nothing to hold back then
                handlers[signum] = handler
                signal.signal(signum, lambda num, frame: caught.append((num, frame)))
    try:
        yield
    finally:
        try:
            # A SIGINT pending on this thread is delivered now, to the noting handler.
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        finally:
            for held, handler in handlers.items():
                signal.signal(held, handler)
            for num, frame in caught:  # in their order; the first to raise ends it
                handlers[signal.Signals(num)](num, frame)


def _read_report(launched: Launched) -> tuple[Any, ...] | None:
    """The stage's startup report, without blocking: ``("ready",)``, ``("error", err_repr,
    traceback)`` (its factory failed), ``("died",)`` (it closed its end of the pipe, or
    exited, without a report); ``None``: nothing yet."""
    conn = launched.conn
    if conn.poll(0):
        try:
            return tuple(msgspec.msgpack.decode(conn.recv_bytes()))
        except (EOFError, OSError):
            return ("died",)  # the child closed its end: it is exiting
    if launched.wait_exit(0):
        if conn.poll(0):  # a report that raced with the exit
            return _read_report(launched)
        return ("died",)
    return None


def _ready(launched: Launched, report: tuple[Any, ...]) -> None:
    """The ready report ``("ready", pid[, input address])``: a stage that listens on TCP
    names the address it bound (its port is known only then)."""
    if len(report) > 2:
        launched.input_address = str(report[2])


def _startup_failure(
    launched: Launched, factory: str, report: tuple[Any, ...]
) -> StageStartupError:
    """The error for a failed *report* (not ``ready``), once the process has exited (or
    had its chance to): its exit code tells why."""
    process = launched.process
    if report[0] == "died":
        return StageStartupError(
            f"stage {factory!r} (pid {process.pid}) {describe_exit(process.exitcode)} "
            f"during startup (see its stderr)",
            exit_code=process.exitcode,
        )
    _, err_repr, tb = report
    return StageStartupError(
        f"engine factory {factory!r} failed in the stage process: {err_repr}\n\n"
        f"Child traceback:\n{tb}",
        child_traceback=tb,
        exit_code=process.exitcode,
    )


def _not_ready(launched: Launched, factory: str, startup_timeout: float) -> StageStartupError:
    return StageStartupError(
        f"stage {factory!r} (pid {launched.process.pid}) did not report ready within "
        f"{startup_timeout} s; it was killed"
    )


def _wait_ready(
    launched: Launched,
    factory: str,
    startup_timeout: float,
    cancel: multiprocessing.connection.Connection | None = None,
) -> None:
    waitables: list[Any] = [launched.conn, launched.process.sentinel]
    if cancel is not None:
        waitables.append(cancel)
    deadline = time.monotonic() + startup_timeout
    ready: list[Any] = []
    while True:
        report = _read_report(launched)
        if report is not None:
            if report[0] == "ready":
                _ready(launched, report)
                return
            launched.process.join(timeout=5)
            raise _startup_failure(launched, factory, report)
        if cancel is not None and cancel in ready:
            raise StageClosedError(
                f"the start of stage {factory!r} (pid {launched.process.pid}) was cancelled; "
                f"it was killed"
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _not_ready(launched, factory, startup_timeout)
        # At most _POLL_MAX_S a wait (poll takes an int of ms: ~24 days), then look again.
        ready = multiprocessing.connection.wait(waitables, min(remaining, _POLL_MAX_S))


async def _await_report(launched: Launched, startup_timeout: float) -> tuple[Any, ...] | None:
    """:func:`_read_report`, awaited up to *startup_timeout* seconds (``None`` past it),
    with event-loop readers on the pipe and the sentinel: no thread waits."""
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()
    fds = (launched.conn.fileno(), launched.process.sentinel)
    for fd in fds:
        loop.add_reader(fd, woke.set)
    try:
        deadline = loop.time() + startup_timeout
        while True:
            woke.clear()  # before the read: a report that comes after it sets it again
            report = _read_report(launched)
            if report is not None:
                return report
            left = deadline - loop.time()
            if left <= 0:
                return None
            await _aio.wait_event(woke, left)  # a cancel propagates (not wait_for's)
    finally:
        for fd in fds:
            loop.remove_reader(fd)


async def _await_exit(launched: Launched, timeout: float | None) -> None:
    """Await the process's exit (its sentinel), at most *timeout* seconds; not reaped."""
    if launched.wait_exit(0):
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    sentinel = launched.process.sentinel

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(sentinel, on_exit)
    try:
        await _aio.until(exited, None if timeout is None else time.monotonic() + timeout)
    finally:
        loop.remove_reader(sentinel)


async def kill_and_clean_async(launched: Launched) -> None:
    """:meth:`Launched.kill_and_clean`, awaited: SIGKILL, then the exit awaited with an
    event-loop reader on the sentinel, whose callback reaps the process and removes its
    files. If this wait is cancelled before then, a daemon thread takes the reader's place
    and does that once the process has exited: a cancel is often the event loop's own end
    (``asyncio.run`` cancels what is left), and a reader left on a stopped loop never ran,
    so the killed stage stayed a zombie, its ipc dir on disk, until the interpreter's exit."""
    loop = asyncio.get_running_loop()
    launched.send_signal(signal.SIGKILL)
    done: asyncio.Future[None] = loop.create_future()
    sentinel = launched.process.sentinel

    def on_exit() -> None:
        loop.remove_reader(sentinel)
        launched.reap()
        launched.release()
        if not done.done():
            done.set_result(None)

    loop.add_reader(sentinel, on_exit)
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        if not done.done():  # on_exit has not run (it runs on this thread): it never will
            loop.remove_reader(sentinel)
            threading.Thread(
                target=launched.kill_and_clean, name="enginecore-reaper", daemon=True
            ).start()
        raise
