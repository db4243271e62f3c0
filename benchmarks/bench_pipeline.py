"""Pipelined steps: what depth 2 gains over depth 1, and what the step() loop pays for it.

**Steps/s, depth 2 vs depth 1.** A PipelinedEngine stands in for a device-bound engine. Its
``launch()`` submits 2 ms of GIL-free work to a one-thread pool, the "device" (one stream:
steps run in launch order): ``time.sleep(0.002)``, which releases the GIL as a CUDA
synchronisation does. (A NumPy matmul would do the same on a bigger machine; on 2 cores it
competes for a core with the post-processing.) ``collect()`` waits for that step's future,
then spends 1 ms of Python post-processing, holding the GIL (a spin to a ``perf_counter``
deadline). At depth 1 a step costs 2 + 1 ms; at depth 2 the device runs step *n+1* while
the loop post-processes step *n*, so a step costs max(2, 1) ms: 1.5x at best. The same
engine runs N steps at depth 1 and at depth 2, interleaved over rounds; each side is timed
from ``run()`` to its return (the last collect shuts the loop down). Goal: >= 1.42x (0.95 of
the ideal 1.5x) in every round (the verdict is the lowest per-round ratio). GC off, as in
the overhead part below.

**Loop overhead per iteration, step() engine.** The step() path must not pay for
pipelining. As in ``bench_overhead``: an engine that always has work, whose ``step()``
returns one pre-built output, runs N iterations in the main thread; the N-th step calls
``request_shutdown()``. The baseline is the *previous* loop: ``_FrozenLoop`` below is
today's ``EngineCoreLoop`` with ``_run`` replaced by a verbatim copy of ``_run`` as it was
before pipelining (commit ``368d722``), so both sides share everything else and differ only
in the loop under test. Rounds alternate which side runs first; GC off (a core
micro-benchmark: see ``_harness.no_gc`` for why). Goal: every paired per-round difference
<= +0.05 µs (the verdict is the largest; the note gives their median). The note also gives
a PipelinedEngine at depth 1 (``launch()`` then ``collect()`` per step, two drains) over the
same rounds, for information.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from enginecore import EngineCoreLoop

from ._harness import NoopEngine, Record, higher_is_better, main_single, no_gc, sink, spread

NAME = "pipeline"
DEVICE_S = 0.002
POST_S = 0.001
MIN_SPEEDUP = 1.42
GOAL_US = 0.05


# -- steps/s: a device-bound engine at depth 1 and 2 ---------------------------------------------


class DeviceEngine(NoopEngine):
    """*n* steps, each 2 ms on a one-thread "device" and 1 ms of Python post-processing."""

    def __init__(self, n: int, device: ThreadPoolExecutor, on_done: Callable[[], None]) -> None:
        self.left = n  # steps not launched yet
        self.uncollected = n
        self.device = device
        self.on_done = on_done
        self.outs = [("r0", 1)]

    def has_work(self) -> bool:
        return self.left > 0

    def launch(self) -> Future[None]:
        self.left -= 1
        return self.device.submit(time.sleep, DEVICE_S)

    def collect(self, handle: Future[None]) -> list[tuple[str, int]]:
        handle.result()  # the GIL is released while the device runs
        deadline = time.perf_counter() + POST_S
        while time.perf_counter() < deadline:  # Python post-processing, GIL held
            pass
        self.uncollected -= 1
        if not self.uncollected:
            self.on_done()
        return self.outs


def run_device(depth: int, steps: int, device: ThreadPoolExecutor) -> float:
    """Steps per second of DeviceEngine over *steps* steps at *depth*."""
    engine = DeviceEngine(steps, device, lambda: None)
    loop = EngineCoreLoop(engine, sink(), pipeline_depth=depth)
    engine.on_done = loop.request_shutdown
    with no_gc():
        t0 = time.perf_counter()
        loop.run()
        t1 = time.perf_counter()
    assert engine.uncollected == 0
    return steps / (t1 - t0)


# -- overhead per iteration: the step() loop against the previous one ---------------------------


class _StepEngine(NoopEngine):
    """Always has work; each step returns the same one-output list and counts down."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.on_done: Callable[[], None] = lambda: None
        self.outs = [("r0", 1)]

    def has_work(self) -> bool:
        return True

    def step(self) -> list[tuple[str, int]]:
        self.left -= 1
        if not self.left:
            self.on_done()
        return self.outs


