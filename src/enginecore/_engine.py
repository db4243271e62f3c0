"""The :class:`Engine` protocol that a user implements, and :class:`CountdownEngine`, the toy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from ._exceptions import RequestRejected

__all__ = ["CountdownEngine", "Engine"]


@runtime_checkable
class Engine(Protocol):
    """What :class:`~enginecore.EngineCoreLoop` drives.

    Only the loop's thread ever calls these methods (single writer), so an implementation needs
    no locks of its own. Exceptions from :meth:`has_work`, :meth:`add`, :meth:`abort` and
    :meth:`step` are fatal to the loop; an exception from :meth:`utility` is reported for that
    one call and the loop goes on. Inside a stage, :class:`~enginecore.RequestRejected` from
    :meth:`add` ends only that request (``docs/engines.md``, "Rejecting a request").
    """

    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do. Called often: keep it O(1)."""
        ...

    def add(self, req_id: str, data: Any) -> None:
        """Admit request *req_id*. Raising here is fatal to the loop; inside a stage,
        :class:`~enginecore.RequestRejected` refuses only this request."""
        ...

    def abort(self, req_ids: Sequence[str]) -> None:
        """Drop the requests *req_ids*; unknown ids should be ignored."""
        ...

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        """Run an out-of-band call (*args* is one tuple). Raising affects only this call."""
        ...

    def step(self) -> Iterable[Any]:
        """Advance every live request once and return the outputs, in order."""
        ...


class CountdownEngine:
    """A toy engine for tests, examples and benchmarks.

    ``add(rid, k)``: the request needs *k* more steps. Anything but a positive ``int``, or
    an id that is live in the engine, raises :class:`~enginecore.RequestRejected`: the
    pattern for data a client got wrong (in a stage it ends only that request).
    :meth:`step` decrements every live request and returns ``[(rid, remaining), ...]`` in
    insertion order; a request that reaches 0 is reported and removed. :meth:`abort` removes
    requests and ignores unknown ids. ``utility("div", (a, b))`` returns ``a / b``;
    ``utility("num_requests", ())`` returns the number of live requests.

    An output ``(rid, remaining)`` is the request's last one exactly when ``remaining == 0``;
    :meth:`is_finished` says so. :meth:`route_output` is the stage runtime's routing hook
    (``enginecore.stage``, see ``docs/stage.md``): it sends each output to its request's
    stream with the payload ``remaining`` and ends the stream on the last one.
    """

    def __init__(self) -> None:
        # Insertion-ordered: step() reports requests in the order they were added.
        self._remaining: dict[str, int] = {}

    def has_work(self) -> bool:
        return bool(self._remaining)

    def add(self, req_id: str, data: Any) -> None:
        if isinstance(data, bool) or not isinstance(data, int) or data < 1:
            raise RequestRejected(f"need an int >= 1 (a step count), got {data!r:.100}")
        if req_id in self._remaining:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        self._remaining[req_id] = data

    def abort(self, req_ids: Sequence[str]) -> None:
        remaining = self._remaining
        for rid in req_ids:
            remaining.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "div":
            a, b = args
            return a / b
        if name == "num_requests":
            return len(self._remaining)
        raise ValueError(f"CountdownEngine has no utility {name!r}; known: 'div', 'num_requests'")

    def step(self) -> list[tuple[str, int]]:
        outputs: list[tuple[str, int]] = []
        finished: list[str] = []
        remaining = self._remaining
        for rid, k in remaining.items():
            left = k - 1
            outputs.append((rid, left))
            if left:
                remaining[rid] = left
            else:
                finished.append(rid)
        for rid in finished:
            del remaining[rid]
        return outputs

    @staticmethod
    def is_finished(output: tuple[str, int]) -> bool:
        """Whether *output* is the last one of its request."""
        return output[1] == 0

    @staticmethod
    def route_outputs(
        outputs: list[tuple[str, int]],
    ) -> tuple[list[str], list[bool], list[int]]:
        """The stage runtime's batch routing hook: one step's outputs as three lists,
        ``(req_ids, finished, payloads)``. Same routing as :meth:`route_output`, without a
        Python call per output."""
        payloads = [left for _, left in outputs]
        return [rid for rid, _ in outputs], [left == 0 for left in payloads], payloads

    @staticmethod
    def route_output(output: tuple[str, int]) -> tuple[str, bool, int]:
        """The stage runtime's routing hook: ``(req_id, finished, payload)`` for *output*.

        The payload is the remaining step count, so a request's stream yields ``k-1, ..., 0``.
        """
        rid, left = output
        return rid, left == 0, left
