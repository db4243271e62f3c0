"""The examples run as documented and exit 0 by themselves. (The docs' code blocks, the
README's included, are run by tests/test_docs.py.)"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _run(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=60, check=False
    )


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def _descendants(pid: int) -> list[int]:
    """Every live process under *pid*, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR of the example's own, short enough for its stages' ipc socket paths."""
    path = Path(tempfile.mkdtemp(prefix="ex-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class TestCommandLine:
    """Every example says what it does on --help, and refuses what it does not know,
    without starting anything."""

    @staticmethod
    def _run(name: str, option: str) -> subprocess.CompletedProcess[str]:
        if name == "ray_pool.py":
            pytest.importorskip("ray", reason="the ray extra is not installed")
        return subprocess.run(
            [sys.executable, str(ROOT / "examples" / name), option],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    @pytest.mark.parametrize("name", EXAMPLES)
    def test_help_describes_the_example_and_runs_nothing(self, name: str) -> None:
        proc = self._run(name, "--help")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: "), proc.stdout[:300]
        assert proc.stderr == ""

    @pytest.mark.parametrize("name", EXAMPLES)
    def test_an_unknown_option_is_a_usage_error(self, name: str) -> None:
        proc = self._run(name, "--no-such-option")
        assert proc.returncode == 2, proc.stderr
        assert "unrecognized arguments: --no-such-option" in proc.stderr
        assert proc.stdout == ""


class TestInterrupted:
    """Ctrl-C or SIGTERM in the middle of an example: it shuts its stages down and exits
    with one line, no traceback, leaving no process, socket folder or shared memory."""

    @pytest.mark.slow
    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
    @pytest.mark.parametrize(
        ("name", "line"),
        [
            ("toy_stage.py", "request 'hello' streamed"),
            ("pool.py", "burst "),
            ("omni_pipeline.py", "stages "),
            ("ray_pool.py", "burst "),
        ],
    )
    def test_a_signal_mid_run_exits_cleanly(
        self, name: str, line: str, signum: signal.Signals, short_tmp: Path
    ) -> None:
        if name == "ray_pool.py":
            pytest.importorskip("ray", reason="the ray extra is not installed")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(short_tmp))
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert proc.stdout is not None
            seen = []
            for out in proc.stdout:  # mid-run: its stages are up and serving
                seen.append(out)
                if out.startswith(line):
                    break
            assert seen, "no output"
            assert seen[-1].startswith(line), "".join(seen)
            children = _descendants(proc.pid)
            assert children
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 128 + signum, err
        assert "Traceback" not in err, err
        assert "parent process is gone" not in err, err  # shut down, not orphaned
        assert err.strip().splitlines()[-1] in (
            "interrupted (Ctrl-C)",
            "terminated (SIGTERM)",
        ), err
        deadline = time.monotonic() + 10
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if _running(pid)]
        assert [f for f in os.listdir(short_tmp) if f != "ray"] == []  # Ray's own session logs
        ours = [proc.pid, *children]
        assert not [
            f for f in os.listdir("/dev/shm") if any(f.startswith(f"enginecore-{p}-") for p in ours)
        ]


class TestExamples:
    def test_toy_loop_runs_the_loop_in_process(self) -> None:
        proc = _run(ROOT / "examples" / "toy_loop.py")
        assert proc.returncode == 0, proc.stderr
        assert "utility  #2 -> error ZeroDivisionError('division by zero')" in proc.stdout
        # The loop applies the abort of r2 before the later utility #2, and emits in order:
        # no output of r2 follows #2's answer. (A line printed by the feeder thread says
        # nothing: a step that began before the abort arrived may still print r2.)
        after = proc.stdout.split("utility  #2 -> error")[-1]
        assert "r2:" not in after
        assert "r3: 0 step(s) left" in proc.stdout
        assert proc.stdout.rstrip().endswith("('shutdown',)")

    @pytest.mark.slow
    def test_toy_stage_launches_a_stage_and_summarises(self) -> None:
        proc = _run(ROOT / "examples" / "toy_stage.py")
        assert proc.returncode == 0, proc.stderr
        assert "requests   1000:" in proc.stdout
        assert "progress   100% (1000/1000)" in proc.stdout  # not a terminal: a line a quarter
        assert re.search(r"stage      \d+ steps, step p50 <= ", proc.stdout)
        assert re.search(r"\d+ outputs, 1001 adds, 1 aborts, \d+ load reports", proc.stdout)
        assert "stage      exited with code 0" in proc.stdout


class TestPoolExample:
    @pytest.mark.slow
    def test_pool_example_survives_a_kill_and_changes_membership(self) -> None:
        proc = _run(ROOT / "examples" / "pool.py")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "burst      30 requests -> {'r0': 10, 'r1': 10, 'r2': 10}" in out
        assert "kill       r1: 9 requests moved on and finished; failed: fragile" in out
        assert "2900 outputs in all" in out  # the 29 others, every output, none twice
        assert re.search(r"restart    r1 is serving, pid \d+, restarts 1", out)
        assert "membership +r3, -r0 (exit 0): 8/8 requests finished" in out
        assert "closed     every replica stopped" in out


class TestOmniPipelineExample:
    @pytest.mark.slow
    def test_omni_pipeline_streams_text_and_audio_through_three_stages(self) -> None:
        proc = _run(ROOT / "examples" / "omni_pipeline.py")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "stages     thinker -> talker -> vocoder" in out
        assert "text       the quick brown fox jumps over the lazy dog" in out
        assert "audio      9 chunks, 2160 samples of float32" in out
        assert re.search(r"streaming  first audio after \d+ ms, all after \d+ ms", out)
        assert "burst      40 requests, 640 outputs, at most 16 in the pipeline at once" in out
        assert "abort      long: aborted=True" in out
        assert "error      bad: stage 'thinker' refused it" in out
        assert "closed     every stage stopped" in out


class TestRayPoolExample:
    @pytest.mark.slow
    def test_ray_pool_example_survives_a_kill_and_restarts_its_group(self) -> None:
        pytest.importorskip("ray", reason="the ray extra is not installed")
        proc = _run(ROOT / "examples" / "ray_pool.py")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "groups     {'r0': 'tp', 'r1': 'tp', 'r2': None}" in out
        assert "burst      21 requests -> {'r0': 7, 'r1': 7, 'r2': 7}" in out
        # r0's death stops r1, its group's other member; r2 alone keeps serving.
        killed = (
            r"kill       r0: ReplicaDeadError \{'r0': 7, 'r1': 7\} \(seen in 0\.\d+ s\), "
            r"7 finished on r2"
        )
        assert re.search(killed, out)
        assert "restart    r0 is serving, restarts 1" in out
        assert "restart    r1 is serving, restarts 1" in out
        assert "restart    r2 is serving, restarts 0" in out
        assert "after       [[2, 1, 0], [2, 1, 0], [2, 1, 0]]" in out
        assert "closed     CPUs free again: 2.0" in out
