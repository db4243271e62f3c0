"""The stage soak (``benchmarks/soak_stage.py``) in its quick size: every expectation holds,
every kind of invalid input was exercised, and nothing is left behind (no child process,
no socket directory). Counts only, never a time. And the command lines of the soaks: a bad
option is a usage error before anything runs, and Ctrl-C stops a chaos soak at once."""

from __future__ import annotations

import asyncio
import collections
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
from benchmarks import soak_stage
from benchmarks._cli import run_main
from benchmarks._soak_abort import AbortConfig, run_abort
from benchmarks._soak_engine import REFUSED_BY_MSGSPEC
from benchmarks._soak_frames import BAD_HELLO, SCOPED_ADD, SCOPED_ADDS, SCOPED_CALL, UNSCOPED
from benchmarks._soak_report import PhaseReport


def failures(report: PhaseReport) -> str:
    return report.render() if not report.ok else ""


@pytest.mark.usefixtures("no_leftovers")
class TestSoak:
    def test_quick_soak_meets_every_expectation(self) -> None:
        fuzz, abort = soak_stage.run(soak_stage.QUICK_ADDS, soak_stage.QUICK_REQUESTS, handovers=2)
        assert fuzz.ok, failures(fuzz)
        assert abort.ok, failures(abort)
        c = fuzz.counts
        # Every kind of invalid input was sent, and each one ended as expected.
        for name in (*SCOPED_ADD, *SCOPED_CALL, *UNSCOPED, *BAD_HELLO):
            assert any(k.endswith(f" {name}") for k in c), name
        for name in SCOPED_ADDS:
            assert c[f"malformed adds {name}"], name
        assert c["session handovers"] == 2
        assert c["sent duplicate id (next session)"] == 4
        assert c["sent duplicate id (other peer, concurrently)"] > 0
        assert c["client refused unsendable data (TypeError)"] > 0
        assert c["ended as expected: unencodable output"] > 0
        assert c["ended as expected: valid"] > 0
        # Aborts landed at every point of a request's life.
        a = abort.counts
        assert a["aborted: abort sent right after the add"] > 0
        assert a["aborted: abort sent after an output"] > 0
        assert a["finished, not aborted"] > 0
        assert a["outputs checked"] > soak_stage.QUICK_REQUESTS
        # ... and the count matches the stage's own count of the outputs it sent.
        (sent,) = [c for c in abort.checks if c.expectation.startswith("every output the stage")]
        assert sent.ok, sent
        assert sent.measured == f"{a['outputs checked']:,} checked / {a['outputs checked']:,} sent"
        # The stage's own live set is checked, not only the engine's: a stage that kept an
        # aborted id (a per-request leak) passed a quick run, where RSS is not judged.
        for phase in (fuzz, abort):
            (held,) = [c for c in phase.checks if c.expectation.startswith("the stage holds")]
            assert held.ok, held
            assert held.measured == "0", held
            # The stage's fds and threads are sampled with its RSS, and printed.
            assert phase.handles, phase.name
            assert all(fds > 0 and threads > 0 for _, fds, threads in phase.handles)
            assert any(n.startswith("stage fds/threads") for n in phase.notes), phase.notes

    def test_refused_by_msgspec_ends_the_request(self) -> None:
        # Refused only when the output thread encodes them, after the loop has stepped the
        # request again: those later outputs must not follow the request's error.
        (fuzz,) = soak_stage.run(3000, 0, handovers=0, poisons=REFUSED_BY_MSGSPEC)
        assert fuzz.ok, failures(fuzz)

    def test_every_handover_asked_for_is_made(self) -> None:
        # 12 handovers in 300 adds: a batch of adds (up to 256) used to run past the points
        # where they were due, and the run made 2, silently.
        (fuzz,) = soak_stage.run(300, 0, handovers=12)
        assert fuzz.ok, failures(fuzz)
        assert fuzz.counts["session handovers"] == 12
        assert fuzz.counts["sent duplicate id (next session)"] == 24

    def test_cli_prints_a_table_and_exits_0(self, capsys: pytest.CaptureFixture[str]) -> None:
        argv = ["--adds", "1000", "--requests", "2000"]
        assert soak_stage.main(argv) == 0
        out = capsys.readouterr().out
        assert "## fuzz: 1,000 adds" in out
        assert "## abort: 2,000 requests" in out
        assert "| FAIL" not in out
        assert out.rstrip().splitlines()[-1].startswith("PASS")


