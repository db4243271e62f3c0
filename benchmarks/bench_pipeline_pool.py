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
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

from ._harness import Record, Skipped, gc_on, higher_is_better, interleave, main_single

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
GOAL = 1.6
REQUESTS = 400
OUTPUTS = 4
STEP_S = 0.010
BATCH = 8

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


def run(quick: bool) -> list[Record]:
    try:
        import enginecore.stage  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    if quick:
        return pool_vs_one(2, 64, 2, 0.005, 4)
    return pool_vs_one(6, REQUESTS, OUTPUTS, STEP_S, BATCH)


if __name__ == "__main__":
    main_single(run, __doc__)
