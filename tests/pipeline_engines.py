"""A pipelined test engine that honours the PipelinedEngine contract exactly, with hooks.

Shared by ``test_pipeline.py`` and ``test_pipeline_model.py``. What is under test is the
loop's ordering, so the engine is deliberately simple and checks its own bookkeeping: a
handle collected or cancelled twice, or never launched, is an ``AssertionError`` in the
engine, which the loop reports as fatal and the tests see.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from enginecore import RequestRejected

Call = tuple[Any, ...]


class Boom(Exception):
    """The failure a test injects."""


class CountdownPipeline:
    """CountdownEngine's requests, stepped in two phases.

    ``add(rid, k)``: *k* steps (a positive int, and *rid* not live, else RequestRejected).
    ``launch()`` takes one step of every request with steps left to launch, in insertion
    order, and decides its outputs ``(rid, remaining)`` there, as a device would compute
    them; ``collect(handle)`` returns them, minus those of requests that are no longer live
    as they were at launch (aborted since, or aborted and added again: each add is a new
    generation). A request is live from its add until its last output is collected or it is
    aborted. ``has_work()``: some live request has a step left to launch, and ``throttled``
    is false (a test sets it to model an engine that cannot launch more yet).

    Utilities: ``div`` as CountdownEngine; ``future`` returns ``futures[args[0]]`` (a dict a
    test fills), the deferred-utility path.

    Hooks (``on_launch`` / ``on_collect``) run at the entry of the call, before anything
    else, with the handle number. ``fail_next`` (``"launch"``, ``"collect"`` or
    ``"has_work"``) makes the next such call raise :class:`Boom` (right after the hook).
    ``record_has_work`` adds each ``has_work()`` call and its answer to :attr:`calls`.
    """

    def __init__(self, *, record_has_work: bool = False) -> None:
        # rid -> [generation, steps left to launch, steps left to collect]
        self._live: dict[str, list[int]] = {}
        self._generation = 0
        self._to_launch = 0  # sum of the live requests' steps left to launch: O(1) has_work
        self._next_handle = 0
        self._outstanding: dict[int, list[tuple[str, int, int]]] = {}
        self.calls: list[Call] = []
        self.threads: set[int] = set()
        self.launched: list[int] = []
        self.collected: list[int] = []
        self.cancelled: list[int] = []
        self.max_in_flight = 0
        self.aborts_in_flight = 0  # aborts that dropped an output of a step in flight
        self.throttled = False
        self.record_has_work = record_has_work
        self.fail_next: str | None = None
        self.on_launch: Callable[[int], None] | None = None
        self.on_collect: Callable[[int], None] | None = None
        self.futures: dict[Any, Future[Any]] = {}

    # -- the Engine half --------------------------------------------------------------------

    def has_work(self) -> bool:
        self.threads.add(threading.get_ident())
        if self.fail_next == "has_work":
            self.fail_next = None
            raise Boom("has_work")
        answer = self._to_launch > 0 and not self.throttled
        if self.record_has_work:
            self.calls.append(("has_work", answer))
        return answer

    def add(self, req_id: str, data: Any) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("add", req_id, data))
        if isinstance(data, bool) or not isinstance(data, int) or data < 1:
            raise RequestRejected(f"need an int >= 1 (a step count), got {data!r:.100}")
        if req_id in self._live:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        self._generation += 1
        self._live[req_id] = [self._generation, data, data]
        self._to_launch += data

    def abort(self, req_ids: Sequence[str]) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("abort", tuple(req_ids)))
        for rid in req_ids:
            req = self._live.pop(rid, None)
            if req is not None:
                self._to_launch -= req[1]
                if any(out[0] == rid for outs in self._outstanding.values() for out in outs):
                    self.aborts_in_flight += 1

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        self.threads.add(threading.get_ident())
        self.calls.append(("utility", name, args))
        if name == "div":
            a, b = args
            return a / b
        if name == "future":
            return self.futures[args[0]]
        raise ValueError(f"no utility {name!r}")

    # -- the two phases -----------------------------------------------------------------------

    def launch(self) -> int:
        self.threads.add(threading.get_ident())
        handle = self._next_handle
        if self.on_launch is not None:
            self.on_launch(handle)
        self.calls.append(("launch", handle))
        if self.fail_next == "launch":
            self.fail_next = None
            raise Boom("launch")
        self._next_handle += 1
        outs = []
        for rid, req in self._live.items():
            if req[1]:
                req[1] -= 1
                self._to_launch -= 1
                outs.append((rid, req[0], req[1]))
        self._outstanding[handle] = outs
        self.launched.append(handle)
        self.max_in_flight = max(self.max_in_flight, len(self._outstanding))
        return handle

    def collect(self, handle: int) -> list[tuple[str, int]]:
        self.threads.add(threading.get_ident())
        if self.on_collect is not None:
            self.on_collect(handle)
        self.calls.append(("collect", handle))
        assert handle in self._outstanding, f"collect of handle {handle}: not in flight"
        outs = self._outstanding.pop(handle)
        self.collected.append(handle)
        if self.fail_next == "collect":
            self.fail_next = None
            raise Boom("collect")
        result = []
        for rid, generation, left in outs:
            req = self._live.get(rid)
            if req is None or req[0] != generation:
                continue  # aborted after this step was launched: the contract drops it
            result.append((rid, left))
            if not left:
                del self._live[rid]
        return result

    def cancel(self, handle: int) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("cancel", handle))
        assert handle in self._outstanding, f"cancel of handle {handle}: not in flight"
        del self._outstanding[handle]
        self.cancelled.append(handle)

    @property
    def in_flight(self) -> int:
        """Handles launched and neither collected nor cancelled."""
        return len(self._outstanding)


class NoCancelPipeline(CountdownPipeline):
    """The same engine without the optional ``cancel`` hook."""

    cancel = None  # type: ignore[assignment]
