"""The benchmark harness runs and produces well-formed records. Never asserts on a time.

The stage benchmarks start processes: their tests also check that no child process and no
socket directory is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from benchmarks import (
    _harness,
    bench_overhead,
    bench_pipeline,
    bench_stage_arrays,
    bench_stage_ingest,
    bench_stage_output,
    bench_stage_requests,
    bench_stage_utility,
    bench_throughput,
)
from benchmarks.__main__ import MODULES, main

KEYS = {"name", "value", "unit", "baseline", "ratio", "goal", "met"}


def pid_gone(pid: int) -> bool:
    """Whether *pid* no longer runs (absent, or a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def assert_records(records: list[_harness.Record], n: int) -> None:
    assert len(records) == n
    for rec in records:
        obj = rec.as_json()
        assert obj.keys() >= KEYS
        assert rec.value >= 0, rec
        assert rec.baseline >= 0, rec
        assert isinstance(rec.met, bool)
    assert len({r.name for r in records}) == n, "metric names must be unique"


class TestHarness:
    def test_interleave_alternates_order_and_drops_warmup(self) -> None:
        calls: list[str] = []

        def side(name: str) -> Callable[[], int]:
            def once() -> int:
                calls.append(name)
                return len(calls)

            return once

        out = _harness.interleave({"a": side("a"), "b": side("b")}, rounds=3, warmup=1)
        assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
        assert len(out["a"]) == len(out["b"]) == 3

    def test_percentile_is_nearest_rank(self) -> None:
        xs = [float(i) for i in range(1, 101)]
        assert _harness.percentile(xs, 50) == 50.0
        assert _harness.percentile(xs, 99) == 99.0
        assert _harness.percentile([3.0], 99) == 3.0

    def test_json_has_the_documented_keys(self, tmp_path: Path) -> None:
        rec = _harness.higher_is_better("x", [2.0, 3.0], [4.0, 4.0], "msgs/s", 0.7)
        path = tmp_path / "r.json"
        _harness.write_json(str(path), [rec], quick=True)
        (obj,) = json.loads(path.read_text())
        assert obj.keys() >= KEYS
        assert obj["ratio"] == pytest.approx(2.5 / 4.0)
        assert obj["met"] is False


class TestBenchmarksRun:
    def test_overhead_measures_both_sides(self) -> None:
        assert bench_overhead.run_loop(2000) > 0
        assert bench_overhead.run_bare(2000) > 0

    def test_pipeline_measures_every_side(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as device:
            assert bench_pipeline.run_device(1, 3, device) > 0
            assert bench_pipeline.run_device(2, 3, device) > 0
        assert bench_pipeline.run_loop(2000) > 0
        assert bench_pipeline.run_loop(2000, bench_pipeline._FrozenLoop) > 0
        assert bench_pipeline.run_loop(2000, pipelined=True) > 0

    def test_pipeline_is_registered_and_runs_quick(self) -> None:
        assert "bench_pipeline" in MODULES
        assert_records(bench_pipeline.run(quick=True), 2)

    def test_throughput_measures_both_sides(self) -> None:
        msgs = bench_throughput.make_messages(500)
        assert bench_throughput.run_loop(msgs) > 0
        assert bench_throughput.run_raw(msgs) > 0

    def test_runner_writes_json_for_a_subset(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        path = tmp_path / "r.json"
        assert main(["--quick", "--only", "overhead", "--json", str(path)]) == 0
        records = json.loads(path.read_text())
        assert [r["name"] for r in records] == ["loop overhead per iteration"]
        assert records[0].keys() >= KEYS
        assert "| loop overhead per iteration" in capsys.readouterr().out


@pytest.mark.usefixtures("no_leftovers")
class TestStageBenchmarks:
    def test_every_stage_script_is_registered(self) -> None:
        for name in ("bench_stage_requests", "bench_stage_arrays", "bench_stage_utility"):
            assert name in MODULES

    def test_raw_peer_answers_and_leaves_nothing_behind(self) -> None:
        from benchmarks._stage import RawPeer

        with RawPeer() as peer:
            assert peer.call(("utility", 7, "x", [])) == ["utility", 7, None, None]
            ipc_dir, process = peer._dir, peer.process
        assert process.exitcode == 0
        assert not os.path.exists(ipc_dir)

    def test_mpq_stage_works_like_a_stage_and_leaves_nothing_behind(self) -> None:
        from benchmarks._mpq_stage import MpqStage

        with MpqStage() as stage:
            assert stage.call("div", 1, 4) == 0.25
            with pytest.raises(RuntimeError, match="no utility"):
                stage.call("nope")
            stage.add_many([("a", 3), ("b", 1)])
            stage.add("c", 2)
            stage.collect(timeout=30)
            assert stage.streams == {"a": [2, 1, 0], "b": [0], "c": [1, 0]}
            stage.add("long", 10**9)
            stage.abort(["long"])
            stage.collect(timeout=30)
            assert not stage.live
            process = stage.process
        assert process.exitcode == 0

    def test_mpq_stage_children_exit_when_the_parent_is_killed(self) -> None:
        # One busy child (a request that never ends) and one idle child; SIGKILL the parent.
        script = (
            "import os, signal, sys\n"
            "from benchmarks._mpq_stage import MpqStage\n"
            "if __name__ == '__main__':\n"
            "    busy, idle = MpqStage(), MpqStage()\n"
            "    busy.add('forever', 10**12)\n"
            "    busy.call('num_requests')\n"
            "    print(busy.process.pid, idle.process.pid, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        pids = [int(p) for p in proc.stdout.split()]
        assert len(pids) == 2, proc.stderr
        deadline = time.monotonic() + 10
        while not all(map(pid_gone, pids)):
            assert time.monotonic() < deadline, f"orphaned mp.Queue stage children: {pids}"
            time.sleep(0.05)

    def test_mpq_stage_echoes_with_another_engine(self) -> None:
        from benchmarks._mpq_stage import MpqStage
        from benchmarks._stage import EchoEngine

        with MpqStage(EchoEngine) as stage:
            assert stage.echo("x", {"k": [1, 2]}) == {"k": [1, 2]}
            process = stage.process
        assert process.exitcode == 0

    def test_utility_round_trip_measures_every_side(self) -> None:
        pooled, per_block, cpu = bench_stage_utility.measure(samples=5, blocks=2)
        assert len(pooled["loop"]) == len(pooled["raw"]) == len(pooled["mpq"]) == 10
        assert len(per_block["loop"]) == 2
        # Each side's peer process and this one spent CPU on its calls.
        assert set(cpu) == {"loop", "raw", "mpq"}
        assert all(peer > 0 and parent > 0 for peer, parent in cpu.values())
        assert "enginecore" in bench_stage_utility.cpu_note(cpu)

    def test_requests_measures_every_side(self) -> None:
        res = bench_stage_requests.measure(rounds=1, jobs=1)
        assert {len(v) for v in res.values()} == {1}
        assert_records(bench_stage_requests.records(res), 5)

    def test_cpu_clocks_read_a_process(self) -> None:
        # This process has spent CPU (the imports alone take far more than a 10 ms tick).
        pid = os.getpid()
        assert bench_stage_requests.stat_cpu(pid) > 0
        clock = bench_stage_requests.process_cpu(pid)
        first = clock()
        assert first > 0
        until = time.process_time() + 0.03  # three ticks of CPU: even stat_cpu must move
        while time.process_time() < until:
            pass
        assert clock() > first

    def test_arrays_raw_and_mpq_sides(self) -> None:
        import numpy as np
        from benchmarks._mpq_stage import MpqStage
        from benchmarks._stage import EchoEngine, RawPeer

        arr = np.arange(1 << 16, dtype=np.float32)
        with RawPeer(zero_copy=True) as peer, MpqStage(EchoEngine) as stage:
            assert bench_stage_arrays.trip_raw(peer, arr, 2) > 0
            assert bench_stage_arrays.trip_mpq(stage, arr, 2) > 0

    def test_arrays_runs_or_skips_until_the_stage_carries_arrays(self) -> None:
        skipped = ""
        try:
            records = bench_stage_arrays.run(quick=True)
        except _harness.Skipped as exc:
            records, skipped = [], str(exc)
        if skipped:
            assert "numpy arrays" in skipped
        else:
            assert_records(records, 2)

    def test_output_and_ingest_measure_both_sides(self) -> None:
        from benchmarks._stage import SINK_FACTORY, RawPeer

        from enginecore.stage import StageClient

        with (
            StageClient.launch("enginecore:CountdownEngine", ordered_events=True) as client,
            RawPeer() as peer,
        ):
            assert bench_stage_output.run_stage(client, steps=3) > 0
            assert bench_stage_output.run_raw(peer, steps=3) > 0
            assert bench_stage_ingest.run_raw(peer, 50) > 0
        with StageClient.launch(SINK_FACTORY) as client:
            assert bench_stage_ingest.run_stage(client, 50) > 0
