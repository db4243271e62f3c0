"""The examples run as documented and exit 0 by themselves. (The docs' code blocks, the
README's included, are run by tests/test_docs.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _run(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=60, check=False
    )


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
