"""PipelineCore, one decision at a time (``test_pipeline_model.py`` checks it as a whole)."""

from __future__ import annotations

import traceback

import pytest

from enginecore.stage._errors import EngineDeadError, PipelineStageDeadError
from enginecore.stage._pipeline_core import PipelineCore, PipelineDeliveries, RequestState
from enginecore.stage._session import StreamCore


def _core(*ids: str) -> PipelineCore[StreamCore]:
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"])
    for rid in ids:
        core.open(rid, StreamCore(rid))
    return core


def test_a_stage_death_aborts_a_closing_request_after_the_dead_stage() -> None:
    # r went through stages a and b to c, then a ended it with an error: its stream ended,
    # and the coordinator's abort chases it from a. b dies before that abort got past it:
    # only an abort sent to c itself can reach r there now.
    core = _core("r", "q")
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(0, "r", "rejected", 1.0, d)
    assert d.aborts == ["r"]
    assert core.state("r") is RequestState.CLOSING
    d = PipelineDeliveries()
    core.stage_dead(1, EngineDeadError("killed"), 2.0, d)
    assert d.aborts == ["q"]  # from the first stage: r's abort is on its way there already
    assert d.stage_aborts == [(2, ["r", "q"])]
    assert d.freed == 2


def test_a_stage_death_aborts_nothing_in_a_dead_first_stage_nor_after_the_last() -> None:
    core = _core("r")
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.stage_dead(0, EngineDeadError("killed"), 1.0, d)
    assert d.aborts == []
    assert d.stage_aborts == [(1, ["r"])]
    core = _core("r")
    d = PipelineDeliveries()
    core.stage_dead(2, EngineDeadError("killed"), 1.0, d)
    assert d.aborts == ["r"]
    assert d.stage_aborts == []


def test_a_second_death_aborts_again_what_the_first_one_ended() -> None:
    # a dies: r's abort goes to b and chases on to c. b dies before it passed the abort on:
    # c must get it from the coordinator, although the core ended r at a's death.
    core = _core("r", "q")
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.stage_dead(0, EngineDeadError("killed"), 1.0, d)
    assert d.stage_aborts == [(1, ["r", "q"])]
    d = PipelineDeliveries()
    core.stage_dead(1, EngineDeadError("killed"), 2.0, d)
    assert d.aborts == []
    assert d.stage_aborts == [(2, ["r", "q"])]
    assert d.freed == 0
    # The last stage's death has no stage after it.
    d = PipelineDeliveries()
    core.stage_dead(2, EngineDeadError("killed"), 3.0, d)
    assert d.stage_aborts == []


def test_a_stage_death_tells_its_neighbours_before_any_abort_reaches_them() -> None:
    # The stage after the dead one hears `gone` (then drops the dead one's late data)
    # before the aborts; the stage before it hears `gone` too (it frees the slots it kept
    # for the dead one). Even with no request in the pipeline: late data can still come.
    core = _core("r")
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.stage_dead(1, EngineDeadError("killed"), 1.0, d)
    assert d.gone == [(2, "previous", 1), (0, "next", 1)]
    assert d.stage_aborts == [(2, ["r"])]
    d = PipelineDeliveries()
    _core().stage_dead(0, EngineDeadError("killed"), 1.0, d)
    assert d.gone == [(1, "previous", 0)]
    assert d.stage_aborts == []
    d = PipelineDeliveries()
    _core().stage_dead(2, EngineDeadError("killed"), 1.0, d)
    assert d.gone == [(1, "next", 2)]


def test_a_refused_add_raises_the_failure_without_growing_its_traceback() -> None:
    core = _core("r")
    core.stage_dead(1, EngineDeadError("killed"), 1.0, PipelineDeliveries())
    failure = core.failure
    depths = []
    for i in range(20):
        with pytest.raises(PipelineStageDeadError) as info:
            core.check([f"x{i}"])
        assert info.value is failure
        depths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert depths == [depths[0]] * 20, depths
