"""What the blocking and the asyncio client share besides the protocol: their read-only
properties, socket set-up and teardown, and the steps of a stubborn stage's shutdown."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from typing import Any, Generic, NoReturn, TypeVar

import zmq

from ._errors import StageStartupError
from ._launch import Launched
from ._session import ClientSession, StreamCore, output_address_for
from ._wire import WelcomeMsg

__all__ = [
    "ClientBase",
    "check_heartbeat",
    "close_sockets",
    "dealer_for",
    "escalate",
    "pull_for",
    "raise_startup_error",
    "send_parts",
]

logger = logging.getLogger("enginecore.stage")

S = TypeVar("S", bound=StreamCore)
W = TypeVar("W")
Sock = TypeVar("Sock", bound=zmq.Socket[Any])


class ClientBase(Generic[S, W]):
    """The part of a client that neither blocks nor awaits: its session and properties."""

    def __init__(
        self,
        address: str,
        welcome: WelcomeMsg,
        launched: Launched | None,
        heartbeat: tuple[float, float] | None,
        ordered_events: bool,
    ) -> None:
        self._launched = launched
        self._session: ClientSession[S, W] = ClientSession(
            pid=welcome.pid,
            address=address,
            launched=launched is not None,
            heartbeat=heartbeat,
            ordered_events=ordered_events,
            now=time.monotonic(),
        )

    @property
    def pid(self) -> int:
        """The stage process's pid (as the stage reported it). Never blocks."""
        pid = self._session.pid
        assert pid is not None
        return pid

    @property
    def address(self) -> str:
        """The stage's input address. Never blocks."""
        return self._session.address

    @property
    def exit_code(self) -> int | None:
        """A launched stage's exit code once it has exited (``-N``: signal ``N``), else
        ``None``; always ``None`` for a connected stage. Never blocks."""
        return None if self._launched is None else self._launched.reap()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` / :meth:`shutdown` has been called. Never blocks."""
        return self._session.closing


def check_heartbeat(interval: float, timeout: float) -> tuple[float, float]:
    """``connect()``'s heartbeat arguments, checked."""
    if interval <= 0 or timeout <= interval:
        raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
    return interval, timeout


def raise_startup_error(factory: str, exc: BaseException) -> NoReturn:
    """Raise what ``launch()`` raises when the handshake with a started stage failed."""
    if isinstance(exc, Exception) and not isinstance(exc, StageStartupError):
        raise StageStartupError(f"handshake with stage {factory!r} failed: {exc}") from exc
    raise exc


def dealer_for(ctx: zmq.Context[Sock], address: str) -> Sock:
    """The input socket, connected to *address*."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)  # sends never block; death is detected elsewhere
    dealer.connect(address)
    return dealer


def pull_for(ctx: zmq.Context[Sock], address: str, welcome: WelcomeMsg) -> Sock:
    """The output socket, connected where the welcome says."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(output_address_for(address, welcome.output))
    return pull


def close_sockets(ctx: zmq.Context[Any], *socks: zmq.Socket[Any] | None) -> None:
    """Close *socks* without lingering, then the context."""
    for sock in socks:
        if sock is not None:
            sock.close(linger=0)
    ctx.term()


def send_parts(sock: zmq.Socket[Any], parts: list[Any], flags: int) -> None:
    """Send one message, ``[body, *buffers]``; the buffers without a copy."""
    if len(parts) == 1:
        sock.send(parts[0], flags)
    else:
        sock.send_multipart(parts, flags, copy=False)


def escalate(pid: int | None) -> Iterator[tuple[signal.Signals, float | None]]:
    """The steps after a launched stage ignored ``shutdown``: each signal to send, and how
    long to wait for the exit after it (``None``: as long as it takes)."""
    logger.warning("enginecore: stage %s ignored shutdown; SIGTERM", pid)
    yield signal.SIGTERM, 1.0
    logger.warning("enginecore: stage %s ignored SIGTERM; SIGKILL", pid)
    yield signal.SIGKILL, None
