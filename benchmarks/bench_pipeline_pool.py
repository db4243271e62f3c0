"""A replica pool as a pipeline stage (issue 20, ``docs/pipelines.md``, "Replica pools as
stages"): the same 3-stage device-bound job with its slow middle stage as one process and as
a pool of two.

The stages: a ``CountdownEngine`` (each request's ``OUTPUTS`` outputs, streamed on), a
``relay`` that sleeps ``STEP_S`` a step and takes at most ``BATCH`` requests a step (a
device with a batch size: its steps, not its CPU, bound it), and a fast last ``relay``. The
job: ``REQUESTS`` requests, ``add_many``, every stream read to its end; outputs/s. The
baseline is the same pipeline with the middle stage as one process (``replicas=1``); the
pool's side runs it as ``replicas=2``, rounds interleaved. A sleeping stage does not compete
for a CPU, so two replicas should double what the middle stage gets through. Goal: the pool
>= 1.6x the single stage, every round.

Second, **SIGKILL one replica of the middle pool under load**: a fresh pipeline per round
(``device`` at ``KILL_STEP_S`` a step → ``relay`` x 2 → ``relay``), ``SLOTS`` long requests
streaming, each read by a thread of its own; replica 0 of the middle stage is killed. Goal:
every request routed through it ends within 1 s with one ``PipelineStageDeadError`` naming
the stage and replica 0, none of the other replica's ends, and new requests then complete
(on replica 1).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import statistics
import threading
import time
from typing import Any

from ._harness import (
    Record,
    Skipped,
    gc_on,
    higher_is_better,
    interleave,
    main_single,
    spread,
)

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
GOAL = 1.6
REQUESTS = 400
OUTPUTS = 4
STEP_S = 0.010
BATCH = 8
DEVICE = "enginecore.stage.testing:device"
SLOTS = 16
KILL_STEP_S = 0.005
GOAL_KILL_S = 1.0

_ids = itertools.count()


def job(pipe: Any, n: int, k: int) -> float:
    """Outputs/s of *n* requests of *k* outputs through *pipe*."""
    tag = next(_ids)
    items = [(f"p{tag}-{i}", k) for i in range(n)]
    expected = list(range(k - 1, -1, -1))
    with gc_on():
        t0 = time.perf_counter()
        streams = pipe.add_many(items)
        got = [s.collect() for s in streams]
        t1 = time.perf_counter()
    assert all(g == expected for g in got), "wrong outputs"
    return n * k / (t1 - t0)


def pool_vs_one(rounds: int, n: int, k: int, step_s: float, batch: int) -> list[Record]:
    from enginecore.stage import Pipeline, PipelineStage

    def stages(replicas: int) -> list[PipelineStage]:
        return [
            PipelineStage(COUNTDOWN),
            PipelineStage(RELAY, {"step_s": step_s, "batch": batch}, replicas=replicas),
            PipelineStage(RELAY),
        ]

    with contextlib.ExitStack() as stack:
        one = stack.enter_context(Pipeline.launch(stages(1)))
        two = stack.enter_context(Pipeline.launch(stages(2)))
        res = interleave(
            {"two": lambda: job(two, n, k), "one": lambda: job(one, n, k)}, rounds=rounds
        )
    return [
        higher_is_better(
            "3-stage pipeline, slow middle stage as 2 replicas vs 1",
            res["two"],
            res["one"],
            "outputs/s",
            GOAL,
            note=(
                f"{n} requests x {k} outputs; middle stage: relay, {step_s * 1e3:g} ms a "
                f"step, at most {batch} requests a step; baseline: replicas=1; GC on"
            ),
        )
    ]


def _read(rid: str, stream: Any, ends: dict[str, tuple[float, BaseException | None]]) -> None:
    """Read *stream* to its end; note when it ended, and with what."""
    try:
        stream.collect(timeout=10)
        ends[rid] = (time.monotonic(), None)
    except BaseException as exc:  # the one terminal event, timed
        ends[rid] = (time.monotonic(), exc)


def kill_one(rounds: int) -> list[Record]:
    """A fresh pipeline per round; SIGKILL replica 0 of its middle pool under load."""
    from enginecore.stage import Pipeline, PipelineStage, PipelineStageDeadError

    worst: list[float] = []
    wrong = 0
    affected = 0
    for r in range(rounds):
        stages = [
            PipelineStage(DEVICE, {"step_s": KILL_STEP_S}, name="first"),
            PipelineStage(RELAY, name="mid", replicas=2),
            PipelineStage(RELAY, name="last"),
        ]
        with gc_on(), Pipeline.launch(stages, startup_timeout=120) as pipe:
            streams = {f"k{r}-{i}": pipe.add(f"k{r}-{i}", 10**6) for i in range(SLOTS)}
            for stream in streams.values():
                stream.get(timeout=30)
            on = {rid: (pipe._core.route(rid) or (0, -1))[1] for rid in streams}
            ends: dict[str, tuple[float, BaseException | None]] = {}
            threads = [
                threading.Thread(target=_read, args=(rid, stream, ends))
                for rid, stream in streams.items()
            ]
            for t in threads:
                t.start()
            killed_at = time.monotonic()
            os.kill(pipe.call_utility("mid", "pid", replica=0), signal.SIGKILL)
            mine = [rid for rid in streams if on[rid] == 0]
            affected += len(mine)
            deadline = time.monotonic() + 10
            while any(rid not in ends for rid in mine) and time.monotonic() < deadline:
                time.sleep(0.005)
            times = []
            for rid in mine:
                t_end, exc = ends.get(rid, (float("inf"), None))
                times.append(t_end - killed_at)
                if not (
                    isinstance(exc, PipelineStageDeadError)
                    and exc.stage == "mid"
                    and exc.replica == 0
                ):
                    wrong += 1
            worst.append(max(times, default=0.0))
            # The other replica's requests go on; a new request completes.
            wrong += sum(1 for rid in streams if on[rid] != 0 and rid in ends)
            if pipe.add(f"after{r}", 3).collect(timeout=10) != [2, 1, 0]:
                wrong += 1
            pipe.abort([rid for rid in streams if on[rid] != 0])
            for t in threads:
                t.join(10)
    return [
        Record(
            "pipeline SIGKILL 1 of 2 middle replicas: last affected request ended after",
            statistics.median(worst), "s", GOAL_KILL_S, statistics.median(worst) / GOAL_KILL_S,
            f"<= {GOAL_KILL_S:g} s, every round, none wrong", max(worst) <= GOAL_KILL_S
            and wrong == 0, spread(worst),
            note=(
                f"{rounds} rounds, {SLOTS} streaming requests each ({affected} in all on "
                f"the killed replica); requests that ended wrongly, or not at all, or on "
                f"the other replica, and new requests that failed: {wrong}. GC on"
            ),
            per_round=tuple(worst), per_round_unit="s",
        )
    ]  # fmt: skip


def run(quick: bool) -> list[Record]:
    try:
        import enginecore.stage  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    if quick:
        return [*pool_vs_one(2, 64, 2, 0.005, 4), *kill_one(1)]
    return [*pool_vs_one(6, REQUESTS, OUTPUTS, STEP_S, BATCH), *kill_one(3)]


if __name__ == "__main__":
    main_single(run, __doc__)
