"""The benchmark harness runs and produces well-formed records. Never asserts on a time."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from benchmarks import (
    _harness,
    bench_overhead,
    bench_stage_ingest,
    bench_stage_output,
    bench_stage_utility,
    bench_throughput,
)
from benchmarks.__main__ import main

KEYS = {"name", "value", "unit", "baseline", "ratio", "goal", "met"}


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


class TestStageBenchmarks:
    def test_raw_peer_answers_and_leaves_nothing_behind(self) -> None:
        from benchmarks._stage import RawPeer

        with RawPeer() as peer:
            assert peer.call(("utility", 7, "x", [])) == ["utility", 7, None, None]
            ipc_dir, process = peer._dir, peer.process
        assert process.exitcode == 0
        assert not os.path.exists(ipc_dir)

    def test_utility_round_trip_measures_both_sides(self) -> None:
        pooled, per_block = bench_stage_utility.measure(samples=5, blocks=2)
        assert len(pooled["loop"]) == len(pooled["raw"]) == 10
        assert len(per_block["loop"]) == 2

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