@pytest.mark.usefixtures("no_leftovers")
def test_a_lost_request_fails_the_abort_phase_with_the_right_numbers() -> None:
    # The mutation: an engine that takes the ids ending in "77" and never steps them. The
    # phase must report them lost, count the aborts it actually sent (an abort planned
    # after an output that never comes is not sent: it used to be counted as sent, beside
    # "0 unanswered"), and say that it did not ask the engine or the stage what they hold.
    cfg = AbortConfig(
        requests=2000, seed=3, engine="benchmarks._soak_engine:LosingEngine", stall_s=2.0
    )
    report = run_abort(cfg)
    assert not report.ok
    checks = {c.expectation: c for c in report.checks}
    lost = checks["0 lost: every request finished with all its outputs, or got its aborted event"]
    assert not lost.ok
    n_lost = int(lost.measured.split()[0].replace(",", ""))
    assert 0 < n_lost <= sum(f"r{i}".endswith("77") for i in range(2000)), lost.measured
    answered = checks["every abort answered by 1 aborted event (in order), with that abort's ids"]
    match = re.fullmatch(
        r"([\d,]+) aborted / ([\d,]+) aborts sent \(([\d,]+) planned\); 0 unanswered",
        answered.measured,
    )
    assert match is not None, answered.measured
    aborted, sent, planned = (int(g.replace(",", "")) for g in match.groups())
    # Every abort sent was answered (the stage answers an abort of a lost id too); those
    # planned after an output of a lost request were never sent.
    assert aborted == sent < planned, answered.measured
    assert not answered.ok
    assert report.violations["stalled"] == 1
    for what in (
        "the engine holds nothing at the end",
        "the stage holds nothing at the end (its live requests)",
    ):
        assert checks[what].measured == "not asked: the phase ended early", checks[what]
        assert not checks[what].ok


@pytest.mark.usefixtures("no_leftovers")
def test_aborts_land_after_an_output_however_far_ahead_the_stage_runs() -> None:
    # On a loaded machine the client reads each output long after the stage sent it: by
    # then the request (32 steps at most) has finished, and the abort it draws after an
    # output lands on a finished request. The quick soak counted 0 "aborted: abort sent
    # after an output" now and then. Here the stage runs 64 steps ahead at every step,
    # so that every request of the soak's draw finishes before its abort.
    cfg = AbortConfig(requests=3000, engine="benchmarks._soak_engine:RunningAheadEngine")
    report = run_abort(cfg)
    assert report.ok, failures(report)
    a = report.counts
    assert a["aborted: finished before the abort applied"] > 0
    assert a["aborted: abort sent after an output"] >= 3, a  # r0, r1000, r2000


@pytest.mark.usefixtures("no_leftovers")
def test_ctrl_c_in_phase_2_still_shows_phase_1s_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each phase's table is printed as the phase ends: Ctrl-C in the abort phase (here,
    # as it starts) used to print only the header and "interrupted (Ctrl-C)".
    def interrupted(*args: object, **kwargs: object) -> PhaseReport:
        raise KeyboardInterrupt

    monkeypatch.setattr(soak_stage, "run_abort", interrupted)
    assert run_main(soak_stage.main, ["--adds", "300", "--requests", "1000"]) == 130
    captured = capsys.readouterr()
    assert "## fuzz: 300 adds, 30 % invalid: PASS" in captured.out
    assert captured.err.rstrip().endswith("interrupted (Ctrl-C)")


