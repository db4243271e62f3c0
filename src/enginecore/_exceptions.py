"""The exception tree. Every enginecore exception derives from :class:`EngineCoreError`."""

from __future__ import annotations

__all__ = ["EngineCoreError", "LoopAlreadyRunError", "LoopEndedError", "RequestRejected"]


class EngineCoreError(Exception):
    """Root of every exception that enginecore raises on purpose."""


class LoopAlreadyRunError(EngineCoreError, RuntimeError):
    """Raised by :meth:`EngineCoreLoop.run` when that loop has already been run.

    A loop is single-use, like :class:`threading.Thread`: its end state (shutdown or fatal) is
    final. Build a new loop to run again.
    """


class LoopEndedError(EngineCoreError, RuntimeError):
    """The loop has ended: the answer of a utility call it can no longer make, and what
    :meth:`EngineCoreLoop.submit` raises then.

    When :meth:`EngineCoreLoop.run` ends (shutdown or a fatal error) while a future returned
    by ``engine.utility`` is not done, or while a ``Utility`` message is still queued, the
    loop answers that call with ``("utility", call_id, None, repr(LoopEndedError(...)))``
    before its last event, so no caller waits forever for an answer that can no longer come
    (``docs/contract.md``, rule 17). After that, :meth:`EngineCoreLoop.submit` and
    :meth:`EngineCoreLoop.submit_many` raise it and queue nothing. A client that turns error
    answers back into exceptions may raise it too.
    """


class RequestRejected(EngineCoreError, ValueError):
    """Raised by an engine's ``add()`` when it refuses that one request (data it cannot
    use, an id it already has) and is itself fine: the engine and its other requests go on.

    Inside a stage (``enginecore.stage``, ``docs/stage.md``, "Rejecting a request"), the
    stage catches it around ``add()`` and ends that request only, with an ``error`` event
    carrying ``str(exc)``: the client's stream raises ``RequestError`` with that message.
    An instance is also a valid routing payload there: an output routed to *req_id* whose
    payload is a ``RequestRejected`` ends that request with its message.

    In a bare :class:`~enginecore.EngineCoreLoop` it is an exception from ``add()`` like any
    other, fatal to the loop (``docs/contract.md``, rule 8): the loop has no per-request
    error event. Catch it around your engine's ``add()`` if you want the stage's behaviour
    without a stage (``docs/engines.md``). A :class:`ValueError`, so code that caught
    the ``ValueError`` an engine raised before keeps working.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        """Why the request was refused; what the client sees."""


# -- for the runtime: not exported --------------------------------------------------------------


def describe(exc: object) -> str:
    """``repr(exc)`` for an event or an error message, or a stand-in naming its type if that
    raises.

    An engine's (or an edge's, or a factory's) exception may have a broken ``__repr__``: its
    utility call must still get its answer, the run its fatal event, the request its error
    (rules 7, 8). Any object: the loop's log line for a stray object on its queue uses it too
    (rule 5).
    """
    try:
        return repr(exc)
    except Exception as repr_exc:
        return (
            f"{type(exc).__qualname__}(<repr() raised {type(repr_exc).__qualname__}: "
            f"{str_or_nothing(repr_exc)}>)"
        )


def str_or_nothing(exc: BaseException) -> str:
    """``str(exc)``, or ``"?"`` if that raises."""
    try:
        return str(exc)
    except Exception:
        return "?"
