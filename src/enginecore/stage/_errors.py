"""The stage runtime's exceptions. All derive from :class:`enginecore.EngineCoreError`."""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING

from .._exceptions import EngineCoreError

if TYPE_CHECKING:
    from ._pool_core import Replica

__all__ = [
    "AuthenticationError",
    "EngineDeadError",
    "MessageTooLargeError",
    "NoReplicaError",
    "PipelineFullError",
    "PipelineRequestError",
    "PipelineStageDeadError",
    "ProtocolError",
    "ReplicaDeadError",
    "RequestError",
    "SessionLostError",
    "StageClosedError",
    "StageStartupError",
    "UtilityError",
    "describe_exit",
]


def describe_exit(exit_code: int | None) -> str:
    """``"exited with code 1"``, ``"was killed by SIGKILL"``, or ``"exit code unknown"``.

    *exit_code* follows :attr:`multiprocessing.Process.exitcode`: ``-N`` means signal ``N``.
    """
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"was killed by {name}"
    return f"exited with code {exit_code}"


class StageStartupError(EngineCoreError, RuntimeError):
    """Raised by ``StageClient.launch()`` / ``AsyncStageClient.launch()`` when the stage
    process could not start.

    Causes: the engine factory raised (:attr:`child_traceback` holds the child's formatted
    traceback, also included in the message), the child exited before it reported ready
    (:attr:`exit_code` says how), the child did not report ready within ``startup_timeout``
    seconds (it is then killed), or the protocol handshake failed. No process is left behind.
    """

    def __init__(
        self, message: str, *, child_traceback: str | None = None, exit_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.child_traceback = child_traceback
        """The child's formatted traceback when the factory raised, else ``None``."""
        self.exit_code = exit_code
        """The child's exit code (``-N`` for signal ``N``) if it exited, else ``None``."""


class EngineDeadError(EngineCoreError, RuntimeError):
    """Raised by every pending and later call of a stage client, and by every waiting
    iterator, when the stage is gone without this client having closed it.

    Causes: the stage process exited or was killed (its exit code or signal is in the
    message and in :attr:`exit_code`), the engine loop hit a fatal error (the remote
    ``repr`` is in :attr:`fatal`), the stage shut down at someone else's request, or a
    connected stage stopped answering heartbeats. The same error object is raised to every
    waiter; when a local exception caused it, that exception is its ``__cause__``.
    """

    def __init__(self, message: str, *, exit_code: int | None = None, fatal: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        """The stage process's exit code (``-N``: killed by signal ``N``); ``None`` if unknown
        (a connected stage, or a process that has not been reaped yet)."""
        self.fatal = fatal
        """The ``repr`` of the exception that ended the remote engine loop, if one was sent."""


class ReplicaDeadError(EngineDeadError):
    """Raised to a replica pool's requests and calls that were on a replica when it died
    (its process exited, its engine loop failed, or it stopped answering heartbeats). Only
    that replica's requests and calls fail; the pool's other replicas keep serving.

    :attr:`replica` names the replica (:class:`~enginecore.stage.Replica`) and
    :attr:`delivered` says how many outputs the request had delivered to its stream (all
    its attempts together) before the replica died: ``0`` for a utility call. The message
    is the replica's own :class:`EngineDeadError`'s, which is also the ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        replica: Replica,
        delivered: int = 0,
        exit_code: int | None = None,
        fatal: str | None = None,
    ) -> None:
        super().__init__(message, exit_code=exit_code, fatal=fatal)
        self.replica: Replica = replica
        """The replica that died."""
        self.delivered = delivered
        """How many outputs the request had delivered before the replica died."""


class SessionLostError(EngineDeadError):
    """Raised to every pending and later call of a client whose session a stage that serves
    several clients (``serve --max-clients``) ended by itself: the client's output
    connection was lost, it fell more than ``--client-buffer`` events behind, or it was
    silent past the session timeout. The stage aborted the client's requests and runs on;
    the message says why (the stage's ``reject`` reason, ``docs/wire.md`` section 3). A
    new client (``connect()`` again) may attach. A subclass of :class:`EngineDeadError`,
    so a replica pool treats it as that replica's death."""


class NoReplicaError(EngineCoreError, RuntimeError):
    """Raised by a replica pool's ``add()`` and ``call_utility()`` when no replica can take
    the work: every replica is dead, failed, stalled, draining or still starting."""


class StageClosedError(EngineCoreError, RuntimeError):
    """Raised by a stage client's methods, pending calls and waiting iterators when *this
    client* was closed (``close()``, ``shutdown()`` or leaving its ``with`` block).

    Distinct from :class:`EngineDeadError`: nothing went wrong, you closed it.
    """


# How much of a utility's name a UtilityError's message shows.
_NAME_SHOWN = 200


class UtilityError(EngineCoreError):
    """Raised by ``call_utility()`` when the engine's ``utility()`` raised in the stage.

    The remote exception cannot cross the wire as an object; :attr:`remote_repr` holds its
    ``repr`` (also the message). The stage keeps running.
    """

    def __init__(self, name: str, remote_repr: str) -> None:
        shown = repr(name)
        if len(shown) > _NAME_SHOWN:  # a name of any length crosses the wire
            shown = f"{shown[:_NAME_SHOWN]}... ({len(name)} characters)"
        super().__init__(f"utility {shown} failed in the stage: {remote_repr}")
        self.name = name
        """The utility's name (whole; the message cuts a long one)."""
        self.remote_repr = remote_repr
        """``repr()`` of the exception raised in the stage."""


class RequestError(EngineCoreError):
    """Raised by a request's output iterator when the stage reported an error for that
    request: its ``add`` frame could not be decoded or validated, or its id was live in the
    stage (the engine never saw it); the engine refused it with
    :class:`~enginecore.RequestRejected`, from ``add`` or as a routing payload (then
    :attr:`message` is the engine's own); or one of its outputs could not be encoded (the
    stage then aborts it in the engine).

    The request's stream ends with this error, and its id may be added again; the stage
    keeps serving other requests.
    """

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(f"request {req_id!r}: {message}")
        self.req_id = req_id
        """The request's id."""
        self.message = message
        """The stage's description of the problem."""


class MessageTooLargeError(EngineCoreError, ValueError):
    """Raised by a client's ``add()``, ``add_many()``, ``call_utility()`` and ``abort()``
    when a frame of the message would be larger than the stage takes (for ``add_many()`` and
    ``abort()``, which split a message over the bound into several frames: when one request,
    one array or one id alone is): the stage said its bound (``serve --max-message-bytes``)
    in its ``welcome``, and
    a bigger frame would cost the client its connection, and the message with it
    (``docs/security.md``). Nothing was sent or registered: the request ids are free, and
    the session goes on. A :class:`ValueError`: the input is too big for this stage.
    :attr:`size` is the frame's size, :attr:`limit` the stage's bound, in bytes."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        """The size of the largest frame of the refused message, in bytes."""
        self.limit = limit
        """The largest frame the stage takes, in bytes (its ``--max-message-bytes``)."""


class ProtocolError(EngineCoreError):
    """Raised by ``StageClient.connect()`` (and ``launch()``) when the handshake fails: the
    stage speaks another protocol version, rejected this client (another client is
    attached), or answered with something that is not a valid handshake reply.
    """


class AuthenticationError(ProtocolError):
    """Raised by ``connect()`` (the clients', and the pools' for a replica) when the CURVE
    handshake with the stage fails (``docs/security.md``): the stage refused this client's
    public key (it is not among its authorized clients), the stage closed the connection
    during the handshake (most likely a wrong server public key), or one side uses CURVE
    and the other does not. Raised as soon as the socket monitor says so, and at the latest
    when the connect timeout passes. A :class:`ProtocolError`, so code that catches that
    catches this too.
    """


class PipelineRequestError(RequestError):
    """Raised by a pipeline request's stream when one of the pipeline's stages reported an
    error for it (as :class:`RequestError` says for one stage, or its edge function failed).
    :attr:`stage` names that stage. The request is aborted in every other stage; the
    pipeline keeps serving."""

    def __init__(self, req_id: str, stage: str, message: str) -> None:
        super().__init__(req_id, f"stage {stage!r}: {message}")
        self.stage = stage
        """The name of the stage that reported the error."""


class PipelineStageDeadError(EngineDeadError):
    """Raised by every live request of a pipeline, and by every later ``add``, when one of
    its stages is gone (its process exited or was killed, or its engine loop failed).
    :attr:`stage` names the stage; the message is that stage's own
    :class:`EngineDeadError`'s, which is also the ``__cause__``. A pipeline with a dead stage
    serves no more requests: shut it down. In a stage that is a replica pool, :attr:`replica`
    names the replica: its death ends only the requests routed through it, and the pipeline
    goes on with the others, until the last one dies."""

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        exit_code: int | None = None,
        fatal: str | None = None,
        replica: int | None = None,
    ) -> None:
        where = f"stage {stage!r}" if replica is None else f"stage {stage!r}, replica {replica}"
        super().__init__(f"{where}: {message}", exit_code=exit_code, fatal=fatal)
        self.stage = stage
        """The name of the stage that died."""
        self.replica = replica
        """Which replica of that stage (a replica pool's, numbered from 0) died; ``None``
        for a stage of one process."""


class PipelineFullError(EngineCoreError, RuntimeError):
    """Raised by a pipeline's ``add()`` / ``add_many()`` when its admission budget
    (``max_in_flight`` requests) has no room: at once with ``wait=False``, or once
    ``timeout`` has passed. Nothing was sent."""


def positive_seconds(value: object, what: str) -> float:
    """*value*, an argument named *what*, checked as a finite number of seconds > 0:
    :class:`TypeError` for a non-number (a ``bool`` too), :class:`ValueError` for 0, a
    negative, NaN or an infinity. Both say ``"<what> must be a number of seconds > 0, got
    <value>"``. The one check of ``startup_timeout``, ``session_timeout`` and
    ``ping_interval``, made before anything starts."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds > 0, got {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
    return float(value)
