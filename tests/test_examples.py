"""The examples and the README's code run as documented and exit 0 by themselves."""

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


class TestReadme:
    def test_readme_stage_example_runs(self, tmp_path: Path) -> None:
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
        stage_blocks = [b for b in blocks if "StageClient" in b]
        assert stage_blocks, "README.md lost its stage example"
        script = tmp_path / "readme_stage.py"
        script.write_text(stage_blocks[0])
        proc = _run(script)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["[2,", "1,", "0]", "0.25"]

    @pytest.mark.parametrize("doc", ["README.md", "docs/stage.md"])
    def test_array_round_trip_examples_run(self, tmp_path: Path, doc: str) -> None:
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
        array_blocks = [b for b in blocks if "StageClient" in b and "np.array_equal" in b]
        assert array_blocks, f"{doc} lost its array round trip example"
        for i, block in enumerate(array_blocks):
            script = tmp_path / f"array_example_{i}.py"
            script.write_text(block)
            proc = _run(script)
            assert proc.returncode == 0, proc.stderr
