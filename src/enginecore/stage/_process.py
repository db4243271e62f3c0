"""The ways a stage process starts and ends: :func:`run_launched` (the target of a spawned
stage, see ``_launch``) and :func:`serve` (``python -m enginecore serve``).

Both resolve an engine factory by name (:func:`import_factory`), run a
:class:`~._runtime.StageRuntime` and make sure the process ends (:func:`exit_soon`). A
launched stage also watches its parent through a pipe and shuts down when the parent dies.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Final

import msgspec

from .._engine import Engine, PipelinedEngine
from .._exceptions import describe
from .._signals import shutdown_on_signals
from ._curve import ServerCurve, _check_key, read_authorized
from ._fanout import CLIENT_BUFFER
from ._logs import configure_stage
from ._runtime import (
    DETACHED_BUFFER,
    EXIT_FATAL,
    EXIT_OK,
    EXIT_ORPHANED,
    StageRuntime,
    probe_bind,
)
from ._statistics import LOAD_INTERVAL
from ._watchdog import STEP_TIMEOUT

__all__ = [
    "MetricsBindError",
    "NotAnEngineError",
    "build_engine",
    "exit_soon",
    "import_factory",
    "run_launched",
    "serve",
]

logger = logging.getLogger("enginecore.stage")

# How long interpreter shutdown may take once the loop has ended.
_EXIT_WATCHDOG_S: Final = 5.0
# How long an orphaned stage may take to shut down gracefully before it ends itself.
_ORPHAN_GRACE_S: Final = 1.5


def import_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``"pkg.module:attr"`` (``attr`` may be dotted) to a callable.

    Raises :class:`ValueError` for a malformed string, :class:`ImportError` /
    :class:`AttributeError` if it does not resolve, :class:`TypeError` if not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"engine factory must look like 'pkg.module:factory', got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"engine factory {spec!r} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


class NotAnEngineError(TypeError):
    """The engine factory returned something that is not an :class:`~enginecore.Engine` nor
    a :class:`~enginecore.PipelinedEngine`: the message says it all (``serve`` prints it as
    one line, without a traceback of enginecore's frames)."""


def build_engine(spec: str, kwargs: dict[str, Any]) -> Engine | PipelinedEngine[Any]:
    """Call the factory; check that it returned an :class:`~enginecore.Engine` or a
    :class:`~enginecore.PipelinedEngine` (:class:`NotAnEngineError` otherwise)."""
    engine = import_factory(spec)(**kwargs)
    if not isinstance(engine, (Engine, PipelinedEngine)):
        raise NotAnEngineError(
            f"engine factory {spec!r} returned an object of type {type(engine).__name__}, "
            f"which does not implement the enginecore.Engine protocol (nor "
            f"enginecore.PipelinedEngine)"
        )
    return engine


# The factory every stage of a pipeline is launched with (``_pipelinebase.PIPE_FACTORY``,
# not imported here: that is the client's side): it wraps the user's, kwargs["factory"].
_PIPE_FACTORY: Final = "enginecore.stage._pipe_stage:pipe_stage"


def engine_name(spec: str, kwargs: dict[str, Any]) -> str:
    """The factory a stage reports (its welcome, ``StageStatistics.factory``, Prometheus's
    ``enginecore_stage_info{engine=}``): *spec*, or for a pipeline's stage the user's factory
    that the pipeline's wrapper builds."""
    inner = kwargs.get("factory") if spec == _PIPE_FACTORY else None
    return inner if isinstance(inner, str) else spec


def run_launched(
    factory: str,
    kwargs_frame: bytes,
    input_address: str,
    output_address: str,
    conn: Any,
    ipc_dir: str,
    step_timeout: float | None = None,
    kill_after: float | None = None,
    stage: str | None = None,
    log_level: int | None = None,
    log_address: str | None = None,
    load_interval: float | None = LOAD_INTERVAL,
    listen: tuple[str, ServerCurve, bytes] | None = None,
    max_message_bytes: int | None = None,
) -> None:
    """Target of the spawned stage process (see ``_launch.launch_process``).

    *conn* is this end of a duplex pipe: the child reports ``["ready", pid]`` or
    ``["error", repr, traceback]`` on it, then waits on it for EOF, which means the parent
    died. Ends the process with the stage's exit code. Logging is set up first (``_logs``):
    records named *stage* (default: *factory*), at *log_level*, pushed to *log_address* if
    given.

    *listen*: ``(address, curve, owner)`` (``_launch.TcpListen``): both sockets bind the TCP
    *address* (``TcpListen.bind``: any free port), as CURVE servers with *curve*, instead
    of the ipc addresses; the ready report is then ``["ready", pid, input address]``, and
    the parent may send ``["authorize", number, [keys]]`` on the pipe: the stage admits its
    *owner* (the parent's public key) and those keys from then on, and answers
    ``["authorized", number, count]`` (or ``["error", number, repr]``) once it has
    (:class:`_Parent`).
    """
    # The parent owns this process's lifecycle: a terminal Ctrl-C goes to the parent, whose
    # client shuts the stage down; should the parent die instead, the pipe says so. The
    # parent spawned this process with SIGINT blocked (_launch._sigint_held), so that a
    # Ctrl-C during its imports printed no traceback: unblocked only now that it is ignored
    # (which drops one pending).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = _Parent(conn, ipc_dir)
    curve = None
    if listen is not None:
        address, curve, parent.owner = listen
        input_address = output_address = address
    parent.start()
    try:
        configure_stage(stage or factory, log_level, log_address)
        kwargs = msgspec.msgpack.decode(kwargs_frame)
        engine = build_engine(factory, kwargs)
        runtime = StageRuntime(
            engine,
            input_address,
            output_address,
            engine_name=engine_name(factory, kwargs),
            step_timeout=step_timeout,
            kill_after=kill_after,
            handle_signals=(signal.SIGTERM,),
            load_interval=load_interval,
            name=stage,
            curve=curve,
            max_message_bytes=max_message_bytes,
        )
    except BaseException as exc:
        _report(conn, "error", describe(exc), traceback.format_exc())
        sys.exit(EXIT_FATAL)
    parent.runtime = runtime
    if curve is None:
        _report(conn, "ready", os.getpid())
    else:  # its port is known now
        _report(conn, "ready", os.getpid(), runtime.input_address)
    code = runtime.run()
    if parent.gone.is_set():
        # Nobody else is left to remove the socket directory.
        shutil.rmtree(ipc_dir, ignore_errors=True)
    exit_soon(code)
    sys.exit(code)


class MetricsBindError(OSError):
    """``serve`` could not bind its metrics endpoint (``--metrics-host``/``--metrics-port``)."""


def serve(
    factory: str,
    kwargs: dict[str, Any],
    bind: str,
    output_bind: str,
    *,
    session_timeout: float,
    detached_buffer: int = DETACHED_BUFFER,
    keep_requests_on_detach: bool = False,
    max_clients: int = 1,
    client_buffer: int = CLIENT_BUFFER,
    max_message_bytes: int | None = None,
    drain_timeout: float | None = None,
    step_timeout: float | None = STEP_TIMEOUT,
    kill_after: float | None = None,
    name: str | None = None,
    log_level: int | None = None,
    load_interval: float | None = LOAD_INTERVAL,
    metrics: tuple[str, int] | None = None,
    ready: Callable[[str, str], None],
    metrics_ready: Callable[[str], None] | None = None,
    curve: ServerCurve | None = None,
) -> int:
    """Run a headless stage in this process (``python -m enginecore serve``). Blocks.

    Calls ``ready(input_address, output_address)`` with the bound endpoints once the sockets
    are bound and the signal handlers are in place; returns the exit code. SIGTERM and
    SIGINT shut it down gracefully, also one that arrives right after ``ready``: at once,
    or, with *drain_timeout*, after a drain of at most that many seconds (a second signal
    then stops it at once); once the stage has stopped, they are ignored (the exit code
    stays the stage's). One that arrives while the engine is built interrupts the
    factory and stops the stage without calling ``ready`` (exit 0; :class:`_EarlySignals`).
    What the factory writes to stdout while it builds the engine goes to stderr
    (:func:`_stdout_to_stderr`): stdout's first line is ``ready``'s.
    Raises what the factory raises, and what binding raises. Logging is set up first
    (``_logs``): records named *name* (default: *factory*), at *log_level*.

    With *metrics* ``(host, port)``, an HTTP ``/metrics`` endpoint (``prometheus``; port 0:
    a free one) serves the stage's statistics, labelled ``stage=<name>``, from threads that
    never wait for the loop; it is bound first, before the engine is built, and
    ``metrics_ready(url)`` is then called. Raises :class:`MetricsBindError` if it cannot bind.

    With *curve*, both sockets are CURVE servers behind a ZAP handler that admits only its
    authorized client keys (``serve --curve-secret-key --authorized-clients``); SIGHUP
    reads ``curve.authorized_dir`` again and admits its keys from then on: new connections
    are checked against them, and a connected client whose key was removed loses its
    session (key rotation, :meth:`StageRuntime.authorize`).

    With *max_clients* above 1 (``serve --max-clients``), up to that many clients are
    attached at once, each with an output socket of its own (``StageRuntime``); a client
    with more than *client_buffer* events queued is detached.

    With *max_message_bytes* (``serve --max-message-bytes``), the input socket takes no
    larger frame (``StageRuntime``).
    """
    label = name or factory
    configure_stage(label, log_level, None)
    # A port in use (or an ipc path in a missing directory) fails now, not once the engine
    # has loaded minutes later (probe_bind: what it can tell before the real bind).
    probe_bind(bind, "input")
    probe_bind(output_bind, "output")
    # The endpoint is bound first: a port in use fails before the engine loads, and a
    # scrape while it loads reads enginecore_stage_up 0.
    built: list[StageRuntime] = []
    server = None
    if metrics is not None:
        from .prometheus import start_metrics_server

        host, port = metrics
        try:
            server = start_metrics_server(
                lambda: built[0].statistics() if built else None, label, host, port
            )
        except OSError as exc:
            raise MetricsBindError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        if metrics_ready is not None:
            metrics_ready(server.url)
    drainer = reload = None
    # SIGHUP reloads the keys of a CURVE stage; without CURVE there is nothing to reload,
    # and its default action (death) would leave the ipc socket files behind.
    stop_signals = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if curve is None else ())
    early = _EarlySignals(stop_signals, reload=signal.SIGHUP if curve is not None else None)
    try:
        # The handlers go in before the engine is built (a model may load for minutes): a
        # stop signal then ends the build (_EarlySignals) and the stage stops as on any
        # stop, exit 0; a SIGHUP of a CURVE stage reloads the keys once it is built.
        early.install()
        try:
            # What the factory prints (a model's loading messages) goes to stderr: stdout's
            # first line is the ready line, which a script reads for the address.
            with _stdout_to_stderr():
                engine = build_engine(factory, kwargs)
            early.building = False
        except BaseException as exc:
            if not early.stopped:
                raise
            logger.warning(
                "enginecore: %s while the engine was being built (%s): stopped",
                early.stopped,
                describe(exc) if not isinstance(exc, _StopSignal) else "interrupted",
            )
            exit_soon(EXIT_OK)
            return EXIT_OK
        runtime = StageRuntime(
            engine,
            bind,
            output_bind,
            engine_name=factory,
            session_timeout=session_timeout,
            detached_buffer=detached_buffer,
            keep_requests_on_detach=keep_requests_on_detach,
            max_clients=max_clients,
            client_buffer=client_buffer,
            max_message_bytes=max_message_bytes,
            step_timeout=step_timeout,
            kill_after=kill_after,
            load_interval=load_interval,
            name=name,
            handle_signals=(),
            curve=curve,
        )
        built.append(runtime)
        # The handlers go in before ready() announces the stage: a signal sent as soon as
        # the line is read is then a graceful shutdown (before run(), it makes run() stop at
        # once), not a default death (exit -15) or a KeyboardInterrupt traceback.
        drainer = None if drain_timeout is None else _DrainFirst(runtime, drain_timeout)
        reload = None if curve is None else _KeyReload(runtime, curve)
        with (
            shutdown_on_signals(drainer or runtime.loop, stop_signals),
            contextlib.nullcontext() if reload is None else reload.on_sighup(),
        ):
            if early.stopped:  # after the build, before these handlers: never announced
                logger.warning(
                    "enginecore: %s while the engine was being built: stopped", early.stopped
                )
                runtime.loop.request_shutdown()
                code = runtime.run()
                exit_soon(code)
                return code
            if early.reloads and reload is not None:
                reload.reload()  # a SIGHUP during the build: the directory as it is now
            try:
                ready(runtime.input_address, runtime.output_address)
            except BaseException:
                # (A stdout closed before the ready line.) Nobody learns the address: stop,
                # and close the sockets (the ipc files go) before the error propagates.
                runtime.loop.request_shutdown()
                runtime.run()
                raise
            code = runtime.run()
    finally:
        # The stage has stopped (or failed to start), and the process ends once this
        # returns: a stop signal from now on has nothing left to stop. The default action
        # would end the process with -15 (a KeyboardInterrupt, 130) instead of the exit
        # code, as a second signal sent just after the first did. So they are ignored.
        early.ignore()
        if drainer is not None:
            drainer.close()
        if reload is not None:
            reload.close()
        if server is not None:
            server.close()
    exit_soon(code)
    return code


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Within the block, what is written to stdout goes to stderr: ``print()`` (through
    ``sys.stdout``) and writes to file descriptor 1 (a C library's). Nothing is done if
    stdout or stderr is closed. (A C library's own stdio buffer, written to fd 1 after the
    block, is out of reach.)"""
    python_stdout, python_stderr = sys.stdout, sys.stderr
    saved = None
    if python_stdout is not None and python_stderr is not None:
        with contextlib.suppress(OSError, ValueError):  # no fd 1, or a stream closed
            python_stdout.flush()
            python_stderr.flush()
            saved = os.dup(1)
    if saved is None:
        yield  # (not in the except clause: a factory's error would chain to that one)
        return
    try:
        try:
            os.dup2(2, 1)
        except OSError:  # no fd 2: stdout stays as it is
            pass
        else:
            sys.stdout = python_stderr
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        if sys.stdout is python_stderr:  # unless the factory set one of its own
            sys.stdout = python_stdout
        os.dup2(saved, 1)
        os.close(saved)


class _StopSignal(BaseException):
    """Raised by :class:`_EarlySignals` into the engine's build: a stop signal came."""


class _EarlySignals:
    """``serve``'s signal handlers while the engine is built, before the runtime exists.

    A stop signal (*stop_signals*) is recorded, and while :attr:`building` raises
    :class:`_StopSignal` into the factory (as Python's own SIGINT handler raises
    ``KeyboardInterrupt``), so that a model that loads for minutes need not finish first.
    One that comes after the build, before the runtime's own handlers are in place, is only
    recorded: ``serve`` then stops without announcing the stage. *reload* (SIGHUP of a
    CURVE stage) is counted, and the keys are reloaded once the stage is built.
    :meth:`ignore` ignores them all once ``serve`` has ended.
    """

    def __init__(self, stop_signals: tuple[int, ...], *, reload: int | None) -> None:
        self._stop = stop_signals
        self._reload = reload
        self.building = True
        self.stopped = ""  # the name of the first stop signal that came, if any
        self.reloads = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (*self._stop, *(() if self._reload is None else (self._reload,))):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == self._reload:
            self.reloads += 1
            return
        if not self.stopped:
            self.stopped = signal.Signals(signum).name
        if self.building:
            self.building = False  # once: the factory's own cleanup is not interrupted again
            raise _StopSignal(self.stopped)

    def ignore(self) -> None:
        """Ignore the signals handled here from now on (``serve`` has ended)."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()


class _DrainFirst:
    """What ``serve --drain-timeout`` does on a signal: drain first, stop at once on the
    next one.

    A signal handler may not take the loop queue's lock (it may have interrupted its
    holder), so the first signal only writes a byte to a pipe, and a thread of its own,
    blocked reading it, asks the runtime for the drain. The second calls the loop's
    signal-safe ``request_shutdown()``. :meth:`close` ends the thread.
    """

    def __init__(self, runtime: StageRuntime, seconds: float) -> None:
        self._runtime = runtime
        self._seconds = seconds
        self._draining = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._thread = threading.Thread(target=self._wait, name="enginecore-drain", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            if os.read(self._r, 1):  # b"": close() before any signal
                self._runtime.request_drain(self._seconds)
        finally:
            os.close(self._r)

    def request_shutdown(self) -> None:
        """The signal handler. Signal-safe: a flag, an ``os.write``, or the loop's own."""
        if self._draining:
            self._runtime.loop.request_shutdown()
        else:
            self._draining = True
            with contextlib.suppress(OSError):
                os.write(self._w, b"d")

    def close(self) -> None:
        """After the signal handlers are gone: end the thread (EOF), wait for it."""
        os.close(self._w)
        self._thread.join()


