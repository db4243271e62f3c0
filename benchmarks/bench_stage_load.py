"""Load reports: what they cost per output, and how old they are when a client reads one.

* cost per output: the stage's step handling (``_stage_engine._make_handle_outputs``: the
  engine's step, routing, the stale check, the hand-over of one ``outputs`` event to the
  output side) for a ``CountdownEngine`` with 256 live requests, with a load reporter
  (``load_interval`` 0.05 s, the default) and without, in this process, GC on. The output
  side is a sink (a list): what is measured is the loop thread's cost, which is where a
  report is made. A round is ``BLOCKS`` pairs of short runs, the two sides alternated
  (``_harness.paired_blocks``; each side's engine and handler kept from one run to the
  next); the median of the pairs' differences in seconds per output is the reports' cost
  that round, so that a pause of the machine spoils one pair, not the round.
  Goal: at most 0.02 µs per output in every round.
  (End to end, through two launched stages, the difference is far below the output
  stream's own round-to-round spread, ~0.2 µs per output on this machine.)
* age: a ``ScriptedEngine`` stage paced to one step every 5 ms, with ``load_interval``
  0.05 s; a reader samples ``client.load().age`` every ~7 ms while it steps (from the
  round's first report on: between rounds the stage is idle, and its last report ages).
  The baseline is what a user would do without load reports: a thread that polls a utility
  every 0.05 s and keeps its answer, aged from the moment the call was sent, read the same
  way in the same run (on another stage of the same pace). Goal: every report read is at
  most ``load_interval`` + one step (55 ms) old, in every round (judged on the oldest).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from enginecore.stage._outbox import Outbox

from ._harness import Record, Skipped, gc_on, main_single, paired_blocks, spread

NAME = "stage_load"
COST_GOAL_US = 0.02
REQUESTS = 256
INTERVAL = 0.05
STEP = 0.005

_rounds = count()


BLOCKS = 16
"""Pairs of runs per round of the cost measurement, alternated (see the module's docstring)."""


def handler_timer(reports: bool) -> Callable[[int], float]:
    """A timer of the stage's step handling, with or without a load reporter: called with
    a number of steps, it runs them and returns the seconds per output. Its engine keeps
    ``REQUESTS`` requests live that never finish, so every call does the same work."""
    from enginecore import CountdownEngine
    from enginecore._stats import StepTimer, _Counters
    from enginecore.stage._stage_engine import _Counts, _Drain, _make_handle_outputs, _Stale
    from enginecore.stage._statistics import LoadReporter

    engine = CountdownEngine()
    live: set[str] = set()
    for i in range(REQUESTS):
        engine.add(f"r{i}", 2**62)
        live.add(f"r{i}")
    posted: list[Any] = []

    class _Sink:  # the output side: keeps what it is handed
        def post_step(self, events: Any, weight: int, last: bool = False) -> None:
            posted.append(events)

        def prepare_outputs(self, rids: Any, fins: Any, payloads: Any) -> Any:
            raise AssertionError("flat payloads take the fast path")

    class _NoDrain:
        active = False

    reporter = None
    if reports:  # sampled as in a stage: through the loop's sampler
        reporter = LoadReporter(INTERVAL, live)
        reporter.sample = StepTimer(_Counters(), engine).sample_engine
    handle = _make_handle_outputs(
        engine,
        cast("Outbox", _Sink()),
        live,
        cast("_Drain", _NoDrain()),
        _Stale(),
        None,
        _Counts(),
        reporter,
    )
    step = engine.step

    def timed(steps: int) -> float:
        with gc_on():
            t0 = time.perf_counter()
            for _ in range(steps):
                handle(step)
                posted.clear()
            t1 = time.perf_counter()
        return (t1 - t0) / (steps * REQUESTS)

    return timed


def ages_of_reports(client: Any, seconds: float) -> list[float]:
    """``client.load().age`` sampled every ~7 ms while the stage steps for *seconds*."""
    steps = int(seconds / STEP)
    before = client.load()
    last_seq = 0 if before is None else before.seq  # an idle stage's last report: stale
    stream = client.add(f"age{next(_rounds)}", steps)
    ages: list[float] = []
    deadline = time.monotonic() + seconds * 0.9
    while time.monotonic() < deadline:
        load = client.load()
        if load is not None and load.seq > last_seq:  # this run's reports only
            ages.append(load.age)
        time.sleep(0.007)
    client.abort([stream.req_id])
    return ages


def ages_of_polls(client: Any, seconds: float) -> list[float]:
    """The baseline: a thread polls a utility every INTERVAL; its answer's age (from the
    moment the call was sent) is sampled every ~7 ms while the stage steps."""
    steps = int(seconds / STEP)
    stream = client.add(f"poll{next(_rounds)}", steps)
    latest: list[float] = []  # the send time of the newest answer
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            client.call_utility("echo", 1)
            latest[:] = [sent]
            stop.wait(INTERVAL)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    ages: list[float] = []
    deadline = time.monotonic() + seconds * 0.9
    while time.monotonic() < deadline:
        if latest:
            ages.append(time.monotonic() - latest[0])
        time.sleep(0.007)
    stop.set()
    poller.join()
    client.abort([stream.req_id])
    return ages


def run(quick: bool) -> list[Record]:
    try:
        from enginecore.stage import StageClient
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    steps, rounds, blocks = (200, 3, 2) if quick else (2000, 9, BLOCKS)
    with_r, without_r = handler_timer(True), handler_timer(False)
    res = paired_blocks(
        lambda: with_r(steps // blocks), lambda: without_r(steps // blocks), rounds, blocks
    )
    with_s = [r.a for r in res]
    without_s = [r.b for r in res]
    per_round = tuple(r.diff * 1e6 for r in res)
    deltas = sorted(per_round)
    on_us = sorted(x * 1e6 for x in with_s)
    off_us = sorted(x * 1e6 for x in without_s)
    cost = Record(
        name=f"load reports' cost per output, steps of {REQUESTS}",
        value=on_us[len(on_us) // 2],
        unit="µs/output",
        baseline=off_us[len(off_us) // 2],
        ratio=on_us[len(on_us) // 2] / off_us[len(off_us) // 2],
        goal=f"<= baseline + {COST_GOAL_US} µs",
        met=deltas[-1] <= COST_GOAL_US,
        spread=spread(on_us),
        baseline_spread=spread(off_us),
        note=f"{deltas[len(deltas) // 2] * 1e3:+.2f} ns per output with reports, median of "
        f"{len(deltas)} rounds of {steps} steps a side (the median of {blocks} alternated pairs "
        "of runs), in process; "
        "judged on the largest; GC on",
        per_round=per_round,
        per_round_unit="µs over",
    )

    seconds = 0.6 if quick else 2.0
    age_rounds = 2 if quick else 5
    scripted = "enginecore.stage.testing:scripted"
    with (
        StageClient.launch(scripted, load_interval=INTERVAL) as pushed,
        StageClient.launch(scripted) as polled,
    ):
        for client in (pushed, polled):
            client.call_utility("pace", STEP)
        report_max: list[float] = []
        poll_max: list[float] = []
        report_all: list[float] = []
        for i in range(age_rounds):
            sides = [("r", pushed), ("p", polled)]
            for kind, client in sides if i % 2 == 0 else sides[::-1]:
                if kind == "r":
                    ages = ages_of_reports(client, seconds)
                    report_all += ages
                    report_max.append(max(ages) * 1e3)
                else:
                    poll_max.append(max(ages_of_polls(client, seconds)) * 1e3)
    line = (INTERVAL + STEP) * 1e3
    report_all.sort()
    age = Record(
        name=f"load report age, a step every {STEP * 1e3:g} ms, interval {INTERVAL * 1e3:g} ms",
        value=sorted(report_max)[len(report_max) // 2],
        unit="ms (oldest read)",
        baseline=sorted(poll_max)[len(poll_max) // 2],
        ratio=sorted(report_max)[len(report_max) // 2] / sorted(poll_max)[len(poll_max) // 2],
        goal=f"<= {line:g} ms (interval + one step)",
        met=max(report_max) <= line,
        spread=spread(report_max),
        baseline_spread=spread(poll_max),
        note=f"median read {report_all[len(report_all) // 2] * 1e3:.1f} ms old; baseline: a "
        f"utility polled every {INTERVAL * 1e3:g} ms, aged from its send; judged on the oldest; "
        "GC on",
        per_round=tuple(report_max),
        per_round_unit="ms oldest",
    )
    return [cost, age]


if __name__ == "__main__":
    main_single(run, __doc__)
