"""The cost of the loop's statistics: ``EngineCoreLoop`` against the same loop without them.

The baseline is :class:`_Bare`, an ``EngineCoreLoop`` whose ``_run`` and ``_apply`` are the
loop's own, as they were before statistics (commit c994c34), minus nothing else: same
drain, same dispatch, same emit. Both run in the main thread, interleaved, GC off (a core
micro-benchmark: see ``_harness.no_gc``).

* per iteration: the engine always has work and each ``step()`` returns one output, as in
  ``bench_overhead``; N iterations, the engine's N-th step requests shutdown.
* per message: N ``Add`` messages are queued before ``run()``; the loop drains them in one
  batch (each counted), the engine never has work, and the last ``add`` requests shutdown.

Goal: statistics cost at most 0.05 µs per loop iteration, and per applied message, in every
round (the verdict is the largest per-round difference). A round is ``BLOCKS`` pairs of short
runs, the two sides alternated (``_harness.paired_blocks``); its figure is the median of the
pairs' differences, so a pause of the machine (a neighbour's burst, a preemption) spoils one
pair, not the round, and a slow stretch covers both sides of a pair alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from enginecore import Add, EngineCoreLoop, PipelinedEngine
from enginecore._messages import Wakeup

from ._harness import (
    NoopEngine,
    PairedRound,
    Record,
    main_single,
    no_gc,
    paired_blocks,
    sink,
    spread,
)
from .bench_overhead import run_loop

NAME = "statistics"
GOAL_US = 0.05


class _Bare(EngineCoreLoop):
    """The loop without statistics: its step() loop and dispatch as of c994c34."""

    __slots__ = ()

    def _run(self) -> None:  # the step() loop only: the benchmark's engine is an Engine
        emit = self._emit
        if self._shutdown:
            emit(("shutdown",))
            return
        engine = self._engine
        assert not isinstance(engine, PipelinedEngine)
        has_work = engine.has_work
        step = engine.step
        apply = self._apply
        q = self.input_queue
        get = q.get
        pending = q.queue
        mutex = q.mutex
        while True:
            if pending:
                with mutex:
                    batch = list(pending)
                    pending.clear()
                apply(batch)
            if self._shutdown:
                break
            if has_work():
                for out in step():
                    emit(("output", out))
            else:
                apply((get(),))
        emit(("shutdown",))

    def _apply(self, batch: list[Any] | tuple[Any]) -> None:
        engine = self._engine
        for msg in batch:
            cls = msg.__class__
            if cls is Add:
                engine.add(msg.req_id, msg.data)
            elif cls is not Wakeup:
                self._apply_unusual(msg)


class _AddEngine(NoopEngine):
    """Never has work; the last add requests shutdown."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.on_done: Callable[[], None] = lambda: None

    def add(self, req_id: str, data: Any) -> None:
        self.left -= 1
        if not self.left:
            self.on_done()


def per_iteration(cls: type[EngineCoreLoop], n: int) -> float:
    """Seconds per step iteration: ``bench_overhead``'s loop, run by *cls*."""
    return run_loop(n, cls)


def per_message(cls: type[EngineCoreLoop], msgs: list[Add]) -> float:
    """Seconds per applied message, all drained in one batch."""
    engine = _AddEngine(len(msgs))
    loop = cls(engine, sink())
    engine.on_done = loop.request_shutdown
    loop.submit_many(msgs)
    with no_gc():
        t0 = time.perf_counter()
        loop.run()
        t1 = time.perf_counter()
    assert engine.left == 0
    return (t1 - t0) / len(msgs)


BLOCKS = 8
"""Pairs of runs per round, alternated (see the module's docstring)."""


def _record(
    name: str, unit: str, res: list[PairedRound], blocks: int, goal: float | None
) -> Record:
    a = [r.a for r in res]
    b = [r.b for r in res]
    per_round = tuple(r.diff * 1e6 for r in res)
    deltas = sorted(per_round)
    a_us = sorted(x * 1e6 for x in a)
    b_us = sorted(x * 1e6 for x in b)
    v, base = a_us[len(a_us) // 2], b_us[len(b_us) // 2]
    med = deltas[len(deltas) // 2]
    return Record(
        name=name,
        value=v,
        unit=unit,
        baseline=base,
        ratio=v / base if base else float("nan"),
        goal=f"<= baseline + {goal} µs" if goal is not None else "(reported)",
        met=deltas[-1] <= goal if goal is not None else True,
        spread=spread(a_us),
        baseline_spread=spread(b_us),
        note=f"{med * 1e3:+.1f} ns over the loop without statistics, median of "
        f"{len(deltas)} rounds, each the median of {blocks} alternated pairs of runs"
        + ("; judged on the largest" if goal is not None else ""),
        per_round=per_round,
        per_round_unit="µs over",
    )


def run(quick: bool) -> list[Record]:
    n = 50_000 if quick else 1_000_000  # per side and round, split over BLOCKS runs
    rounds = 3 if quick else 9
    blocks = 2 if quick else BLOCKS
    iterations = paired_blocks(
        lambda: per_iteration(EngineCoreLoop, n // blocks),
        lambda: per_iteration(_Bare, n // blocks),
        rounds,
        blocks,
    )
    msgs = [Add(f"r{i}", i) for i in range(n // 5 // blocks)]
    messages = paired_blocks(
        lambda: per_message(EngineCoreLoop, msgs),
        lambda: per_message(_Bare, msgs),
        rounds,
        blocks,
    )
    return [
        _record("statistics per loop iteration", "µs/iter", iterations, blocks, GOAL_US),
        _record("statistics per applied message", "µs/msg", messages, blocks, GOAL_US),
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
