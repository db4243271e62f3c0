"""Shutdown latency: ``request_shutdown()`` on an idle loop -> ``run()`` has returned.

Each sample builds a fresh consumer thread, waits until it is idle (blocked in ``get()``),
sleeps a little more (randomised), then the main thread takes ``perf_counter_ns()`` and asks
it to stop. The consumer thread takes ``perf_counter_ns()`` as its last act.

* enginecore: ``EngineCoreLoop.run()`` with an engine that never has work; the stamp is
  taken right after ``run()`` returns (so it includes emitting ``("shutdown",)`` and telling
  the waker thread to quit); the trigger is ``loop.request_shutdown()``.
* baseline: the same raw wake: a thread blocked in ``q.get()``, woken by ``q.put(None)``,
  stamps when ``get()`` returns and exits.

Samples alternate side by side (A B B A ...); p50 and p99 over all samples of each side, the
``±`` is the half-range of the per-block percentiles. Goal: enginecore <= 1.3x raw in every
block (the verdict is the highest per-block ratio). GC off in the timed blocks (a core
micro-benchmark: see ``_harness.no_gc`` for why).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from enginecore import EngineCoreLoop

from ._harness import NoopEngine, Record, main_single, no_gc, sink
from .bench_wake_latency import latency_records

NAME = "shutdown_latency"
GOAL = 1.3


class _IdleEngine(NoopEngine):
    """Never has work; the first ``has_work()`` says the loop is about to block."""

    def __init__(self, idle: threading.Event) -> None:
        self.idle = idle

    def has_work(self) -> bool:
        self.idle.set()
        return False


def one_loop(rng: random.Random) -> float:
    idle = threading.Event()
    loop = EngineCoreLoop(_IdleEngine(idle), sink())
    end: list[int] = []

    def target() -> None:
        loop.run()
        end.append(time.perf_counter_ns())

    # A daemon, and stopped on the way out: Ctrl-C between samples must not leave the
    # process waiting at exit for a loop that nothing will stop.
    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        idle.wait()
        time.sleep(rng.uniform(0.0005, 0.0015))
        t0 = time.perf_counter_ns()
    finally:
        loop.request_shutdown()
        t.join()
    return (end[0] - t0) / 1e3


def one_raw(rng: random.Random) -> float:
    q: queue.Queue[Any] = queue.Queue()
    idle = threading.Event()
    end: list[int] = []

    def target() -> None:
        idle.set()
        q.get()
        end.append(time.perf_counter_ns())

    t = threading.Thread(target=target, daemon=True)  # as one_loop's
    t.start()
    try:
        idle.wait()
        time.sleep(rng.uniform(0.0005, 0.0015))
        t0 = time.perf_counter_ns()
    finally:
        q.put(None)
        t.join()
    return (end[0] - t0) / 1e3


def measure(samples: int, blocks: int) -> list[Record]:
    rng = random.Random(4321)
    sides: dict[str, Callable[[random.Random], float]] = {"loop": one_loop, "raw": one_raw}
    per_block: dict[str, list[list[float]]] = {n: [] for n in sides}
    for _ in range(10):  # warm-up
        for f in sides.values():
            f(rng)
    with no_gc():
        for i in range(blocks):
            for name in ("loop", "raw") if i % 2 == 0 else ("raw", "loop"):
                f = sides[name]
                per_block[name].append([f(rng) for _ in range(samples)])
    pooled = {n: [x for b in per_block[n] for x in b] for n in sides}
    return latency_records("shutdown latency", pooled, per_block, GOAL)


def run(quick: bool) -> list[Record]:
    return measure(*((50, 4) if quick else (250, 8)))


if __name__ == "__main__":
    main_single(run, __doc__)