class _KeyReload:
    """``serve --authorized-clients DIR`` on SIGHUP: read *DIR* again and admit its keys
    from then on (key rotation, ``docs/security.md``). New connections are checked against
    the new keys, and the clients connected with a key removed lose their sessions before
    the reload is logged (:meth:`StageRuntime.authorize`).

    As for :class:`_DrainFirst`, the signal handler only writes a byte to a pipe; a thread
    of its own reads the directory and swaps the keys, and logs what changed (a warning, so
    that it shows at the default level). A directory that cannot be read, or that lists no
    key, is logged and changes nothing. :meth:`close` ends the thread. The log says how
    many clients were cut only when some were.
    """

    def __init__(self, runtime: StageRuntime, curve: ServerCurve) -> None:
        self._runtime = runtime
        self._directory = curve.authorized_dir
        self._keys = curve.authorized
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self.reloads = 0  # how many reloads took effect (tests)
        self._thread = threading.Thread(target=self._wait, name="enginecore-keys", daemon=True)

    @contextlib.contextmanager
    def on_sighup(self) -> Iterator[None]:
        """Reload on SIGHUP while inside (the previous handler is put back after)."""
        self._thread.start()
        previous = signal.signal(signal.SIGHUP, self._signalled)
        try:
            yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def _signalled(self, signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError):  # a full pipe: a reload is pending anyway
            os.write(self._w, b"r")

    def _wait(self) -> None:
        try:
            while os.read(self._r, 64):  # b"": close()
                self.reload()
        finally:
            os.close(self._r)

    def reload(self) -> None:
        """Read the directory and admit its keys (or log why not and keep the old ones)."""
        try:
            keys = read_authorized(self._directory)
        except (OSError, ValueError) as exc:
            logger.warning(
                "enginecore: SIGHUP: kept the %d authorized client keys: %s",
                len(self._keys),
                exc,
            )
            return
        added, removed = len(keys - self._keys), len(self._keys - keys)
        cut = self._runtime.authorize(keys)
        self._keys = keys
        self.reloads += 1
        if cut is None:  # the input side was held up: it cuts them as soon as it is free
            cuts = "; the clients connected with a removed key are cut at the input's next turn"
        elif cut:
            cuts = f"; clients cut (connected with a removed key): {cut}"
        else:
            cuts = ""
        logger.warning(
            "enginecore: SIGHUP: reloaded the authorized client keys from %s: %d keys "
            "(%d added, %d removed); new connections are checked against them%s",
            self._directory,
            len(keys),
            added,
            removed,
            cuts,
        )

    def close(self) -> None:
        """After the signal handler is gone: end the thread (EOF), wait for it."""
        os.close(self._w)
        if self._thread.is_alive():
            self._thread.join()
        elif self._thread.ident is None:  # never started: nobody reads the pipe
            os.close(self._r)


