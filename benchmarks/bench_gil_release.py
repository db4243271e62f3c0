"""GIL-releasing engine: does message handling slow down steps that release the GIL?

``step()`` runs one NumPy matmul sized at start-up to take ~2 ms (OpenBLAS pinned to one
thread, so the matmul stands for an accelerator step and leaves the second core to the IO
thread, as on a GPU server) and returns one output.

* enginecore: ``EngineCoreLoop.run()`` in the main thread for N steps. 1,000 requests are
  queued before it starts; a feeder thread then keeps them in flight with a steady stream:
  every ~1 ms it puts 10 ``Add`` and 10 ``Abort`` (oldest first) messages.
* baseline: the same engine, prefilled with 1,000 requests, stepped by the bare
  ``for _ in range(N): for o in step(): emit(o)`` with no messages and no feeder.
* reference (in the note, no goal): the bare loop while the same feeder thread puts the same
  messages into a queue that nobody reads. The gap between it and the bare loop is what the
  feeder thread itself costs the steps, whatever consumes its messages.

Rounds interleave; result is steps per second. Goal: enginecore >= 0.9x bare in every round
(the verdict is the lowest per-round ratio). The GC is on, as users run.
Needs NumPy (``pip install -e '.[bench]'``); skipped with a message without it.
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from enginecore import Abort, Add, EngineCoreLoop

from ._harness import NoopEngine, Record, Skipped, higher_is_better, interleave, main_single, sink

NAME = "gil_release"
GOAL = 0.9
IN_FLIGHT = 1000
BURST = 10
STEP_MS = 2.0


def _import_numpy() -> Any:
    if "numpy" not in sys.modules:
        # Must be set before OpenBLAS loads; a no-op if the user already chose a value.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    try:
        import numpy
    except ImportError as exc:
        raise Skipped("needs numpy: pip install -e '.[bench]'") from exc
    return numpy


class _MatmulEngine(NoopEngine):
    def __init__(self, np: Any, n: int, steps: int) -> None:
        rng = np.random.default_rng(0)
        self.a = rng.random((n, n))
        self.b = rng.random((n, n))
        self.live: dict[str, Any] = {}
        self.left = steps
        self.loop: EngineCoreLoop | None = None

    def has_work(self) -> bool:
        return bool(self.live)

    def add(self, req_id: str, data: Any) -> None:
        self.live[req_id] = data

    def abort(self, req_ids: Sequence[str]) -> None:
        live = self.live
        for rid in req_ids:
            live.pop(rid, None)

    def step(self) -> list[Any]:
        c = self.a @ self.b  # releases the GIL for the whole matmul
        self.left -= 1
        if not self.left and self.loop is not None:
            self.loop.request_shutdown()
        return [c[0, 0]]


def calibrate(np: Any) -> int:
    """Matrix size whose matmul takes about STEP_MS on this machine right now."""
    n = 64
    while True:
        a = np.ones((n, n))
        a @ a
        t0 = time.perf_counter()
        for _ in range(5):
            a @ a
        ms = (time.perf_counter() - t0) / 5 * 1e3
        if ms >= STEP_MS or n >= 2048:
            return n
        # matmul is ~n^3: jump close to the target, then creep up.
        n = max(n + 8, min(int(n * (STEP_MS / ms) ** (1 / 3) * 0.98), n * 2))


def _feed(put: Any, done: threading.Event) -> None:
    oldest, nxt = 0, IN_FLIGHT
    while not done.is_set():
        for _ in range(BURST):
            put(Add(f"r{nxt}", None))
            put(Abort([f"r{oldest}"]))
            nxt += 1
            oldest += 1
        time.sleep(0.001)


def run_loop(np: Any, n: int, steps: int) -> float:
    engine = _MatmulEngine(np, n, steps)
    loop = EngineCoreLoop(engine, sink())
    engine.loop = loop
    q = loop.input_queue
    for i in range(IN_FLIGHT):
        q.put(Add(f"r{i}", None))
    done = threading.Event()
    feeder = threading.Thread(target=_feed, args=(q.put, done), name="bench-feeder", daemon=True)
    feeder.start()
    try:  # stopped however the loop ends (Ctrl-C in it included)
        t0 = time.perf_counter()
        loop.run()
        t1 = time.perf_counter()
    finally:
        done.set()
        feeder.join()
    assert engine.left == 0
    return steps / (t1 - t0)


def run_bare_with_feeder(np: Any, n: int, steps: int) -> float:
    """Reference: the bare loop while the same feeder fills a queue that nobody reads.

    This isolates what the feeder thread itself costs the steps (its CPU time and its turns
    holding the GIL, ``Queue.put`` included) from what the loop adds by applying the messages.
    """
    q: queue.Queue[Any] = queue.Queue()
    pending = q.queue

    def put(m: Any) -> None:
        q.put(m)
        if len(pending) > 4096:  # nobody reads it: keep it small
            pending.clear()

    done = threading.Event()
    feeder = threading.Thread(target=_feed, args=(put, done), name="bench-feeder", daemon=True)
    feeder.start()
    try:
        return run_bare(np, n, steps)
    finally:
        done.set()
        feeder.join()


def run_bare(np: Any, n: int, steps: int) -> float:
    engine = _MatmulEngine(np, n, steps)
    for i in range(IN_FLIGHT):
        engine.add(f"r{i}", None)
    step = engine.step
    emit = sink()
    t0 = time.perf_counter()
    for _ in range(steps):
        for o in step():
            emit(o)
    t1 = time.perf_counter()
    return steps / (t1 - t0)


def run(quick: bool) -> list[Record]:
    np = _import_numpy()
    n = calibrate(np)
    steps = 60 if quick else 200
    res = interleave(
        {
            "loop": lambda: run_loop(np, n, steps),
            "bare": lambda: run_bare(np, n, steps),
            "feeder": lambda: run_bare_with_feeder(np, n, steps),
        },
        rounds=2 if quick else 16,
    )
    ref = statistics.median(f / b for f, b in zip(res["feeder"], res["bare"], strict=True))
    return [
        higher_is_better(
            "GIL-releasing engine, steps/s",
            res["loop"],
            res["bare"],
            "steps/s",
            GOAL,
            note=f"{n}x{n} matmul per step; {IN_FLIGHT} in flight, "
            f"{BURST} Add+Abort pairs per ~1 ms; bare + the same feeder into an unread "
            f"queue: {statistics.median(res['feeder']):.0f} steps/s ({ref:.2f}x)",
        )
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
