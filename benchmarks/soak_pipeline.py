"""Soak a pipeline whose stages restart, under SIGKILLs, aborts and reused request ids: no
request may hang, end twice, lose or duplicate an output, or leave anything behind. Not a
timed benchmark: every expectation is a count, and the script exits 1 if one does not hold.

Usage (from the repository root)::

    python -m benchmarks.soak_pipeline                 # 60 s
    python -m benchmarks.soak_pipeline --seconds 12    # as tests/stage/test_soak_chaos.py
    python -m benchmarks.soak_pipeline --seconds 300 --seed 7 --kind sync

The pipeline: ``CountdownEngine`` (one process), a ``relay`` pool of two, a ``relay`` of one
process, each stage restarted when it dies (``RestartPolicy(first_delay=0.05)``, no limit on
deaths). Requests of 1 to 40 outputs arrive while ``--concurrency`` are in flight, their ids
drawn from a small set (``--ids``), so that an id is added again soon after it was freed,
while its last aborts may still be on their way (the race the tagged aborts close). 20 % are
aborted after a random number of outputs (0: at once, before any is read). A killer sends
SIGKILL to a random live process every 0.2 to 1.2 s; the chaos stops 5 s before the end (half
the run if shorter), then every process must be up again and serve a last wave of requests.

Every request must end within ``--deadline`` seconds of its add, and end one way:

- finished: exactly its outputs ``n-1, ..., 0``, in order;
- aborted (only one the soak aborted), or failed with ``PipelineStageDeadError`` (only if a
  process was killed during its life or at most ``KILL_SEEN_S`` before its add): the
  outputs before, a prefix of those;
- refused at ``add`` with ``NoReplicaError`` (a stage restarting) or ``ValueError`` (its id
  still held by the pipeline: its aborts are on their way): counted, and the id drawn again
  later.

At the end: the pipeline holds no request, no stage holds one, every process is up, and
after the shutdown no process the soak saw is left.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ._cli import RawHelp, run_main
from ._soak_chaos import (
    ChaosConfig,
    Report,
    Rules,
    chaos_threads,
    drive_async,
    drive_sync,
    run_kind,
    wave_async,
    wave_sync,
)

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
FLAKY = "enginecore.stage.testing:flaky"
T = TypeVar("T")
RULES = Rules(held="is still in the pipeline", errors=("on purpose",))
"""An id is refused while the pipeline holds it; the ``wide`` topology's flaky stage fails
requests on purpose, and a failure that outlasts the retries reaches the caller."""


@dataclass
class Config(ChaosConfig):
    topology: str = "basic"


def _stages(topology: str) -> list[Any]:
    """The pipeline: ``basic``, three stages (the middle one a pool of two); ``wide``, four
    (two pools of two), the first edge ``Retry(2)`` into a stage that fails each request id's
    first attempt in each of its processes (its first output an error)."""
    from enginecore.stage import PipelineStage, RestartPolicy, Retry

    policy = RestartPolicy(first_delay=0.05, max_delay=0.2, max_failures=10**6)
    if topology == "basic":
        return [
            PipelineStage(COUNTDOWN, name="first", restart=policy),
            PipelineStage(RELAY, {"step_s": 0.002}, name="mid", replicas=2, restart=policy),
            PipelineStage(RELAY, {"step_s": 0.001}, name="last", restart=policy),
        ]
    if topology == "wide":
        return [
            PipelineStage(COUNTDOWN, name="first", restart=policy, on_next_error=Retry(2)),
            PipelineStage(
                FLAKY,
                {"when": "first", "step_s": 0.001},
                name="mid",
                replicas=2,
                restart=policy,
            ),
            PipelineStage(RELAY, {"step_s": 0.002}, name="mid2", replicas=2, restart=policy),
            PipelineStage(RELAY, {"step_s": 0.001}, name="last", restart=policy),
        ]
    raise ValueError(f"topology must be 'basic' or 'wide', got {topology!r}")


class _View(Protocol):
    """What the last phase (:func:`_settle`) asks of either pipeline, blocking."""

    def health(self) -> dict[str, str]: ...
    def run_wave(self, n: int, timeout: float) -> list[list[Any] | Exception]: ...
    def in_flight(self) -> int: ...
    def held(self, stage: str) -> Any: ...
    def restarts(self) -> dict[str, int]: ...
    def note_pids(self) -> None: ...
    def stages(self) -> tuple[str, ...]: ...


def _settle(view: _View, cfg: Config, report: Report) -> None:
    """After the chaos: every process up again (within the deadline), a last wave served,
    nothing held."""
    until = time.monotonic() + cfg.deadline
    while time.monotonic() < until and set(view.health().values()) != {"ok"}:
        time.sleep(0.05)
    if set(view.health().values()) != {"ok"}:
        report.problem(f"not every process up again: {view.health()}")
    for got in view.run_wave(16, cfg.deadline):
        if isinstance(got, Exception):
            report.problem(f"last wave: {type(got).__name__}: {got}")
        report.last_wave += got == [4, 3, 2, 1, 0]
    until = time.monotonic() + 10
    while view.in_flight() and time.monotonic() < until:
        time.sleep(0.05)
    if view.in_flight():
        report.problem(f"the pipeline still holds {view.in_flight()} requests")
    for name in view.stages():
        try:
            held = view.held(name)
        except Exception as exc:
            report.problem(f"stage {name}: num_requests raised {exc!r}")
            continue
        if (sum(held) if isinstance(held, list) else held) != 0:
            report.problem(f"stage {name} still holds requests: {held!r}")
    report.restarts = view.restarts()
    view.note_pids()


def _targets(pipe: Any, report: Report) -> list[tuple[str, int]]:
    """The processes of *pipe* that are up: (key as in ``health()``, pid), each noted in
    ``report.pids``."""
    health = pipe.health()
    out = []
    for name in pipe.stages:
        replicas = sum(1 for key in health if key == name or key.startswith(f"{name}["))
        for r in range(replicas):
            key = name if replicas == 1 else f"{name}[{r}]"
            if health[key] == "ok":
                out.append((key, pipe.client(name, r).pid))
    report.pids.update(pid for _, pid in out)
    return out


def _run_sync(cfg: Config, report: Report) -> None:
    from enginecore.stage import Pipeline, PipelineStageDeadError

    with Pipeline.launch(_stages(cfg.topology), startup_timeout=60) as pipe:
        load = cfg.load()  # the seconds count once the pipeline serves, its launch aside
        stop = threading.Event()
        chaos = chaos_threads(
            stop,
            report,
            load.end_at - cfg.quiet,
            cfg.seed,
            lambda: _targets(pipe, report),
            cfg.freeze_share,
        )
        for t in chaos:
            t.start()
        try:
            drive_sync(pipe, load, report, RULES, PipelineStageDeadError, lambda r: _where(pipe, r))
        finally:  # Ctrl-C too: the killer thaws what it froze, and stops
            stop.set()
        for t in chaos:
            t.join(5)

        class View:
            def health(self) -> dict[str, str]:
                return dict(pipe.health())

            def run_wave(self, n: int, timeout: float) -> list[list[Any] | Exception]:
                return wave_sync(pipe, n, timeout)

            def in_flight(self) -> int:
                return pipe.in_flight

            def held(self, stage: str) -> Any:
                return pipe.call_utility(stage, "num_requests", timeout=10)

            def restarts(self) -> dict[str, int]:
                return dict(pipe.restarts)

            def note_pids(self) -> None:
                _targets(pipe, report)

            def stages(self) -> tuple[str, ...]:
                return tuple(pipe.stages)

        _settle(View(), cfg, report)


async def _run_async(cfg: Config, report: Report) -> None:
    from enginecore.stage import AsyncPipeline, PipelineStageDeadError

    loop = asyncio.get_running_loop()
    pipe = await AsyncPipeline.launch(_stages(cfg.topology), startup_timeout=60)
    load = cfg.load()  # the seconds count once the pipeline serves, its launch aside

    def on_loop(coro: Coroutine[Any, Any, T]) -> T:  # from another thread
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def read(fn: Callable[[], T]) -> T:
        return fn()

    try:
        stop = threading.Event()
        chaos = chaos_threads(
            stop,
            report,
            load.end_at - cfg.quiet,
            cfg.seed,
            lambda: on_loop(read(lambda: _targets(pipe, report))),
            cfg.freeze_share,
        )
        for t in chaos:
            t.start()
        try:
            await drive_async(
                pipe, load, report, RULES, PipelineStageDeadError, lambda r: _where(pipe, r)
            )
        finally:  # Ctrl-C too: the killer thaws what it froze, and stops
            stop.set()
        for t in chaos:
            await asyncio.to_thread(t.join, 5)

        async def held(stage: str) -> Any:
            return await pipe.call_utility(stage, "num_requests", timeout=10)

        class View:
            def health(self) -> dict[str, str]:
                return on_loop(read(lambda: dict(pipe.health())))

            def run_wave(self, n: int, timeout: float) -> list[list[Any] | Exception]:
                return on_loop(wave_async(pipe, n, timeout))

            def in_flight(self) -> int:
                return on_loop(read(lambda: pipe.in_flight))

            def held(self, stage: str) -> Any:
                return on_loop(held(stage))

            def restarts(self) -> dict[str, int]:
                return on_loop(read(lambda: dict(pipe.restarts)))

            def note_pids(self) -> None:
                on_loop(read(lambda: _targets(pipe, report)))

            def stages(self) -> tuple[str, ...]:
                return tuple(pipe.stages)

        await asyncio.to_thread(_settle, View(), cfg, report)
    finally:
        await pipe.shutdown()


def _where(pipe: Any, rid: str) -> str:
    """What the coordinator says of a request that hung."""
    core = pipe._core
    return f"state {core.state(rid)!r}, route {core.route(rid)!r}"


def run(cfg: Config, report: Report | None = None) -> Report:
    """Run the soak; its report (*report*, filled as it goes, if given)."""
    return run_kind(
        cfg.kind,
        lambda report: _run_sync(cfg, report),
        lambda report: _run_async(cfg, report),
        report=report,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak_pipeline",
        description="\n\n".join(__doc__.split("\n\n")[:3]).replace("::", ":"),
        formatter_class=RawHelp,
    )
    ChaosConfig.arguments(parser)
    parser.add_argument(
        "--topology",
        choices=("basic", "wide"),
        default=Config.topology,
        help="basic: three stages, the middle one a pool of two; wide: four stages, two "
        "pools, a Retry(2) edge into a stage that fails each id's first attempt (default "
        f"{Config.topology})",
    )
    args = parser.parse_args(argv)
    cfg = Config(**ChaosConfig.settings(args), topology=args.topology)
    t0 = time.monotonic()
    report = Report()

    def title() -> str:
        took = time.monotonic() - t0
        return f"soak_pipeline: {took:.1f} s, {cfg.kind}, {cfg.topology}, seed {cfg.seed}"

    return report.finish(lambda: run(cfg, report), title, chaos=True)


if __name__ == "__main__":
    sys.exit(run_main(main))
