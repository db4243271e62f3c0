"""Wake latency: an idle loop, ``put(Add)`` from another thread -> ``engine.add`` entered.

The consumer thread is idle, blocked in ``input_queue.get()``. The main thread takes
``perf_counter_ns()`` and puts one message; the consumer takes ``perf_counter_ns()`` the
moment it has the message in hand and sets a ``threading.Event`` that the main thread waits
on. Between samples the main thread sleeps a little (randomised) so the consumer is back in
``get()`` for every sample.

* enginecore: ``EngineCoreLoop.run()``; the stamp is the first line of ``engine.add``. The
  engine never has work, so the loop goes straight back to ``get()``.
* baseline: a raw thread in ``while True: item = q.get(); stamp``: the physical floor.

Samples from both sides are taken in alternating blocks (A B B A ...), and the p50 and p99
are computed over all samples of each side; the ``±`` is the half-range of the per-block p50
(or p99). Goal: enginecore <= 1.3x raw at p50 and at p99, in every block: the ratio shown is
the median of the per-block ratios, and the verdict is the highest one. GC off in the timed
blocks (a core micro-benchmark: see ``_harness.no_gc`` for why).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from enginecore import Add, EngineCoreLoop

from ._harness import (
    NoopEngine,
    Record,
    lower_is_better,
    main_single,
    no_gc,
    percentile,
    ratio,
    sink,
)

NAME = "wake_latency"
GOAL = 1.3


class _StampEngine(NoopEngine):
    """Never has work; ``add`` stamps the time and signals the sampler."""

    def __init__(self, stamps: list[int], got: threading.Event) -> None:
        self.stamps = stamps
        self.got = got

    def add(self, req_id: str, data: Any) -> None:
        self.stamps.append(time.perf_counter_ns())
        self.got.set()


def _sample(
    q: queue.Queue[Any], got: threading.Event, stamps: list[int], n: int, rng: random.Random
) -> list[float]:
    """Put *n* messages, one at a time into an idle consumer; latencies in µs."""
    msg = Add("r", 1)
    sent: list[int] = []
    put = q.put
    clock = time.perf_counter_ns
    for _ in range(n):
        # Long enough for the consumer to be blocked in get() again, and jittered so the
        # samples do not lock into phase with anything periodic on the machine.
        time.sleep(rng.uniform(0.0005, 0.0015))
        got.clear()
        t0 = clock()
        put(msg)
        sent.append(t0)
        got.wait()
    assert len(stamps) >= n
    return [(b - a) / 1e3 for a, b in zip(sent, stamps[-n:], strict=True)]


class LoopSide:
    """A running EngineCoreLoop with a stamping engine; sample() measures, close() ends it."""

    def __init__(self) -> None:
        self.stamps: list[int] = []
        self.got = threading.Event()
        self.loop = EngineCoreLoop(_StampEngine(self.stamps, self.got), sink())
        self.thread = threading.Thread(target=self.loop.run, name="bench-loop", daemon=True)
        self.thread.start()

    def sample(self, n: int, rng: random.Random) -> list[float]:
        return _sample(self.loop.input_queue, self.got, self.stamps, n, rng)

    def close(self) -> None:
        self.loop.request_shutdown()
        self.thread.join()


class RawSide:
    """A raw thread blocked in ``q.get()``: the floor for waking a thread."""

    def __init__(self) -> None:
        self.stamps: list[int] = []
        self.got = threading.Event()
        self.q: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._consume, name="bench-raw", daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        get = self.q.get
        append = self.stamps.append
        clock = time.perf_counter_ns
        got = self.got
        while True:
            item = get()
            append(clock())
            if item is None:
                return
            got.set()

    def sample(self, n: int, rng: random.Random) -> list[float]:
        return _sample(self.q, self.got, self.stamps, n, rng)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


def measure(
    make_sides: dict[str, Callable[[], LoopSide | RawSide]], samples: int, blocks: int
) -> tuple[dict[str, list[float]], dict[str, list[list[float]]]]:
    """Interleave blocks of *samples* wake-ups per side; all samples and per-block samples."""
    rng = random.Random(1234)
    sides = {name: make() for name, make in make_sides.items()}
    names = list(sides)
    per_block: dict[str, list[list[float]]] = {n: [] for n in names}
    try:
        for side in sides.values():
            side.sample(20, rng)  # warm-up
        with no_gc():
            for i in range(blocks):
                for name in names if i % 2 == 0 else names[::-1]:
                    per_block[name].append(sides[name].sample(samples, rng))
    finally:
        for side in sides.values():
            side.close()
    pooled = {n: [x for block in per_block[n] for x in block] for n in names}
    return pooled, per_block


def latency_records(
    label: str,
    pooled: dict[str, list[float]],
    per_block: dict[str, list[list[float]]],
    goal: float,
) -> list[Record]:
    """p50 and p99 records: the pooled percentiles of each side, judged block by block.

    Block *i* of each side ran next to the other's, so the ratio of their percentiles is the
    per-round ratio; the goal is met only when every block's ratio is within it.
    """
    records = []
    for p in (50, 99):
        v = percentile(pooled["loop"], p)
        b = percentile(pooled["raw"], p)
        records.append(
            lower_is_better(
                f"{label} p{p}",
                [percentile(blk, p) for blk in per_block["loop"]],
                [percentile(blk, p) for blk in per_block["raw"]],
                "µs",
                goal,
                pooled=(v, b),
                note=f"{len(pooled['loop'])} samples per side, {len(per_block['loop'])} blocks; "
                f"pooled p{p} ratio {ratio(v, b):.2f}x",
            )
        )
    return records


def run(quick: bool) -> list[Record]:
    samples, blocks = (100, 4) if quick else (500, 8)
    pooled, per_block = measure({"loop": LoopSide, "raw": RawSide}, samples, blocks)
    return latency_records("wake latency", pooled, per_block, GOAL)


if __name__ == "__main__":
    main_single(run, __doc__)
