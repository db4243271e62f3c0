"""CountdownEngine, and a contract suite that every engine the project ships must pass."""

from __future__ import annotations

import pytest

from enginecore import CountdownEngine, Engine, EngineCoreError, RequestRejected


class TestCountdownEngine:
    def test_step_decrements_in_insertion_order_and_removes_finished(self) -> None:
        e = CountdownEngine()
        e.add("a", 2)
        e.add("b", 1)
        e.add("c", 3)
        assert e.step() == [("a", 1), ("b", 0), ("c", 2)]
        assert e.step() == [("a", 0), ("c", 1)]
        assert e.step() == [("c", 0)]
        assert not e.has_work()
        assert e.step() == []

    def test_abort_removes_and_ignores_unknown_ids(self) -> None:
        e = CountdownEngine()
        e.add("a", 2)
        e.abort(["a", "zzz"])
        assert not e.has_work()

    def test_utilities(self) -> None:
        e = CountdownEngine()
        assert e.utility("div", (6, 3)) == 2.0
        with pytest.raises(ZeroDivisionError):
            e.utility("div", (1, 0))
        e.add("a", 1)
        assert e.utility("num_requests", ()) == 1
        with pytest.raises(ValueError, match="no utility 'nope'"):
            e.utility("nope", ())

    @pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True, None, {"prompt": 42}])
    def test_add_rejects_bad_step_counts_as_request_scoped(self, bad: object) -> None:
        e = CountdownEngine()
        with pytest.raises(RequestRejected, match=r"need an int >= 1 \(a step count\), got "):
            e.add("a", bad)
        assert not e.has_work()  # nothing of the rejected request is left
        e.add("a", 1)  # the id stays free

    def test_add_rejects_a_live_duplicate_as_request_scoped(self) -> None:
        e = CountdownEngine()
        e.add("a", 2)
        with pytest.raises(RequestRejected, match="request 'a' is already live") as info:
            e.add("a", 1)
        assert info.value.message == "request 'a' is already live in the engine"
        assert e.step() == [("a", 1)]  # the live request is untouched

    def test_request_rejected_is_an_engine_core_error_and_a_value_error(self) -> None:
        exc = RequestRejected("why")
        assert isinstance(exc, EngineCoreError)
        assert isinstance(exc, ValueError)  # what CountdownEngine.add raised before
        assert (str(exc), exc.message) == ("why", "why")

    def test_is_finished_marks_the_last_output(self) -> None:
        assert CountdownEngine.is_finished(("a", 0))
        assert not CountdownEngine.is_finished(("a", 1))


# Every engine the project ships; the stage runtime's engines join this list.
SHIPPED_ENGINES = [CountdownEngine]


@pytest.mark.parametrize("factory", SHIPPED_ENGINES)
class TestEngineContract:
    def test_satisfies_the_protocol(self, factory: type[Engine]) -> None:
        assert isinstance(factory(), Engine)

    def test_fresh_engine_has_no_work_and_tolerates_unknown_aborts(
        self, factory: type[Engine]
    ) -> None:
        e = factory()
        assert e.has_work() is False
        e.abort(["never-added"])
        assert e.has_work() is False

    def test_added_work_runs_to_completion_then_idles(self, factory: type[Engine]) -> None:
        e = factory()
        e.add("r", 2)
        assert e.has_work()
        for _ in range(100):
            if not e.has_work():
                break
            list(e.step())
        assert not e.has_work()

    def test_aborted_request_produces_nothing(self, factory: type[Engine]) -> None:
        e = factory()
        e.add("r", 2)
        e.abort(["r"])
        assert not e.has_work()
