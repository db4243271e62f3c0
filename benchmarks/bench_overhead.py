"""Loop overhead per iteration: what EngineCoreLoop adds around each ``engine.step()``.

The engine always has work, ``step()`` returns one (pre-built) output, and no message ever
arrives. enginecore runs ``EngineCoreLoop(engine, emit).run()`` in the main thread for N
iterations (the engine's N-th ``step()`` calls ``request_shutdown()``). The baseline is the
bare ``for _ in range(N): for o in step(): emit(o)`` over the very same engine and emit.
Both sides are timed with ``perf_counter`` around the whole run, interleaved, GC off (a core
micro-benchmark: see ``_harness.no_gc`` for why).

Goal: at most 0.5 µs per iteration over the bare loop, in every round: each round's two runs
are paired, and the verdict is the largest of the per-round differences (the note gives
their median).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from enginecore import EngineCoreLoop

from ._harness import NoopEngine, Record, main_single, no_gc, ratio, sink, spread

NAME = "overhead"
GOAL_US = 0.5


class _StepEngine(NoopEngine):
    """Always has work; each step returns the same one-output list and counts down."""

    def __init__(self, n: int, on_done: Callable[[], None]) -> None:
        self.left = n
        self.on_done = on_done
        self.outs = [("r0", 1)]

    def has_work(self) -> bool:
        return True

    def step(self) -> list[tuple[str, int]]:
        self.left -= 1
        if not self.left:
            self.on_done()
        return self.outs


def run_loop(n: int, cls: type[EngineCoreLoop] = EngineCoreLoop) -> float:
    """Seconds per iteration of ``cls(...).run()`` over *n* steps (*cls*: EngineCoreLoop, or
    a variant of it to compare, as ``bench_statistics`` does)."""
    engine = _StepEngine(n, lambda: None)
    loop = cls(engine, sink())
    engine.on_done = loop.request_shutdown
    with no_gc():
        t0 = time.perf_counter()
        loop.run()
        t1 = time.perf_counter()
    assert engine.left == 0
    return (t1 - t0) / n


def run_bare(n: int) -> float:
    """Seconds per iteration of the bare step/emit loop over *n* steps."""
    engine = _StepEngine(n, lambda: None)
    step = engine.step
    emit = sink()
    with no_gc():
        t0 = time.perf_counter()
        for _ in range(n):
            for o in step():
                emit(o)
        t1 = time.perf_counter()
    assert engine.left == 0
    return (t1 - t0) / n


def run(quick: bool) -> list[Record]:
    n = 50_000 if quick else 1_000_000
    rounds = 3 if quick else 9
    loop_s: list[float] = []
    bare_s: list[float] = []
    run_loop(n // 10)  # warm-up
    run_bare(n // 10)
    for i in range(rounds):
        if i % 2:
            bare_s.append(run_bare(n))
            loop_s.append(run_loop(n))
        else:
            loop_s.append(run_loop(n))
            bare_s.append(run_bare(n))
    # Pair each round's two runs: their difference is the overhead that round.
    per_round = tuple((a - b) * 1e6 for a, b in zip(loop_s, bare_s, strict=True))
    deltas = sorted(per_round)
    loop_us = sorted(x * 1e6 for x in loop_s)
    bare_us = sorted(x * 1e6 for x in bare_s)
    med = deltas[len(deltas) // 2]
    v, b = loop_us[len(loop_us) // 2], bare_us[len(bare_us) // 2]
    return [
        Record(
            name="loop overhead per iteration",
            value=v,
            unit="µs/iter",
            baseline=b,
            ratio=ratio(v, b),
            goal=f"<= baseline + {GOAL_US} µs",
            met=deltas[-1] <= GOAL_US,
            spread=spread(loop_us),
            baseline_spread=spread(bare_us),
            note=f"{med:+.3f} µs/iter over the bare loop, median of {len(deltas)} paired "
            "rounds; judged on the largest",
            per_round=per_round,
            per_round_unit="µs/iter over",
        )
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
