"""Message throughput: producer thread -> loop -> no-op engine.

A producer thread puts N ``Add`` + ``Abort`` pairs (pre-built, the same objects on both
sides) on a ``queue.Queue`` as fast as ``put()`` goes. The consumer is a second thread that
was already idle, blocked in ``get()``. The clock runs from the producer's first ``put()`` to
the moment the consumer has handled the last message.

* enginecore: ``EngineCoreLoop.run()`` with an engine whose ``add``/``abort`` do nothing and
  whose ``has_work()`` is always false; the last ``abort`` stops the clock.
* baseline: the fastest raw consumer: blocking ``get()``, then a bulk drain of the snapshot
  under ``q.mutex`` (``list(q.queue); q.queue.clear()``), counting messages without looking
  at them.

Rounds are interleaved; the result is messages per second (2N messages per round).
Goal: enginecore >= 0.7x the raw rate in every round (the verdict is the lowest per-round
ratio). GC off in the timed runs (a core micro-benchmark: see ``_harness.no_gc`` for why).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from enginecore import Abort, Add, EngineCoreLoop

from ._harness import NoopEngine, Record, higher_is_better, interleave, main_single, no_gc, sink

NAME = "throughput"
GOAL = 0.7


def make_messages(pairs: int) -> list[Add | Abort]:
    msgs: list[Add | Abort] = []
    for i in range(pairs):
        rid = f"r{i}"
        msgs.append(Add(rid, 1))
        msgs.append(Abort([rid]))
    return msgs


class _NoopEngine(NoopEngine):
    """Never has work; counts aborts and stops the clock at the last one."""

    def __init__(self, aborts: int) -> None:
        self.left = aborts
        self.t_end = 0.0
        self.idle = threading.Event()
        self.seen_idle = False
        self.loop: EngineCoreLoop | None = None

    def has_work(self) -> bool:
        if not self.seen_idle:  # Event.set() costs a lock: only once
            self.seen_idle = True
            self.idle.set()
        return False

    def abort(self, req_ids: Sequence[str]) -> None:
        self.left -= 1
        if not self.left:
            self.t_end = time.perf_counter()
            assert self.loop is not None
            self.loop.request_shutdown()


def _produce(q: queue.Queue[Any], msgs: list[Add | Abort], start: threading.Event) -> float:
    put = q.put
    start.wait()
    t0 = time.perf_counter()
    for m in msgs:
        put(m)
    return t0


def _timed(
    q: queue.Queue[Any], msgs: list[Add | Abort], consumer: threading.Thread, ready: threading.Event
) -> float:
    """Start *consumer*, wait until it is idle, then produce from a thread; return t0."""
    start = threading.Event()
    t0_box: list[float] = []
    # Daemons: Ctrl-C before the start leaves the producer waiting for it and the consumer
    # blocked in get(), which must not keep the process from exiting.
    producer = threading.Thread(target=lambda: t0_box.append(_produce(q, msgs, start)), daemon=True)
    consumer.start()
    ready.wait()
    producer.start()
    time.sleep(0.01)  # let the consumer settle into get()
    start.set()
    producer.join()
    consumer.join()
    return t0_box[0]


def run_loop(msgs: list[Add | Abort]) -> float:
    """Messages per second through EngineCoreLoop."""
    engine = _NoopEngine(len(msgs) // 2)
    loop = EngineCoreLoop(engine, sink())
    engine.loop = loop
    with no_gc():
        t0 = _timed(
            loop.input_queue, msgs, threading.Thread(target=loop.run, daemon=True), engine.idle
        )
    assert engine.left == 0
    return len(msgs) / (engine.t_end - t0)


def run_raw(msgs: list[Add | Abort]) -> float:
    """Messages per second through the raw blocking-get + bulk-drain consumer."""
    q: queue.Queue[Any] = queue.Queue()
    total = len(msgs)
    ready = threading.Event()
    t_end: list[float] = []

    def consume() -> None:
        get = q.get
        pending = q.queue
        mutex = q.mutex
        n = 0
        ready.set()
        while n < total:
            get()
            n += 1
            if pending:
                with mutex:
                    batch = list(pending)
                    pending.clear()
                n += len(batch)
        t_end.append(time.perf_counter())

    with no_gc():
        t0 = _timed(q, msgs, threading.Thread(target=consume, daemon=True), ready)
    return total / (t_end[0] - t0)


def run(quick: bool) -> list[Record]:
    msgs = make_messages(20_000 if quick else 200_000)
    res = interleave(
        {"loop": lambda: run_loop(msgs), "raw": lambda: run_raw(msgs)},
        rounds=3 if quick else 7,
    )
    return [
        higher_is_better(
            f"throughput, {len(msgs) // 2} Add+Abort pairs",
            res["loop"],
            res["raw"],
            "msgs/s",
            GOAL,
        )
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
