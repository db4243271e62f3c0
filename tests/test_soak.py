"""The stage soak (``benchmarks/soak_stage.py``) in its quick size: every expectation holds,
every kind of invalid input was exercised, and nothing is left behind (no child process,
no socket directory). Counts only, never a time."""

from __future__ import annotations

import pytest
from benchmarks import soak_stage
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

    def test_refused_by_msgspec_ends_the_request(self) -> None:
        # Refused only when the output thread encodes them, after the loop has stepped the
        # request again: those later outputs must not follow the request's error.
        (fuzz,) = soak_stage.run(3000, 0, handovers=0, poisons=REFUSED_BY_MSGSPEC)
        assert fuzz.ok, failures(fuzz)

    def test_cli_prints_a_table_and_exits_0(self, capsys: pytest.CaptureFixture[str]) -> None:
        argv = ["--adds", "1000", "--requests", "2000"]
        assert soak_stage.main(argv) == 0
        out = capsys.readouterr().out
        assert "## fuzz: 1,000 adds" in out
        assert "## abort: 2,000 requests" in out
        assert "| FAIL" not in out
        assert out.rstrip().splitlines()[-1].startswith("PASS")


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
