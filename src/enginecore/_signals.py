"""shutdown_on_signals: turn SIGTERM/SIGINT into ``loop.request_shutdown()``, safely."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Protocol

__all__ = ["shutdown_on_signals"]


class _SupportsRequestShutdown(Protocol):
    def request_shutdown(self) -> None: ...


_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _name(sig: int) -> str:
    try:
        return f"{signal.Signals(sig).name} ({sig})"
    except ValueError:
        return str(sig)


@contextlib.contextmanager
def shutdown_on_signals(
    loop: _SupportsRequestShutdown,
    signals: Iterable[signal.Signals | int] = _DEFAULT_SIGNALS,
) -> Iterator[None]:
    """Within the block, each of *signals* calls ``loop.request_shutdown()``.

    The handler does nothing else: no logging, no ``Queue.put``, no lock that the interrupted
    thread might hold. That matters because Python runs handlers in the main thread between
    bytecodes, possibly while that thread holds the queue's non-reentrant mutex: in the
    loop's drain (which copies and clears ``input_queue.queue`` under ``input_queue.mutex``),
    inside ``input_queue.get()``, or inside a ``put()``;
    :meth:`EngineCoreLoop.request_shutdown` is written to be safe there. On exit the previous
    handlers are restored, even if the block raised.

    Must be entered in the main thread (:class:`ValueError` otherwise). Repeated signals
    are harmless: ``request_shutdown()`` is idempotent. Checked on entry, before the block
    runs and with every handler left as it was: a *loop* without ``request_shutdown()`` and
    *signals* that is not an iterable of signal numbers raise :class:`TypeError`; a signal
    that cannot have a handler (``SIGKILL``, a number out of range) :class:`ValueError`. A
    signal listed twice is handled once.
    """
    previous: dict[int, signal._HANDLER] = {}
    try:
        previous.update(install_shutdown_handlers(loop, signals))
        yield
    finally:
        _restore(previous)


def install_shutdown_handlers(
    loop: _SupportsRequestShutdown, signals: Iterable[signal.Signals | int]
) -> dict[int, signal._HANDLER]:
    """:func:`shutdown_on_signals`' entry, checks and errors included (every handler left as
    it was if one fails), with no exit: the handlers stay. Returns the previous ones. For
    :class:`~enginecore.stage.StageRuntime`, which owns its process: when its loop ends it
    replaces them with ``SIG_IGN`` in one step each, where a restore would pass through the
    default action (``SIG_DFL``) and a stop signal landing in between (``kill`` sends
    several; so do supervisors) would end the teardown with -15."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("shutdown_on_signals() must be used in the main thread")
    if not callable(getattr(loop, "request_shutdown", None)):
        raise TypeError(
            f"shutdown_on_signals(): loop must have a request_shutdown() method "
            f"(an EngineCoreLoop), got {type(loop).__name__}"
        )
    if isinstance(signals, (int, str, bytes)) or not isinstance(signals, Iterable):
        raise TypeError(
            f"shutdown_on_signals(): signals must be an iterable of signals, such as "
            f"(signal.SIGTERM,), got {type(signals).__name__}"
        )
    wanted: list[int] = []
    for sig in signals:
        if isinstance(sig, bool) or not isinstance(sig, int):
            raise TypeError(
                f"shutdown_on_signals(): signals must hold signal numbers (signal.Signals "
                f"or int), got {type(sig).__name__} {sig!r:.50}"
            )
        if int(sig) not in wanted:
            wanted.append(int(sig))

    def handler(signum: int, frame: FrameType | None) -> None:
        loop.request_shutdown()

    previous: dict[int, signal._HANDLER] = {}
    try:
        for sig in wanted:
            try:
                previous[sig] = signal.signal(sig, handler)
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"shutdown_on_signals(): cannot handle signal {_name(sig)}: {exc}"
                ) from exc
    except BaseException:
        _restore(previous)
        raise
    return previous


def _restore(previous: dict[int, signal._HANDLER]) -> None:
    for sig, old in previous.items():
        # None means the old handler was installed from C; the default is the best we can do.
        signal.signal(sig, signal.SIG_DFL if old is None else old)
