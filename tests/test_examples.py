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

    @pytest.mark.parametrize("doc", ["README.md", "docs/pool.md"])
    def test_pool_examples_run(self, tmp_path: Path, doc: str) -> None:
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
        pool_blocks = [b for b in blocks if "StagePool.launch" in b]
        assert pool_blocks, f"{doc} lost its pool example"
        script = tmp_path / "pool_example.py"
        script.write_text(pool_blocks[0])
        proc = _run(script)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        if doc == "README.md":
            assert lines[0] == "[2, 1, 0]"
            assert lines[1].count(": 0") == 4
        else:
            assert lines[0] == "['r0', 'r1', 'r2', 'r3', 'r0', 'r1', 'r2', 'r3']"
            assert lines[1] == "800"
            assert lines[2].count("<Replica r") == 4

    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("doc", "marker", "expected"),
        [
            ("README.md", "Pipeline.launch", ["[2, 1, 0]"]),
            ("docs/pipelines.md", "def linear_pipeline(", ["[2, 1, 0]", "200"]),
            ("docs/pipelines.md", "AsyncPipeline.launch", ["[2, 1, 0]"]),
            ("docs/pipelines.md", "Retry(2)", ["[2, 1, 0]"]),
            (
                "docs/pipelines.md",
                "replicas=2",
                ["[2, 1, 0]", "2 8", "['slow[0]', 'slow[1]']"],
            ),
            (
                "docs/pipelines.md",
                "restart=True",
                [
                    "[2, 1, 0]",
                    "{'enginecore:CountdownEngine': 0, 'mid[0]': 0, 'mid[1]': 0, 'last': 0}",
                ],
            ),
            ("docs/pipelines.md", "placement=RayPlacement", ["[2, 1, 0]", "True"]),
        ],
    )
    def test_pipeline_examples_run(
        self, tmp_path: Path, doc: str, marker: str, expected: list[str]
    ) -> None:
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
        found = [b for b in blocks if marker in b and "__main__" in b]
        assert found, f"{doc} lost its pipeline example ({marker})"
        if marker == "def linear_pipeline(":  # the guide opens with its recipe
            assert blocks[0] == found[0]
        script = tmp_path / "pipeline_example.py"
        script.write_text(found[0])
        proc = _run(script)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == expected

    @pytest.mark.parametrize(
        ("doc", "marker", "expected"),
        [
            ("docs/stage.md", "print(list(stream))", [r"\[2, 1, 0\]", "0.25"]),
            (
                "docs/stage.md",
                "AsyncStageClient.launch",
                [r"\[2, 1, 0\]", r"\[0\.0, 0\.5, 1\.0, 1\.5\]"],
            ),
            ("docs/pool.md", "RequestFailed", []),
        ],
    )
    def test_guide_examples_run(
        self, tmp_path: Path, doc: str, marker: str, expected: list[str]
    ) -> None:
        """The guides' runnable blocks (those with a ``__main__`` guard) that no other test
        runs (observability.md's is in tests/stage/test_timings.py): each exits 0 and prints
        what its comments say, line by line (regexes)."""
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
        found = [b for b in blocks if marker in b and "__main__" in b]
        assert len(found) == 1, f"{doc}: expected one runnable example with {marker!r}"
        script = tmp_path / "guide_example.py"
        script.write_text(found[0])
        proc = _run(script)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) == len(expected), proc.stdout
        for line, pattern in zip(lines, expected, strict=True):
            assert re.fullmatch(pattern, line), (line, pattern)

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