@pytest.mark.usefixtures("no_leftovers")
def test_ctrl_c_in_the_middle_of_phase_2_shows_its_counts_so_far(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C while the abort phase runs (here, at its client's 20th wait for events): the
    # report showed nothing of phase 2, however long it had run.
    from enginecore.stage import StageClient

    get_events = StageClient.get_events
    waits = [0]

    def interrupted(self: StageClient, timeout: float | None = None) -> Any:
        waits[0] += 1
        if waits[0] == 20:
            raise KeyboardInterrupt
        return get_events(self, timeout)

    monkeypatch.setattr(StageClient, "get_events", interrupted)
    assert run_main(soak_stage.main, ["--adds", "0", "--requests", "100000"]) == 130
    captured = capsys.readouterr()
    assert "## abort: 100,000 requests, 30% aborted: INTERRUPTED, no verdict" in captured.out
    counts = re.search(r"^counts: (.*)$", captured.out, re.MULTILINE)
    assert counts is not None, captured.out
    sent = re.search(r"sent ([0-9,]+)", counts[1])
    assert sent is not None, counts[1]
    assert int(sent[1].replace(",", "")) > 0, counts[1]
    assert "outputs checked" in counts[1], counts[1]
    assert captured.err.rstrip().endswith("interrupted (Ctrl-C)")


def test_a_duplicate_the_engine_refused_is_not_counted_as_refused_by_the_stage() -> None:
    # A duplicate id that reached the engine (its "already live in the engine" came back)
    # is a violation, and the duplicates row must not count it as refused by the stage: it
    # read "256 / 256" PASS with the stage's check removed, every refusal the engine's.
    from benchmarks import _soak_fuzz

    fuzz = object.__new__(_soak_fuzz._Fuzz)
    fuzz.r = report = PhaseReport("fuzz")
    fuzz.got, fuzz.expect, fuzz.ops = (collections.Counter() for _ in range(3))
    fuzz.engine_live, fuzz.stage_live = [0, 0, 0], 0
    anchor = _soak_fuzz._Req(_soak_fuzz.ANCHOR, "anchor (held until aborted)")
    anchor.dups_sent = 2
    fuzz.live = {"A1": anchor}
    report.counts["sent duplicate id (other peer, concurrently)"] = 2
    fuzz.on_error("A1", "add refused: this request id is live in the stage (...)")
    fuzz.on_error("A1", "request 'A1' is already live in the engine")
    assert anchor.dup_errors == 2  # both answered: the run goes on
    assert report.violations["a duplicate id refused by another check"] == 1
    _soak_fuzz._checks(report, fuzz, "", 0, "")
    (row,) = [c for c in report.checks if c.expectation.startswith("every duplicate id")]
    assert row.measured == "1 / 2", row
    assert not row.ok


@pytest.mark.usefixtures("no_leftovers")
def test_a_stage_death_fails_the_fuzz_phase_and_nothing_stale_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The mutation: an engine whose step raises after 1,300 adds, past the first of two
    # handovers. The phase reports the death, and says it did not ask what the engine
    # holds: it used to show what the handover's barrier had read before the death.
    from benchmarks import _soak_fuzz

    monkeypatch.setattr(_soak_fuzz, "FACTORY", "benchmarks._soak_engine:DyingSoakEngine")
    report = _soak_fuzz.run_fuzz(_soak_fuzz.FuzzConfig(adds=3000, handovers=2))
    checks = {c.expectation: c for c in report.checks}
    death = checks["0 stage deaths (alive to the end; exit code 0 after shutdown)"]
    assert not death.ok
    assert "dies after 1300 adds" in death.measured, death
    assert report.counts["session handovers"] >= 1, report.counts
    for what in (
        "the engine holds nothing at the end ([countdowns, held, poisoned])",
        "the stage holds nothing at the end (its live requests)",
    ):
        assert checks[what].measured == "not asked: the phase ended early", checks[what]


def test_a_violated_expectation_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = PhaseReport("fake")
    report.violation("an output after its aborted event", "r1")
    report.finish()

    def fake_run(*args: object, **kwargs: object) -> list[PhaseReport]:
        return [report]

    monkeypatch.setattr(soak_stage, "run", fake_run)
    assert soak_stage.main(["--quick"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION x1: an output after its aborted event" in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL")


def test_unknown_poison_kind_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        soak_stage.main(["--poison-kinds", "nope"])
    assert exc.value.code == 2


CHAOS_BAD = [
    (["--seconds", "-1"], "argument --seconds: must be finite and above 0"),
    (["--seconds", "0"], "argument --seconds: must be finite and above 0"),
    (["--seconds", "nan"], "argument --seconds: must be finite and above 0"),
    (["--seconds", "inf"], "argument --seconds: must be finite and above 0"),
    (["--seconds", "soon"], "argument --seconds: must be a number of seconds"),
    (["--freeze-share", "1.5"], "argument --freeze-share: must be from 0 to 1"),
    (["--freeze-share", "-0.1"], "argument --freeze-share: must be from 0 to 1"),
    (["--freeze-share", "nan"], "argument --freeze-share: must be from 0 to 1"),
    (["--concurrency", "0"], "argument --concurrency: must be 1 or more"),
    (["--ids", "0"], "argument --ids: must be 1 or more"),
    (["--deadline", "-5"], "argument --deadline: must be finite and above 0"),
    (["--kind", "threads"], "argument --kind: invalid choice: 'threads'"),
]
POOL_BAD = [
    (["--replicas", "0"], "argument --replicas: must be 1 or more"),
    (["--ray", "--heartbeat-timeout", "-1"], "argument --heartbeat-timeout: must be finite"),
    (["--heartbeat-timeout", "2"], "--heartbeat-timeout is for replicas on Ray: add --ray"),
]
STAGE_BAD = [
    (["--adds", "-1"], "argument --adds: must be 0 or more"),
    (["--requests", "-1"], "argument --requests: must be 0 or more"),
    (["--handovers", "-1"], "argument --handovers: must be 0 or more"),
    (["--adds", "0", "--requests", "0"], "--adds and --requests are both 0: nothing to run"),
    (["--poison-kinds", ","], "--poison-kinds names no kind"),
]


@pytest.mark.parametrize(
    ("tool", "argv", "says"),
    [
        *[("soak_pipeline", argv, says) for argv, says in CHAOS_BAD],
        *[("soak_pool", argv, says) for argv, says in [*CHAOS_BAD, *POOL_BAD]],
        *[("soak_stage", argv, says) for argv, says in STAGE_BAD],
    ],
)
def test_a_bad_option_is_a_usage_error_before_the_soak_runs(
    tool: str,
    argv: list[str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Not a soak that passes with nothing done, runs forever (inf), or fails at its end
    # with a traceback: exit 2 and one line that names the option, before anything runs.
    module = importlib.import_module(f"benchmarks.{tool}")

    def no_run(*args: object, **kwargs: object) -> object:
        raise AssertionError(f"{tool} {argv} ran")

    monkeypatch.setattr(module, "run", no_run)
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"python -m benchmarks.{tool}: error: "), err
    assert says in err.splitlines()[-1], err


def _stage_children(pid: int) -> list[int]:
    """The processes whose parent is *pid*."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "sig"),
    [
        (["benchmarks.soak_pool", "--kind", "sync", "--replicas", "1", "--no-membership"], "INT"),
        (["benchmarks.soak_pool", "--kind", "async", "--replicas", "1", "--no-membership"], "INT"),
        (["benchmarks.soak_pipeline", "--kind", "sync"], "INT"),
        (["benchmarks.soak_pipeline", "--kind", "async"], "TERM"),
    ],
    ids=["pool-sync", "pool-async", "pipeline-sync", "pipeline-async-sigterm"],
)
def test_ctrl_c_stops_a_chaos_soak_at_once_and_leaves_nothing(
    argv: list[str], sig: str, tmp_path: Path
) -> None:
    # Ctrl-C in a terminal, once the load runs: SIGINT to the whole process group. The soak
    # stops then (the blocking form used to run on to the end of --seconds), says so in one
    # line, exits 130, and leaves no stage process, socket file or shared-memory segment.
    # SIGTERM to the soak alone (`timeout`, a cancelled CI job) the same way, exit 143: it
    # used to end the soak at once and leave the stages' socket folders and segments.
    # Either way the soak prints what it counted so far.
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv, "--seconds", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    restarted = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.append(line)
            if "started again" in line:  # the load runs, and a killed stage is back
                restarted.set()

    reader = threading.Thread(target=read, args=(proc.stderr,), daemon=True)
    reader.start()
    try:
        while not restarted.wait(0.1):
            assert proc.poll() is None, "".join(lines)
        children = _stage_children(proc.pid)
        if sig == "INT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)  # not the 600 s of the run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
        proc.stderr.close()
        assert proc.stdout is not None
        out = proc.stdout.read()  # the soak writes its report at the end only: no deadlock
        proc.stdout.close()
    err = "".join(lines)
    # What the soak counted until then (it used to print nothing): requests ended, kills.
    assert "INTERRUPTED: the counts so far" in out, out
    assert re.search(r"ends: \{.*'finished': [1-9]", out), out
    assert re.search(r"kills: \{.+\}", out), out
    # Not the soak's own KeyboardInterrupt traceback (exit -2). (A stage process that the
    # SIGINT catches while it is being spawned, before it ignores SIGINT, may print one of
    # its own.)
    if sig == "INT":
        assert proc.returncode == 130, err
        assert err.rstrip().endswith("interrupted (Ctrl-C)"), err
    else:
        assert proc.returncode == 143, err
        assert err.rstrip().endswith("terminated (SIGTERM)"), err
    deadline = time.monotonic() + 10  # a process that exits with its parent: allow its exit
    while not all(map(_gone, children)):
        left = [(pid, _cmdline(pid)) for pid in children if not _gone(pid)]
        assert time.monotonic() < deadline, f"processes left: {left}"
        time.sleep(0.05)
    assert not [p for p in tmp_path.rglob("*")], list(tmp_path.rglob("*"))
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"enginecore-{proc.pid}-")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_stops_an_async_soak_by_its_main_task_alone(
    sig: signal.Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    # The signal landed wherever the event loop's thread was, mostly in another task or a
    # callback (a request's task, the pipeline's readers, a restart): its KeyboardInterrupt
    # left the loop from there, and asyncio.run cancelled every task at once, the pipeline's
    # own among them, while the soak's `finally` awaited `pipe.shutdown()`: a task left
    # pending printed "Task was destroyed but it is pending!" after the soak's last line
    # (test_ctrl_c_stops_a_chaos_soak_at_once_and_leaves_nothing[pipeline-async-sigterm],
    # now and then under load). Here the signal lands in another task, which the main
    # task's cleanup needs alive, as the shutdown needs the pipeline's tasks.
    from benchmarks._soak_chaos import Report, run_kind

    steps: list[str] = []

    async def soak(report: Report) -> None:
        stop, stopped = asyncio.Event(), asyncio.Event()

        async def worker() -> None:  # a task of the pipeline
            signal.raise_signal(sig)  # its handler runs here, in this task
            steps.append("worker ran on")
            await stop.wait()
            stopped.set()

        task = asyncio.create_task(worker())
        try:
            await asyncio.Event().wait()  # the load, until the signal ends it
        finally:
            stop.set()
            await asyncio.wait_for(stopped.wait(), 10)  # the shutdown, with its tasks alive
            steps.append("shut down")
            await task

    def main(argv: object) -> int:
        run_kind("async", lambda report: None, soak, children=False)
        return 0

    status = run_main(main, [])
    assert steps == ["worker ran on", "shut down"], steps
    assert status == (143 if sig == signal.SIGTERM else 130)
    assert capsys.readouterr().err.strip() == (
        "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    )


def _gone(pid: int) -> bool:
    """Whether *pid* no longer runs (absent, or a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@pytest.mark.usefixtures("no_leftovers")
def test_ctrl_c_while_the_serve_stage_starts_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Phase 1's `serve` process started, then Ctrl-C before it said where it listens (a
    # SIGINT to the soak alone, `kill -INT`): it was left running, with its socket folder.
    from benchmarks import _soak_fuzz

    class Interrupted(subprocess.Popen[str]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            assert self.stdout is not None
            self.stdout.readline = self.interrupt  # type: ignore[method-assign]

        def interrupt(self, *args: Any) -> str:
            raise KeyboardInterrupt

    started: list[Interrupted] = []

    def popen(*args: Any, **kwargs: Any) -> Interrupted:
        started.append(Interrupted(*args, **kwargs))
        return started[-1]

    fake = type("subprocess", (), {"Popen": staticmethod(popen), "PIPE": subprocess.PIPE})
    monkeypatch.setattr(_soak_fuzz, "subprocess", fake)
    with pytest.raises(KeyboardInterrupt):
        _soak_fuzz._Server()
    (proc,) = started
    assert proc.returncode is not None  # stopped and reaped (no_leftovers: no socket file)
