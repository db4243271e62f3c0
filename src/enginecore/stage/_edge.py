"""What both sides of a pipeline's edge agree on: :data:`NOTHING`, and the kinds of the
items of a ``pipe`` message (``docs/wire.md`` section 8). Imports nothing, so that the
package's namespace can offer :data:`NOTHING` without loading the stage runtime."""

from __future__ import annotations

from typing import Final

__all__ = ["END", "FIRST", "MORE", "NOTHING", "ONLY"]

# The kind of one item of a ``pipe`` message: bit 0 "first input of the request", bit 1
# "end of its input". MORE and FIRST carry a payload, END carries nil, ONLY (first and end)
# one payload.
MORE: Final = 0
FIRST: Final = 1
END: Final = 2
ONLY: Final = 3


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
