"""The protocols that a user implements, :class:`Engine` and :class:`PipelinedEngine`, and
:class:`CountdownEngine`, the toy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from ._exceptions import RequestRejected

__all__ = ["CountdownEngine", "Engine", "PipelinedEngine"]

HandleT = TypeVar("HandleT")


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
        """Run an out-of-band call (*args* is one tuple). Raising affects only this call.

        Returning a :class:`concurrent.futures.Future` defers the answer: the loop does not
        wait for it, and answers the call once the future is done (``docs/contract.md``,
        rule 17). A coroutine or an :mod:`asyncio` future is not one: the call is answered
        with a :class:`TypeError`."""
        ...

    def step(self) -> Iterable[Any]:
        """Advance every live request once and return the outputs, in order.

        Optionally, an engine may also have ``stats() -> dict[str, float]`` (not part of
        the protocol's structural check): its own numbers, which the loop samples on its
        thread and merges into :meth:`~enginecore.EngineCoreLoop.statistics`
        (``docs/engines.md``)."""
        ...


@runtime_checkable
class PipelinedEngine(Protocol[HandleT]):
    """An engine whose step is split in two, so the loop can keep several steps in flight.

    :meth:`launch` schedules a step and starts it on the device *without waiting for it*,
    and returns a handle; :meth:`collect` waits for that step, post-processes it and returns
    its outputs. ``EngineCoreLoop(engine, emit, pipeline_depth=d)`` keeps at most *d*
    handles in flight and collects them in launch order, each exactly once; the rules are
    ``docs/contract.md``, rules 12-16. A pipelined engine is driven through ``launch`` and
    ``collect`` at every depth, 1 included (then back to back); a ``step`` method, if it has
    one, is not called.

    ``has_work``, ``add``, ``abort`` and ``utility`` are :class:`Engine`'s, with one more
    duty for ``abort``: **after abort(req_ids) returns, no collect returns outputs for those
    requests**, not even for a handle launched before the abort. The loop applies every
    queued message before each ``launch`` and each ``collect``; the engine drops the aborted
    requests' outputs from the steps still in flight. ``has_work()`` now says whether
    *another* step can be launched, with the steps in flight taken into account.

    Optional: ``cancel(handle) -> None``. If the engine has it, the loop calls it once for
    each handle it will never collect, after a fatal error (in launch order), so the engine
    can release what the step holds. It should not wait for the device; an exception from
    it is logged and the other handles are still cancelled.

    The handle is opaque to the loop: it only keeps it and passes it back. Single writer,
    as for :class:`Engine`: only the loop's thread calls these methods.
    """

    def has_work(self) -> bool:
        """Whether :meth:`launch` has anything to start now. Called often: keep it O(1)."""
        ...

    def add(self, req_id: str, data: Any) -> None:
        """Admit request *req_id*, as :meth:`Engine.add`."""
        ...

    def abort(self, req_ids: Sequence[str]) -> None:
        """Drop the requests *req_ids*; no later :meth:`collect` returns outputs for them."""
        ...

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        """Run an out-of-band call, as :meth:`Engine.utility` (a future defers it)."""
        ...

    def launch(self) -> HandleT:
        """Schedule the next step and start it without waiting for the device; return a
        handle for :meth:`collect`. Raising is fatal to the loop."""
        ...

    def collect(self, handle: HandleT) -> Iterable[Any]:
        """Wait for the step *handle*, post-process it and return its outputs, in order
        (the aborted requests' left out). Called once per handle, in launch order. Raising
        is fatal to the loop."""
        ...


class CountdownEngine:
    """A toy engine for tests, examples and benchmarks.

    ``add(rid, k)``: the request needs *k* more steps. Anything but a positive ``int``, or
    an id that is live in the engine, raises :class:`~enginecore.RequestRejected`: the
    pattern for data a client got wrong (in a stage it ends only that request).
    :meth:`step` decrements every live request and returns ``[(rid, remaining), ...]`` in
    insertion order; a request that reaches 0 is reported and removed. :meth:`abort` removes
    requests and ignores unknown ids. ``utility("div", (a, b))`` returns ``a / b``;
    ``utility("num_requests", ())`` returns the number of live requests. :meth:`stats`
    reports them to the loop's statistics.

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
        raise ValueError(
            f"CountdownEngine has no utility {name!r:.200}; known: 'div', 'num_requests'"
        )

    def stats(self) -> dict[str, float]:
        """The engine's own numbers (``docs/engines.md``): ``running``, the live requests,
        and ``remaining``, the steps they still need."""
        remaining = self._remaining
        return {"running": len(remaining), "remaining": sum(remaining.values())}

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
