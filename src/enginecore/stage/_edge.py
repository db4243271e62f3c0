"""What both sides of a pipeline's edge agree on: :data:`NOTHING`, the kinds of the
items of a ``pipe`` message (``docs/wire.md`` section 8), and the link's routing id.
Imports nothing, so that the package's namespace can offer :data:`NOTHING` without loading
the stage runtime."""

from __future__ import annotations

from typing import Final

__all__ = [
    "BEFORE",
    "END",
    "ENDED",
    "FIRST",
    "LINKS_UTILITY",
    "MORE",
    "NOTHING",
    "ONLY",
    "REPORT",
    "SENT_ON",
    "link_generation",
    "link_id",
    "link_token",
    "slot_token",
]

# The kind of one item of a ``pipe`` message: bit 0 "first input of the request", bit 1
# "end of its input". MORE and FIRST carry a payload, END carries nil, ONLY (first and end)
# one payload.
MORE: Final = 0
FIRST: Final = 1
END: Final = 2
ONLY: Final = 3
# Bit 3 of an END or ONLY item: a stage before the receiver ended the request before its
# own input had ended, so the receiver reports its own end to the coordinator (and sends
# the bit on with its own END), whether or not it sent payloads on.
REPORT: Final = 8

# A stage's report of a request's end to the coordinator: an output with finished=True,
# its payload an int of these bits. A stage that ended a request and sent payloads on, its
# input complete, reports nothing: its END tells the next stage, which reports for both.
ENDED: Final = 1
"""This stage ended the request."""
SENT_ON: Final = 2
"""It sent payloads of it on to the next stage (whose end is then still to come)."""
BEFORE: Final = 4
"""Every stage before this one ended it and sent it on (this stage's input is complete)."""


LINKS_UTILITY: Final = "enginecore.pipe_links"
"""The pipeline's own utility of every stage (``PipeStage.utility``): per link to the next
stage, whether it is up. The coordinator calls it after a ``link``, to know the stage's loop
applied it (it applies messages in order)."""


def link_id(index: int, generation: int = 0, replica: int | None = None) -> str:
    """The routing id of the link from stage *index* of a pipeline to the next stage, which
    the coordinator names when it tells the next stage that this one is gone (``gone``).
    *generation* counts the starts of that stage's process (0: the first), so that a
    ``gone`` would name only the dead one's link. *replica*: which replica of a stage that
    is a replica pool (``-r<replica>`` added; ``None`` for a stage of one process)."""
    if replica is not None:
        return f"pipe-link-{index}.{generation}-r{replica}"
    return f"pipe-link-{index}.{generation}"


def slot_token(replica: int, generation: int = 0) -> str:
    """How a process of a pipeline's stage is named in the shared-memory slots of an edge
    into or out of a replica pool, or of a stage that restarts (:func:`._shm.link_prefix`):
    its replica index, with ``.<generation>`` added once it was restarted, so that a new
    process's slots never take a dead one's names (which the parent unlinks)."""
    return str(replica) if not generation else f"{replica}.{generation}"


def link_token(link: str) -> str | None:
    """The :func:`slot_token` of the process whose link has the routing id *link*
    (:func:`link_id`), or ``None`` for a link without a replica (a stage of one process
    that is not restarted: its slots are the stage's)."""
    head, sep, replica = link.rpartition("-r")
    if not sep or not replica.isdigit():
        return None
    generation = head.rpartition(".")[2]
    return slot_token(int(replica), int(generation) if generation.isdigit() else 0)


def link_generation(link: str) -> int:
    """The generation of the process whose link has the routing id *link*
    (:func:`link_id`): how many times it was started before; ``0`` for a link without a
    replica (a stage of one process that is not restarted), or one that is not a link's."""
    token = link_token(link)
    if token is None:
        return 0
    generation = token.partition(".")[2]
    return int(generation) if generation else 0


class _Nothing:
    """The type of :data:`NOTHING`: one instance per process."""

    __slots__ = ()
    _instance: _Nothing | None = None

    def __new__(cls) -> _Nothing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOTHING"

    def __bool__(self) -> bool:
        return False


NOTHING: Final = _Nothing()
"""What an edge function returns for the side that gets nothing of an output:
``return NOTHING, text`` sends *text* to the caller only, ``return hidden, NOTHING`` sends
*hidden* to the next stage only."""
