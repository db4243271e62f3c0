"""The engine of the stage soak (``benchmarks/soak_stage.py``), imported by the stage process
as ``benchmarks._soak_engine:soak_engine``.

A :class:`~enginecore.CountdownEngine` with two more kinds of request:

- ``["poison", k, j, kind]``: a countdown of *k* steps whose output number *j* (0-based,
  ``0 <= j < k``) carries a payload that cannot cross the wire, made by ``POISONS[kind]``
  (a ``set``, an ``object()``, a ``str`` with a lone surrogate, ``2**64``, ...). The stage
  must send outputs ``k-1 .. k-j`` and then one ``error`` for the request, and nothing after.
- ``["hold"]``: one output, the payload ``"held"``, in the next step, then nothing until it
  is aborted. It is live in the stage all along without keeping the loop busy: the anchor
  of the duplicate-id checks.

``utility("live")`` returns ``[countdowns, held, poisoned]``, what the engine holds.
Everything else that is not a positive ``int`` is refused with
:class:`~enginecore.RequestRejected`, like CountdownEngine does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from enginecore import CountdownEngine, RequestRejected

__all__ = [
    "POISONS",
    "REFUSED_BY_MSGSPEC",
    "DyingSoakEngine",
    "LosingEngine",
    "RunningAheadEngine",
    "SoakEngine",
    "soak_engine",
]


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


class _IntSubclass(int):
    """An ``int`` subclass: msgpack would silently send it as a plain ``int``."""


POISONS: Final[dict[str, Callable[[], Any]]] = {
    "set": lambda: {1, 2, 3},
    "frozenset": lambda: frozenset({1}),
    "object": object,
    "complex": lambda: 1 + 2j,
    "surrogate": lambda: "bad \ud800 text",
    "int_too_big": lambda: 2**64,
    "int_too_small": lambda: -(2**63) - 1,
    "int_subclass": lambda: _IntSubclass(5),
    "nested": lambda: [1, {"k": object()}],
    "float_key": lambda: {1.5: "x"},
    "tuple_key": lambda: {(1, 2): "x"},
    "too_deep": lambda: _deep(100),
}
"""What a poisoned output carries instead of its payload, by kind."""

REFUSED_BY_MSGSPEC: Final = ("surrogate", "int_too_big", "int_too_small")
"""The kinds that pass the stage's check on the loop thread (``check_encodable``) and that
msgspec refuses when it encodes them, on the output thread for a small step."""

try:  # numpy values the wire refuses, when numpy is there (it is optional)
    import numpy as np

    POISONS["np_object_array"] = lambda: np.array([object(), 1], dtype=object)
    POISONS["np_structured"] = lambda: np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])
    POISONS["np_datetime_scalar"] = lambda: np.datetime64("2024-01-01")
except ImportError:  # pragma: no cover - numpy is a dev dependency
    pass


class SoakEngine(CountdownEngine):
    """CountdownEngine plus poisoned and held requests (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # rid -> (the remaining count of the poisoned output, kind)
        self._poison: dict[str, tuple[int, str]] = {}
        self._held: dict[str, bool] = {}  # rid -> whether its one output was sent
        self._hold_new: list[str] = []

    def has_work(self) -> bool:
        return bool(self._remaining) or bool(self._hold_new)

    def add(self, req_id: str, data: Any) -> None:
        if type(data) is list and data and data[0] == "hold" and len(data) == 1:
            if req_id in self._held or req_id in self._remaining:
                raise RequestRejected(f"request {req_id!r} is already live in the engine")
            self._held[req_id] = False
            self._hold_new.append(req_id)
            return
        if type(data) is list and len(data) == 4 and data[0] == "poison":
            _, k, j, kind = data
            if not (type(k) is int and type(j) is int and 0 <= j < k and kind in POISONS):
                raise RequestRejected(f"bad poison request {data!r:.100}")
            if req_id in self._held:
                raise RequestRejected(f"request {req_id!r} is already live in the engine")
            super().add(req_id, k)
            self._poison[req_id] = (k - 1 - j, kind)
            return
        if req_id in self._held:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        super().add(req_id, data)

    def abort(self, req_ids: Sequence[str]) -> None:
        super().abort(req_ids)
        for rid in req_ids:
            self._poison.pop(rid, None)
            if self._held.pop(rid, None) is False:
                self._hold_new.remove(rid)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "live":  # what the engine holds: [countdowns, held, poisoned]
            return [len(self._remaining), len(self._held), len(self._poison)]
        return super().utility(name, args)

    def step(self) -> list[Any]:
        outputs: list[Any] = super().step()
        poison = self._poison
        if poison:
            for i, (rid, left) in enumerate(outputs):
                p = poison.get(rid)
                if p is not None and p[0] == left:
                    outputs[i] = (rid, left, POISONS[p[1]]())
                    del poison[rid]  # its request ends here, one way or the other
        if self._hold_new:
            for rid in self._hold_new:
                self._held[rid] = True
                outputs.append((rid, -1, "held"))
            self._hold_new = []
        return outputs

    @staticmethod
    def route_outputs(
        outputs: list[Any],
    ) -> tuple[list[str], list[bool], list[Any]]:
        """``(rid, left)`` is a countdown output; ``(rid, left, payload)`` one that carries
        *payload* (poisoned, or ``"held"`` with ``left == -1``)."""
        return (
            [o[0] for o in outputs],
            [o[1] == 0 for o in outputs],
            [o[1] if len(o) == 2 else o[2] for o in outputs],
        )


def soak_engine() -> SoakEngine:
    """Factory: a fresh :class:`SoakEngine`."""
    return SoakEngine()


class LosingEngine(CountdownEngine):
    """A faulty :class:`~enginecore.CountdownEngine`, for the soak's own tests: it takes a
    request whose id ends in ``"77"`` and never steps it (no output, no error: a lost
    request), and holds it to the end. The abort phase must report it lost."""

    def add(self, req_id: str, data: Any) -> None:
        if req_id.endswith("77"):
            self.lost = getattr(self, "lost", 0) + 1
            return
        super().add(req_id, data)


class RunningAheadEngine(CountdownEngine):
    """A :class:`~enginecore.CountdownEngine` that runs ahead, for the soak's own tests:
    each step takes every request ``AHEAD`` steps on at once (all their outputs in one
    batch), as a stage on a loaded machine runs far ahead of a client that reads an output
    and then aborts. A request of up to ``AHEAD`` steps has finished before the client
    reads its first output; the abort phase must still abort some after an output."""

    AHEAD = 64

    def step(self) -> list[tuple[str, int]]:
        outputs: list[tuple[str, int]] = []
        for _ in range(self.AHEAD):
            if not self._remaining:
                break
            outputs += super().step()
        return outputs


class DyingSoakEngine(SoakEngine):
    """A faulty :class:`SoakEngine`, for the soak's own tests: its step raises once it has
    taken ``DIE_AFTER`` adds (the engine loop dies, and the stage with it). The fuzz phase
    must report the death, and not what a barrier before it read."""

    DIE_AFTER = 1300

    def __init__(self) -> None:
        super().__init__()
        self.adds = 0

    def add(self, req_id: str, data: Any) -> None:
        self.adds += 1
        super().add(req_id, data)

    def step(self) -> list[Any]:
        if self.adds >= self.DIE_AFTER:
            raise RuntimeError(f"DyingSoakEngine: dies after {self.DIE_AFTER} adds")
        return super().step()
