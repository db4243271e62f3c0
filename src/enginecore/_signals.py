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

    Must be entered in the main thread (a :class:`ValueError` from :func:`signal.signal`
    otherwise, re-raised with a clearer message). Repeated signals are harmless:
    ``request_shutdown()`` is idempotent.
    """
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("shutdown_on_signals() must be used in the main thread")

    def handler(signum: int, frame: FrameType | None) -> None:
        loop.request_shutdown()

    previous: dict[int, signal.Handlers | int | signal._HANDLER] = {}
    try:
        for sig in signals:
            previous[int(sig)] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            # None means the old handler was installed from C; the default is the best we can do.
            signal.signal(sig, signal.SIG_DFL if old is None else old)
