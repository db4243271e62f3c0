"""Idle CPU: what a running loop with nothing to do costs the process.

Each window, only one consumer exists in the process: either a running ``EngineCoreLoop``
whose engine has no work (plus its waker thread), or, as the baseline, a bare thread blocked
in ``queue.Queue.get()``. The main thread then sleeps for the window (5 s; 0.5 s with
``--quick``) and the process CPU time is read with ``time.process_time()`` around it. The
engine counts its ``has_work()`` calls inside the window. Windows alternate loop, bare, bare,
loop, ...

Goals: the loop costs at most 0.1 % of one core, and ``has_work()`` is called a bounded
number of times (here: at most once per window, never per tick; a blocked loop calls it 0).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from enginecore import EngineCoreLoop

from ._harness import NoopEngine, Record, interleave, main_single, sink

NAME = "idle_cpu"
GOAL_PCT = 0.1
GOAL_CALLS = 1


class _CountingIdleEngine(NoopEngine):
    def __init__(self) -> None:
        self.calls = 0
        self.idle = threading.Event()

    def has_work(self) -> bool:
        self.calls += 1
        self.idle.set()
        return False


def window_loop(seconds: float) -> tuple[float, int]:
    """(CPU seconds, has_work calls) of a process whose only consumer is an idle loop."""
    engine = _CountingIdleEngine()
    loop = EngineCoreLoop(engine, sink())
    # A daemon, and stopped on the way out: Ctrl-C in the window must not leave the process
    # waiting at exit for a loop that nothing will stop.
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    try:
        engine.idle.wait()
        time.sleep(0.05)  # let it settle into get()
        calls0 = engine.calls
        c0 = time.process_time()
        time.sleep(seconds)
        c1 = time.process_time()
        calls = engine.calls - calls0
    finally:
        loop.request_shutdown()
        t.join()
    return c1 - c0, calls


def window_bare(seconds: float) -> tuple[float, int]:
    """CPU seconds of a process whose only consumer is a thread blocked in ``get()``."""
    q: queue.Queue[Any] = queue.Queue()
    ready = threading.Event()

    def consume() -> None:
        ready.set()
        q.get()

    t = threading.Thread(target=consume, daemon=True)  # as window_loop's
    t.start()
    try:
        ready.wait()
        time.sleep(0.05)
        c0 = time.process_time()
        time.sleep(seconds)
        c1 = time.process_time()
    finally:
        q.put(None)
        t.join()
    return c1 - c0, 0


def run(quick: bool) -> list[Record]:
    seconds = 0.5 if quick else 5.0
    res = interleave(
        {"loop": lambda: window_loop(seconds), "bare": lambda: window_bare(seconds)},
        rounds=2,
        warmup=0,
    )
    per_window = tuple(c / seconds * 100 for c, _ in res["loop"])
    loop_pct = sorted(per_window)
    bare_pct = sorted(c / seconds * 100 for c, _ in res["bare"])
    calls = [n for _, n in res["loop"]]
    # Report the worst window of each side: an idle budget is a ceiling, not an average.
    v, b = loop_pct[-1], bare_pct[-1]
    return [
        Record(
            name=f"idle CPU, {seconds:g} s window",
            value=v,
            unit="% core",
            baseline=b,
            ratio=(v / b) if b else (float("inf") if v else 1.0),
            goal=f"<= {GOAL_PCT:g} % core",
            met=v <= GOAL_PCT,
            spread=(loop_pct[-1] - loop_pct[0]) / 2,
            baseline_spread=(bare_pct[-1] - bare_pct[0]) / 2,
            note="worst of 2 windows per side, judged on it; both are at the noise floor of "
            "process_time()",
            per_round=per_window,
            per_round_unit="% core",
        ),
        Record(
            name=f"has_work() calls in a {seconds:g} s idle window",
            value=float(max(calls)),
            unit="calls",
            baseline=0.0,
            ratio=float(max(calls)) if max(calls) else 1.0,
            goal=f"<= {GOAL_CALLS}",
            met=max(calls) <= GOAL_CALLS,
            note="baseline: a bare get() has no has_work(); ratio = calls; judged on the "
            "worst window",
            per_round=tuple(float(n) for n in calls),
            per_round_unit="calls",
        ),
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