class _PipelinedStepEngine(_StepEngine):
    """The same work through launch()/collect(): for the depth-1 pipelined path."""

    def launch(self) -> None:
        return None

    def collect(self, handle: None) -> list[tuple[str, int]]:
        return self.step()


class _FrozenLoop(EngineCoreLoop):
    """EngineCoreLoop with the step() loop as it was before pipelining (``368d722``)."""

    # Verbatim, comments dropped; only the type: ignore is new (step is Engine-only now).
    def _run(self) -> None:
        emit = self._emit
        if self._shutdown:
            emit(("shutdown",))
            return
        engine = self._engine
        has_work = engine.has_work
        step = engine.step  # type: ignore[union-attr]
        apply = self._apply
        q = self.input_queue
        get = q.get
        pending = q.queue
        mutex = q.mutex
        try:
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
        except BaseException as exc:
            self._die(exc)
            if not isinstance(exc, Exception):
                raise
            return
        emit(("shutdown",))


def run_loop(
    n: int, loop_cls: type[EngineCoreLoop] = EngineCoreLoop, pipelined: bool = False
) -> float:
    """Seconds per iteration of *loop_cls*.run() over *n* steps (launch+collect if
    *pipelined*)."""
    engine: Any = _PipelinedStepEngine(n) if pipelined else _StepEngine(n)
    loop = loop_cls(engine, sink())
    engine.on_done = loop.request_shutdown
    with no_gc():
        t0 = time.perf_counter()
        loop.run()
        t1 = time.perf_counter()
    assert engine.left == 0
    return (t1 - t0) / n


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def overhead_record(n: int, rounds: int) -> Record:
    new_s: list[float] = []
    old_s: list[float] = []
    pipe_s: list[float] = []
    run_loop(n // 10)  # warm-up
    run_loop(n // 10, _FrozenLoop)
    run_loop(n // 10, pipelined=True)
    for i in range(rounds):
        if i % 2:
            old_s.append(run_loop(n, _FrozenLoop))
            new_s.append(run_loop(n))
        else:
            new_s.append(run_loop(n))
            old_s.append(run_loop(n, _FrozenLoop))
        pipe_s.append(run_loop(n, pipelined=True))
    per_round = tuple((a - b) * 1e6 for a, b in zip(new_s, old_s, strict=True))
    deltas = sorted(per_round)
    pipe_deltas = [(p - a) * 1e6 for p, a in zip(pipe_s, new_s, strict=True)]
    new_us = [x * 1e6 for x in new_s]
    old_us = [x * 1e6 for x in old_s]
    med = _median(deltas)
    v, b = _median(new_us), _median(old_us)
    return Record(
        name="step() loop overhead vs the pre-pipelining loop",
        value=v,
        unit="µs/iter",
        baseline=b,
        ratio=v / b,
        goal=f"<= baseline + {GOAL_US} µs",
        met=deltas[-1] <= GOAL_US,
        spread=spread(new_us),
        baseline_spread=spread(old_us),
        note=f"{med:+.3f} µs/iter, median of {len(deltas)} paired rounds; judged on the "
        f"largest; a PipelinedEngine at depth 1: {_median(pipe_deltas):+.3f} µs/iter over "
        "step()",
        per_round=per_round,
        per_round_unit="µs/iter over",
    )


def run(quick: bool) -> list[Record]:
    steps = 40 if quick else 400
    rounds = 3 if quick else 7
    d1: list[float] = []
    d2: list[float] = []
    with ThreadPoolExecutor(1, thread_name_prefix="device") as device:
        run_device(1, steps // 4, device)  # warm-up: the device thread, the code paths
        run_device(2, steps // 4, device)
        for i in range(rounds):
            order = (1, 2) if i % 2 == 0 else (2, 1)
            for depth in order:
                (d1 if depth == 1 else d2).append(run_device(depth, steps, device))
    ideal = 1 / max(DEVICE_S, POST_S) / (1 / (DEVICE_S + POST_S))
    pipelined = higher_is_better(
        "pipelined steps/s, depth 2 vs depth 1",
        d2,
        d1,
        "steps/s",
        MIN_SPEEDUP,
        note=f"2 ms device + 1 ms Python per step, {steps} steps a side; ideal {ideal:.2f}x",
    )
    n = 50_000 if quick else 1_000_000
    overhead = overhead_record(n, 3 if quick else 9)
    return [pipelined, overhead]


if __name__ == "__main__":
    main_single(run, __doc__)
