"""Input messages and output events of the loop.

Messages go *into* :attr:`EngineCoreLoop.input_queue`; events come *out* through ``emit``.
Both are part of the public contract (see ``docs/contract.md``), so their shapes are exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

if TYPE_CHECKING:
    from ._loop import EngineCoreLoop

__all__ = [
    "Abort",
    "Add",
    "Control",
    "Event",
    "FatalEvent",
    "Message",
    "OutputEvent",
    "ShutdownEvent",
    "Utility",
    "UtilityEvent",
    "Wakeup",
]


@dataclass(frozen=True, slots=True)
class Add:
    """Add request *req_id* with *data* to the engine: ``engine.add(req_id, data)``."""

    req_id: str
    data: Any


_new_add = Add.__new__
_set_req_id = vars(Add)["req_id"].__set__  # the slot's member descriptor
_set_data = vars(Add)["data"].__set__


def make_add(req_id: str, data: Any) -> Add:
    """``Add(req_id, data)``, built in ~40 % of the time: a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__``, while the slots' own descriptors set the
    same fields directly. The same object, equal by value. For the stage's input thread,
    which builds one per request it receives; not exported."""
    add = _new_add(Add)
    _set_req_id(add, req_id)
    _set_data(add, data)
    return add


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort the requests *req_ids*: ``engine.abort(req_ids)``.

    Raises :class:`TypeError` if *req_ids* is a single ``str``: ``Abort("r1")`` would otherwise
    abort the requests ``"r"`` and ``"1"``. Pass ``Abort(["r1"])``. Also for anything that
    is not a collection, a one-shot iterator or generator included: an engine may iterate
    *req_ids* more than once, and the second pass would find nothing to abort.
    """

    req_ids: Sequence[str]

    def __post_init__(self) -> None:
        req_ids = self.req_ids
        if type(req_ids) is list or type(req_ids) is tuple:
            return
        if isinstance(req_ids, (str, bytes)):
            raise TypeError(
                f"Abort(req_ids) takes a sequence of request ids, not a single "
                f"{type(req_ids).__name__}; write Abort([{req_ids!r}])"
            )
        if isinstance(req_ids, Iterator) or not isinstance(req_ids, Iterable):
            raise TypeError(
                f"Abort(req_ids) takes a collection of request ids (a list), got "
                f"{type(req_ids).__name__}; write Abort(list(req_ids))"
            )


@dataclass(frozen=True, slots=True)
class Utility:
    """Call ``engine.utility(name, args)``; the result comes back as a ``"utility"`` event.

    *args* is passed to the engine as one tuple, never splatted. Raises :class:`TypeError` if
    it is not a tuple.
    """

    call_id: int
    name: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.args, tuple):
            raise TypeError(
                f"Utility(args) must be a tuple, got {type(self.args).__name__}; "
                f"write Utility(call_id, name, tuple(args))"
            )


_new_utility = Utility.__new__
_set_call_id = vars(Utility)["call_id"].__set__
_set_name = vars(Utility)["name"].__set__
_set_args = vars(Utility)["args"].__set__


def make_utility(call_id: int, name: str, args: tuple[Any, ...]) -> Utility:
    """``Utility(call_id, name, args)`` without ``__init__``/``__post_init__``, as
    :func:`make_add`: for a caller that knows *args* is a tuple (the stage's input side,
    once per call it receives). Not exported."""
    msg = _new_utility(Utility)
    _set_call_id(msg, call_id)
    _set_name(msg, name)
    _set_args(msg, args)
    return msg


@dataclass(frozen=True, slots=True)
class Wakeup:
    """Does nothing to the engine; wakes a loop that is blocked waiting for input."""


class Control:
    """A message that acts on the loop itself: the loop calls :meth:`apply` on its own
    thread, in queue order, like any other message (rule 18 in ``docs/contract.md``).

    For a runtime built around the loop (the stage's stop, drain deadline, session change
    and adds burst are controls) that needs an action ordered with the engine's input: it
    runs after everything queued before it, and before anything queued after it. The
    subclass decides what it does; it may call the engine, and it gets the loop, so it can
    :meth:`~EngineCoreLoop.request_shutdown` or :meth:`~EngineCoreLoop.submit` more work
    without anything patched in after construction.

    An exception from :meth:`apply` is fatal to the loop, like one from ``engine.add``
    (rule 8). Off the hot path: the loop checks for the four plain message types first.
    """

    __slots__ = ()

    def apply(self, engine: Any, loop: EngineCoreLoop) -> None:
        """Called once by the loop, on its thread, when it reaches this message: *engine*
        is the loop's engine, *loop* the loop. Must not block for long: no step runs
        meanwhile."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply()")


Message: TypeAlias = Add | Abort | Utility | Wakeup | Control
"""Anything the loop accepts from :attr:`EngineCoreLoop.input_queue`."""

# Events are plain tuples: cheap to build on the hot path, and equal to what the design card
# specifies. The aliases below exist for type checkers and readers.
OutputEvent: TypeAlias = tuple[Literal["output"], Any]
"""``("output", out)``: one element of what ``engine.step()`` returned."""
UtilityEvent: TypeAlias = tuple[Literal["utility"], int, Any, str | None]
"""``("utility", call_id, result, None)`` or ``("utility", call_id, None, repr(exc))``."""
ShutdownEvent: TypeAlias = tuple[Literal["shutdown"]]
"""``("shutdown",)``: the last event of a run that stopped because shutdown was requested."""
FatalEvent: TypeAlias = tuple[Literal["fatal"], str]
"""``("fatal", repr(exc))``: the last event of a run that an exception ended."""
Event: TypeAlias = OutputEvent | UtilityEvent | ShutdownEvent | FatalEvent
"""Anything the loop passes to ``emit``."""