def exit_soon(code: int) -> None:
    """Make sure the process ends: a normal exit waits for every non-daemon thread, and an
    engine may have left one running. After a grace period, ``os._exit(code)``."""

    def watchdog() -> None:
        time.sleep(_EXIT_WATCHDOG_S)
        logger.error(
            "enginecore: the stage process did not exit %.0f s after its loop ended "
            "(a non-daemon thread?); forcing exit code %d",
            _EXIT_WATCHDOG_S,
            code,
        )
        os._exit(code)

    threading.Thread(target=watchdog, name="enginecore-exit", daemon=True).start()


class _Parent:
    """The parent process, seen through the death pipe: a thread blocks reading *conn*
    until EOF, when the parent has died. A stage that listens on TCP with CURVE also takes
    the parent's key changes on it (:meth:`_control`); any other stage never gets a
    message on it."""

    def __init__(self, conn: Any, ipc_dir: str) -> None:
        self._conn = conn
        self._ipc_dir = ipc_dir
        self.runtime: StageRuntime | None = None  # set by the main thread once built
        self.owner: bytes | None = None  # the parent's public key, on a CURVE stage
        self.gone = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="enginecore-parent", daemon=True).start()

    def _control(self, frame: bytes) -> None:
        """``["authorize", number, [keys]]`` from the parent (sent only once the stage
        reported ready, so only this thread writes on the pipe then): admit the parent's
        own key and *keys* from now on (:meth:`StageRuntime.authorize`), then answer,
        naming the request's *number*."""
        number = None
        try:
            kind, number, keys = msgspec.msgpack.decode(frame)
            runtime = self.runtime
            if kind != "authorize" or runtime is None or self.owner is None:
                raise RuntimeError(f"unexpected message from the parent: {kind!r}")
            admitted = frozenset(
                [self.owner, *(_check_key(k, "an authorized client key") for k in keys)]
            )
            runtime.authorize(admitted)
        except Exception as exc:
            _report(self._conn, "error", number, repr(exc))
        else:
            _report(self._conn, "authorized", number, len(admitted))

    def _watch(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:  # returns or raises at EOF
                self._control(self._conn.recv_bytes())
        runtime = self.runtime
        if runtime is not None and runtime.finished.is_set():
            return
        self.gone.set()
        logger.error("enginecore: the parent process is gone; shutting the stage down")
        if runtime is not None:
            runtime.abandon()
            if runtime.finished.wait(_ORPHAN_GRACE_S):
                return
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        os._exit(EXIT_ORPHANED)


def _report(conn: Any, *message: Any) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(msgspec.msgpack.encode(message))
