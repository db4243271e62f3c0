"""PipelineCore, one decision at a time (``test_pipeline_model.py`` checks it as a whole)."""

from __future__ import annotations

import traceback

import pytest

from enginecore.stage._edge import BEFORE, ENDED, SENT_ON
from enginecore.stage._errors import EngineDeadError, PipelineRequestError, PipelineStageDeadError
from enginecore.stage._pipeline_core import PipelineCore, PipelineDeliveries, RequestState
from enginecore.stage._pool_core import RestartPolicy
from enginecore.stage._session import ABORTED, StreamCore

HERE = ENDED | BEFORE  # a stage's end report: the request stops there, done in every stage


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
    assert d.gone == [(2, 0, "previous", 1, 0), (0, 0, "next", 1, 0)]
    assert d.stage_aborts == [(2, ["r"])]
    d = PipelineDeliveries()
    _core().stage_dead(0, EngineDeadError("killed"), 1.0, d)
    assert d.gone == [(1, 0, "previous", 0, 0)]
    assert d.stage_aborts == []
    d = PipelineDeliveries()
    _core().stage_dead(2, EngineDeadError("killed"), 1.0, d)
    assert d.gone == [(1, 0, "next", 2, 0)]


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


# -- end reports ---------------------------------------------------------------------------------


@pytest.mark.parametrize("c_first", [True, False])
def test_a_stage_that_ended_a_request_before_its_input_did_holds_it_until_that_input_ends(
    c_first: bool,
) -> None:
    # a -> b -> c: b ends r before a's END reached it, having sent c payloads; c ends it
    # (its END said REPORT: c reports its own end only). The reports of b and c arrive in
    # either order; r is done only with b's BEFORE, once a's END reached b.
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"])
    stream = StreamCore("r")
    core.open("r", stream)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    reports = [(1, ENDED | SENT_ON), (2, ENDED)]
    for k, report in reports if c_first else reports[::-1]:
        core.outputs(k, ["r"], [True], [report], 1.0, d)
        assert stream._ended is None
    assert core.in_flight == 1
    core.outputs(1, ["r"], [True], [BEFORE], 2.0, d)
    assert stream._ended is not None
    assert stream._ended.exc is None
    assert core.in_flight == 0


def test_an_end_report_of_a_stage_that_sent_on_waits_for_the_next_stage() -> None:
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b"])
    stream = StreamCore("r")
    core.open("r", stream)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.outputs(0, ["r"], [True], [ENDED | SENT_ON], 1.0, d)
    assert stream._ended is None
    core.outputs(1, ["r"], [True], [ENDED], 2.0, d)
    assert stream._ended is not None
    assert core.in_flight == 0


# -- retry ---------------------------------------------------------------------------------------


def _retrying(n: int = 1) -> tuple[PipelineCore[StreamCore], StreamCore]:
    """Stages a, b, c; the edge a -> b retries *n* times; request r reached c."""
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"], retry=[0, n, 0])
    stream = StreamCore("r")
    core.open("r", stream)
    return core, stream


def test_a_retried_request_drops_the_failed_attempts_events_until_the_fence() -> None:
    core, stream = _retrying()
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    # a ended it, having sent it on: it reports nothing, its END tells b.
    core.error(1, "r", "refused", 2.0, d)  # b failed it: a replays it
    assert d.replays == [(0, "r", 1)]
    assert not d.aborts
    assert stream._ended is None
    assert core.state("r") is RequestState.LIVE
    # c's events of the failed attempt, before it answered the fence: dropped.
    core.outputs(2, ["r", "r"], [False, True], ["old", HERE], 3.0, d)
    core.error(2, "r", "late error of the old attempt", 3.0, d)
    assert not stream._buf
    assert stream._ended is None
    core.aborted(1, ["r"], 4.0, d)  # b and c answer the fence: not confirmations
    core.aborted(2, ["r"], 4.0, d)
    assert core.state("r") is RequestState.LIVE
    assert d.freed == 0
    # The new attempt: b sends c one payload (and reports nothing), c sends the caller
    # one, and reports the end of r in every stage; done.
    core.outputs(2, ["r", "r"], [False, True], ["new", HERE], 5.0, d)
    assert stream._buf[:1] == ["new"]  # then its end: finished
    assert stream._ended is not None
    assert stream._ended.exc is None
    assert d.freed == 1
    assert d.releases == ["r"]


def test_after_n_retries_the_error_ends_the_request_and_says_so() -> None:
    core, stream = _retrying(2)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    for attempt in (1, 2):
        core.error(1, "r", "refused", 1.0, d)
        assert d.replays[-1] == (0, "r", attempt)
        core.aborted(1, ["r"], 2.0, d)
        core.aborted(2, ["r"], 2.0, d)
    core.error(1, "r", "refused", 3.0, d)
    assert len(d.replays) == 2
    assert stream._ended is not None
    exc = stream._ended.exc
    assert isinstance(exc, PipelineRequestError)
    assert exc.stage == "b"
    assert exc.message.endswith("refused (retried 2 times)")
    assert d.aborts == ["r"]
    assert core.state("r") is RequestState.CLOSING


def test_no_retry_once_the_failed_stage_or_a_later_one_reached_the_caller() -> None:
    core, stream = _retrying()
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.outputs(2, ["r"], [False], ["said"], 1.0, d)
    core.error(1, "r", "refused", 2.0, d)
    assert not d.replays
    assert stream._ended is not None
    exc = stream._ended.exc
    assert isinstance(exc, PipelineRequestError)
    assert "not retried: stage 'c' had sent the caller outputs of it" in exc.message


def test_a_failed_replay_ends_the_request_and_a_stale_answer_is_ignored() -> None:
    core, stream = _retrying(2)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 1.0, d)
    core.aborted(1, ["r"], 2.0, d)
    core.aborted(2, ["r"], 2.0, d)
    core.error(1, "r", "refused", 3.0, d)
    assert [a for _, _, a in d.replays] == [1, 2]
    core.replayed(0, "r", 1, False, "gone", 4.0, d)  # the first attempt's: moot
    assert stream._ended is None
    core.replayed(0, "r", 2, False, "its inputs outgrew the log", 5.0, d)
    assert stream._ended is not None
    exc = stream._ended.exc
    assert isinstance(exc, PipelineRequestError)
    assert exc.stage == "b"
    assert exc.message.endswith("refused (not retried: its inputs outgrew the log)")
    assert d.aborts == ["r"]
    # The coordinator's abort, and the second fence: all of them before r leaves.
    for k in range(3):
        core.aborted(k, ["r"], 6.0, d)
    assert core.in_flight == 1
    core.aborted(1, ["r"], 7.0, d)
    core.aborted(2, ["r"], 7.0, d)
    assert core.in_flight == 0


def test_done_while_a_fence_is_unanswered_aborts_the_request_everywhere() -> None:
    # b failed r twice; the first replay made the second moot... r is done through the
    # attempt after the first fence while c has not answered the second: the replay still
    # on its way must not leave a request behind in b or c.
    core, stream = _retrying(2)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 2.0, d)
    core.aborted(1, ["r"], 3.0, d)
    core.error(1, "r", "refused", 4.0, d)  # the second attempt failed too
    core.aborted(1, ["r"], 5.0, d)
    core.aborted(2, ["r"], 5.0, d)  # c answers the first fence only
    core.outputs(1, ["r"], [True], [HERE], 6.0, d)  # the third attempt: b ends it, none sent on
    assert stream._ended is not None
    assert stream._ended.exc is None
    assert d.aborts == ["r"]
    assert not d.releases
    assert core.state("r") is RequestState.CLOSING
    for k in range(3):
        core.aborted(k, ["r"], 7.0, d)
    assert core.in_flight == 1  # c's second fence is still due
    core.aborted(2, ["r"], 8.0, d)
    assert core.in_flight == 0


def test_an_error_it_would_retry_after_the_callers_abort_ends_the_request_aborted() -> None:
    # The caller aborted r; before the abort reached b, b failed r with an error its edge
    # would retry. The abort and the retry crossed: r ends aborted, not with b's error
    # (docs/pipelines.md, "Retry"), once every stage has applied the abort.
    core, stream = _retrying(2)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.abort(["r"], d)
    assert d.aborts == ["r"]
    core.error(1, "r", "refused", 2.0, d)
    assert not d.replays  # moot: the abort is on its way
    assert stream._ended is None
    assert core.state("r") is RequestState.ABORTING
    for k in range(3):
        core.aborted(k, ["r"], 3.0, d)
    assert stream._ended is not None
    assert stream._ended.exc is None
    assert stream._ended.aborted
    assert core.in_flight == 0


def test_an_error_past_its_retries_after_the_callers_abort_still_says_so() -> None:
    core, stream = _retrying(1)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 1.0, d)  # retried once
    core.aborted(1, ["r"], 2.0, d)
    core.aborted(2, ["r"], 2.0, d)
    core.abort(["r"], d)
    core.error(1, "r", "refused", 3.0, d)  # the last retry failed too: that error stands
    assert stream._ended is not None
    exc = stream._ended.exc
    assert isinstance(exc, PipelineRequestError)
    assert exc.message.endswith("refused (retried 1 time)")


def test_an_id_whose_stream_ended_but_not_freed_yet_says_why_it_is_still_in() -> None:
    core = _core("r", "q")
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 1.0, d)  # its stream ended; the abort is on its way
    with pytest.raises(ValueError, match=r"'r' is still in the pipeline \(it ended or was"):
        core.check(["r"])
    with pytest.raises(ValueError, match=r"'q' is still in the pipeline$"):
        core.check(["q"])


def test_bad_retry_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="one count >= 0 per stage"):
        PipelineCore(["a", "b"], retry=[1, 0])
    with pytest.raises(ValueError, match="one count >= 0 per stage"):
        PipelineCore(["a", "b"], retry=[0])


# -- the fence on the wire: a fence's `aborted` carries a flag (docs/wire.md section 8) ----


def _retried_then_dead(replicas: tuple[int, ...]) -> tuple[PipelineCore[StreamCore], StreamCore]:
    """Stages a, b, c; the edge a -> b retries. b failed r, a replays it (fences at b and c);
    then r's process of b dies (a pool's replica, or the one process of a stage that
    restarts): r ends, its aborts go from a and to c, b counts as having applied them."""
    restart = [None, RestartPolicy(first_delay=0.1), None] if replicas[1] == 1 else None
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c"], replicas=replicas, retry=[0, 2, 0], restart=restart
    )
    stream = StreamCore("r")
    core.open("r", stream)
    route = core.route("r")
    assert route is not None
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 1.0, d, route[1])
    assert d.replays == [(0, "r", 1)]
    d = PipelineDeliveries()
    core.replica_dead(1, route[1], EngineDeadError("killed"), 1.1, d)
    assert stream._ended is not None
    assert isinstance(stream._ended.exc, PipelineStageDeadError)
    assert d.aborts == ["r"]
    assert d.stage_aborts == [(2, ["r"])]
    return core, stream


@pytest.mark.parametrize("replicas", [(1, 1, 1), (1, 2, 1)], ids=["restart", "pool"])
def test_a_fence_answered_after_a_death_does_not_confirm_the_abort(
    replicas: tuple[int, ...],
) -> None:
    # The race: b's dead process had passed the fence on to c before it died, and c's
    # answer to that fence reaches the coordinator after the death. It is flagged: a fence's
    # answer, never the confirmation of the abort sent to c after the death, whose own
    # answer is still on its way. r keeps its id and its place until that one comes.
    core, _ = _retried_then_dead(replicas)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.aborted(0, ["r"], 1.2, d)  # a applied the abort from the first stage
    core.aborted(2, ["r"], 1.3, d, fence=True)  # c's late answer to the fence
    assert core.state("r") is RequestState.CLOSING  # not confirmed one message early
    assert core.in_flight == 1
    assert d.freed == 0  # the id is taken, its place in the budget held
    core.aborted(2, ["r"], 1.4, d)  # c's answer to the abort sent after the death
    assert core.state("r") is None
    assert core.in_flight == 0
    assert d.freed == 1


@pytest.mark.parametrize("replicas", [(1, 1, 1), (1, 2, 1)], ids=["restart", "pool"])
def test_a_fence_lost_with_a_dead_process_is_not_waited_for(replicas: tuple[int, ...]) -> None:
    # The dead process never passed the fence on (or c dropped it after its gone): c's only
    # answer is the abort's, and it frees r.
    core, _ = _retried_then_dead(replicas)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.aborted(2, ["r"], 1.2, d)
    assert core.in_flight == 1  # a has not answered yet
    core.aborted(0, ["r"], 1.3, d)
    assert core.in_flight == 0


def test_a_flagged_fence_answer_is_never_a_confirmation() -> None:
    # Every stage answered the coordinator's abort of a failed request, and a stray fence
    # answer (no fence due) changes nothing: it neither confirms nor counts.
    core, stream = _retrying()
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(0, "r", "rejected", 1.0, d)  # the first stage: not retried
    assert stream._ended is not None
    for k in range(3):
        core.aborted(k, ["r"], 2.0, d, fence=True)
    assert core.in_flight == 1
    for k in range(3):
        core.aborted(k, ["r"], 3.0, d)
    assert core.in_flight == 0


def test_an_abort_that_overtakes_the_fence_is_confirmed_once_the_fence_is_answered() -> None:
    # b failed r and a replays it; the caller aborts r meanwhile. The abort reaches c
    # before the fence does (the replay and the abort travel on two connections to a):
    # c's unflagged answer comes first. Taken as the fence's (an older stage flags
    # nothing), it is the abort's once c's flagged answer to the fence arrives.
    core, stream = _retrying()
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 1.0, d)
    core.abort(["r"], d)
    assert core.state("r") is RequestState.ABORTING
    core.aborted(0, ["r"], 2.0, d)
    core.aborted(1, ["r"], 2.0, d)  # b: the abort first
    core.aborted(2, ["r"], 2.0, d)  # c: the abort first
    core.aborted(1, ["r"], 3.0, d, fence=True)
    assert core.in_flight == 1  # c's fence is still due
    core.aborted(2, ["r"], 3.0, d, fence=True)
    assert core.in_flight == 0
    assert stream._ended is not None
    assert stream._ended.aborted


def test_flagged_fence_answers_end_the_failed_attempt_as_unflagged_ones_did() -> None:
    # The usual order, with flags: each stage's fence answer, then its answer to the abort.
    core, stream = _retrying(2)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.error(1, "r", "refused", 2.0, d)
    core.outputs(2, ["r"], [False], ["old"], 3.0, d)  # the failed attempt's: dropped
    core.aborted(1, ["r"], 4.0, d, fence=True)
    core.aborted(2, ["r"], 4.0, d, fence=True)
    assert core.state("r") is RequestState.LIVE
    core.outputs(2, ["r"], [False], ["new"], 5.0, d)
    assert list(stream._buf) == ["new"]
    core.abort(["r"], d)
    core.aborted(2, ["r"], 6.0, d, fence=True)  # no fence due: not the abort's answer
    for k in range(3):
        core.aborted(k, ["r"], 7.0, d)
    assert core.in_flight == 0


# -- an abort sent twice after a death (tags) ----------------------------------------------------


def _aborted_then_dead(
    replicas: tuple[int, ...], tags: bool = True
) -> tuple[PipelineCore[StreamCore], StreamCore, PipelineDeliveries[StreamCore]]:
    """Stages a, b, c. The caller aborted r; a applied the abort (and chased it on); then
    r's process of b dies (a pool's replica, or the one process of a stage that restarts)
    after it passed the abort on to c, perhaps: r is aborted in c again, from the
    coordinator. c may answer twice: the copy b passed on, then the abort sent after the
    death."""
    restart = [None, RestartPolicy(first_delay=0.1), None] if replicas[1] == 1 else None
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c"], replicas=replicas, restart=restart
    )
    for k, count in enumerate(replicas):
        for r in range(count):
            core.tagged(k, r, tags)
    stream = StreamCore("r")
    core.open("r", stream)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.abort(["r"], d)
    assert d.aborts == ["r"]
    core.aborted(0, ["r"], 1.0, d)
    route = core.route("r")
    assert route is not None
    d = PipelineDeliveries()
    core.replica_dead(1, route[1], EngineDeadError("killed"), 1.1, d)
    assert isinstance(stream._ended and stream._ended.exc, PipelineStageDeadError)
    assert d.stage_aborts == [(2, ["r"])]
    return core, stream, d


@pytest.mark.parametrize("replicas", [(1, 1, 1), (1, 2, 1)], ids=["restart", "pool"])
def test_the_answer_to_an_aborts_copy_before_a_death_does_not_release_the_request(
    replicas: tuple[int, ...],
) -> None:
    # The race: c answers the copy of the caller's abort that b passed on before it died;
    # taken for the confirmation, it would free r at once, while the abort sent to c after
    # the death is still on its way. r's id could then be added again, and that late abort
    # reach c after the new request's data (it comes on another connection) and abort it
    # there, or its answer confirm the new request's own abort early.
    core, _, dead = _aborted_then_dead(replicas)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.aborted(2, ["r"], 1.2, d)  # the answer to the copy b passed on
    assert core.state("r") is RequestState.CLOSING
    assert d.freed == 0
    tag = dead.tags[2, "r"]
    assert tag
    core.aborted(2, ["r"], 1.3, d, tag=tag)  # the answer to the abort sent after the death
    assert core.state("r") is None
    assert d.freed == 1


@pytest.mark.parametrize("replicas", [(1, 1, 1), (1, 2, 1)], ids=["restart", "pool"])
def test_a_late_answer_to_a_freed_ids_abort_does_not_confirm_a_new_request_under_it(
    replicas: tuple[int, ...],
) -> None:
    # Until c answered the abort sent after the death, r's id cannot be added again; then
    # it can. An answer that carries the old abort's tag (none can come by the order of
    # c's answers; a tag is never taken for another's) confirms nothing of the new one.
    core, _, dead = _aborted_then_dead(replicas)
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    if replicas[1] == 1:  # b restarts: started again, routable
        assert core.restarting(1, 0) == 1
        assert core.started(1, 0)
    core.aborted(2, ["r"], 1.2, d)  # the answer to the copy b passed on
    with pytest.raises(ValueError, match="still in the pipeline"):
        core.check(["r"])
    tag = dead.tags[2, "r"]
    core.aborted(2, ["r"], 1.2, d, tag=tag)
    assert core.state("r") is None
    core.check(["r"])
    stream = StreamCore("r")
    core.open("r", stream)
    core.abort(["r"], d)
    core.aborted(2, ["r"], 1.3, d, tag=tag)
    route = core.route("r")
    assert route is not None
    core.aborted(0, ["r"], 1.4, d)
    core.aborted(1, ["r"], 1.4, d, route[1])
    assert core.state("r") is RequestState.ABORTING  # c has not applied the new abort yet
    assert stream._ended is None


def test_a_second_death_on_the_route_supersedes_the_first_ones_tag() -> None:
    # a -> b -> c -> d, b and c pools. r's process of b dies, then its process of c: the
    # abort sent to c after the first death stops at c's dead process; d waits for the
    # answer to the abort sent to it after the second death only.
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c", "d"], replicas=[1, 2, 2, 1])
    for k, count in enumerate([1, 2, 2, 1]):
        for r in range(count):
            core.tagged(k, r, True)
    core.open("r", StreamCore("r"))
    route = core.route("r")
    assert route is not None
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.abort(["r"], d)
    core.aborted(0, ["r"], 1.0, d)
    d = PipelineDeliveries()
    core.replica_dead(1, route[1], EngineDeadError("killed"), 1.1, d)
    first = d.tags[2, "r"]
    d = PipelineDeliveries()
    core.replica_dead(2, route[2], EngineDeadError("killed"), 1.2, d)
    assert d.stage_aborts == [(3, ["r"])]
    second = d.tags[3, "r"]
    assert second != first
    core.aborted(3, ["r"], 1.3, d, tag=first)  # c's dead process had passed the first on
    assert core.state("r") is RequestState.CLOSING
    core.aborted(3, ["r"], 1.4, d, tag=second)
    assert core.state("r") is None


def test_after_a_death_a_stage_of_an_older_build_is_confirmed_by_any_answer() -> None:
    # An older build drops the tag: it answers (and chases) every abort untagged, so the
    # first answer confirms, as before tags (the race stays open with such a stage).
    core, _, d = _aborted_then_dead((1, 2, 1), tags=False)
    assert d.tags == {}
    d = PipelineDeliveries()
    core.aborted(2, ["r"], 1.2, d)
    assert core.state("r") is None


def test_a_request_whose_replicas_die_from_the_last_one_back_is_freed() -> None:
    # r goes through b's replica and then c's. c's dies first: r ends, and every stage but
    # c is to apply its abort. Then b's dies: no stage is left to answer for b or c, and
    # no abort can reach c's dead replica: r is over (it once stayed in for good).
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"], replicas=[1, 2, 2])
    for k, count in enumerate([1, 2, 2]):
        for r in range(count):
            core.tagged(k, r, True)
    core.open("r", StreamCore("r"))
    route = core.route("r")
    assert route is not None
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(2, route[2], EngineDeadError("killed"), 1.0, d)
    assert d.aborts == ["r"]
    core.aborted(0, ["r"], 1.1, d)
    assert core.state("r") is RequestState.CLOSING
    d = PipelineDeliveries()
    core.replica_dead(1, route[1], EngineDeadError("killed"), 1.2, d)
    assert d.stage_aborts == []  # c's replica on its route is dead: nobody to abort there
    assert core.state("r") is None
    assert d.freed == 1


def test_an_abort_after_a_later_death_does_not_chase_into_a_restarted_process() -> None:
    # a -> b -> c -> d, a and c restart. r's process of c dies: r ends, its abort goes from
    # a and (tagged) to d. a and b apply it, so c's new process may be linked in (b will
    # send it nothing of r), and is. Then r's process of a dies: r is aborted again, from
    # b, tagged, and b must not chase that abort into c's new process, which never held r:
    # the copy would go on to d with a tag d is not waited for, and could abort r's id
    # there once r is freed and added again. Its route says so: -1 at c.
    policy = RestartPolicy(first_delay=0.1)
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c", "d"], restart=[policy, None, policy, None]
    )
    for k in range(4):
        core.tagged(k, 0, True)
    core.open("r", StreamCore("r"))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(2, 0, EngineDeadError("killed"), 1.0, d)
    assert d.aborts == ["r"]
    assert d.stage_aborts == [(3, ["r"])]
    assert d.routes["r"] == (0, 0, -1, 0)  # the stage-0 abort stops at b
    first = d.tags[3, "r"]
    assert not core.linkable(2, 0)  # b has not applied r's abort yet
    core.aborted(0, ["r"], 1.1, d)
    core.aborted(1, ["r"], 1.1, d)
    assert core.linkable(2, 0)
    assert core.restarting(2, 0) == 1
    assert core.started(2, 0)
    d = PipelineDeliveries()
    core.replica_dead(0, 0, EngineDeadError("killed"), 1.2, d)
    assert d.stage_aborts == [(1, ["r"])]
    assert d.routes["r"] == (-1, 0, -1, 0)
    second = d.tags[1, "r"]
    assert second != first
    core.aborted(1, ["r"], 1.3, d, tag=second)
    assert core.state("r") is RequestState.CLOSING  # d still owes its answer to the first
    core.aborted(3, ["r"], 1.4, d, tag=first)
    assert core.state("r") is None


def test_a_route_through_a_process_of_an_older_build_is_sent_as_it_is() -> None:
    # An older build (its welcome does not say "tags") refuses -1 in a route: a route
    # through one is sent unchanged, as before (the race stays open with such a stage).
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c"], restart=[None, RestartPolicy(first_delay=0.1), None]
    )
    core.tagged(0, 0, True)
    core.tagged(1, 0, True)
    core.open("r", StreamCore("r"))
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(1, 0, EngineDeadError("killed"), 1.0, d)
    assert d.routes["r"] == (0, 0, 0)
    assert core.restarting(1, 0) == 1
    core.tagged(1, 0, True)  # (the new process's welcome)
    assert core.started(1, 0)
    core.tagged(2, 0, True)  # (were c of this build)
    core.open("q", StreamCore("q"))
    d = PipelineDeliveries()
    core.replica_dead(1, 0, EngineDeadError("killed"), 2.0, d)
    assert d.routes["q"] == (0, -1, 0)


def test_a_replica_death_after_the_pipeline_failed_aborts_what_it_cut_off_again() -> None:
    # c (the whole stage) dies: the pipeline fails, r's abort goes from a's replica on its
    # route. That replica had died already, unheard: when its death is heard, the stage
    # after it gets r's abort again, or b would hold r until the pipeline shuts down.
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"], replicas=[3, 1, 1])
    core.open("r", StreamCore("r"))
    route = core.route("r")
    assert route is not None
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.stage_dead(2, EngineDeadError("killed"), 1.0, d)
    assert d.aborts == ["r"]
    assert core.failure is not None
    d = PipelineDeliveries()
    core.replica_dead(0, route[0], EngineDeadError("killed"), 1.1, d)
    assert d.stage_aborts == [(1, ["r"])]
    assert d.routes["r"] == route
    d = PipelineDeliveries()
    core.replica_dead(0, (route[0] + 1) % 3, EngineDeadError("killed"), 1.2, d)
    assert d.stage_aborts == []  # nothing was routed through another (not the last) one


def _restarting_core(gens: bool) -> PipelineCore[StreamCore]:
    """a -> b[2] -> c, b and c restart; every process of this build (``"tags"``), and
    ``"gens"`` too if *gens*."""
    policy = RestartPolicy(first_delay=0.1)
    core: PipelineCore[StreamCore] = PipelineCore(
        ["a", "b", "c"], replicas=[1, 2, 1], restart=[None, policy, policy]
    )
    for k, count in enumerate(core.replicas):
        for r in range(count):
            core.tagged(k, r, True)
            core.generational(k, r, gens)
    return core


def test_a_route_names_the_generation_of_each_process_of_a_stage_that_restarts() -> None:
    # docs/wire.md section 8, "Restarts": a route, as sent (the rest of it from a stage
    # on), names each process of a stage that restarts as [replica, generation], so that
    # the stage before it tells a request of the process started again from one of the
    # dead process at that index. The generation is the one the request was routed to.
    core = _restarting_core(True)
    core.open("r", StreamCore("r"))
    route = core.route("r")
    assert route is not None
    assert core.wire_route(route, 1) == [[route[1], 0], [0, 0]]
    assert core.wire_route(route, 2) == [[0, 0]]
    assert core.wire_route(route, 0) == [0, [route[1], 0], [0, 0]]  # a does not restart
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.replica_dead(2, 0, EngineDeadError("killed"), 1.0, d)
    assert d.routes["r"] == (0, route[1], -1)
    assert core.wire_route(d.routes["r"], 1) == [[route[1], 0], -1]  # the abort's route
    core.aborted(0, ["r"], 1.1, d)
    core.aborted(1, ["r"], 1.1, d)
    assert core.state("r") is None
    assert core.restarting(2, 0) == 1
    core.tagged(2, 0, True)  # (the new process's welcome)
    core.generational(2, 0, True)
    assert core.started(2, 0)
    core.open("q", StreamCore("q"))
    q = core.route("q")
    assert q is not None
    assert core.wire_route(q, 1) == [[q[1], 0], [0, 1]]  # generation 1 of c
    d = PipelineDeliveries()
    core.abort(["q"], d)
    assert core.wire_route(d.routes["q"], 1) == [[q[1], 0], [0, 1]]


def test_a_route_through_a_process_of_an_older_build_names_no_generation() -> None:
    # An older build (its welcome does not say "gens") would refuse a route entry that is
    # not an int: a route through one is sent as plain replica indexes, as before. So is
    # every route of a pipeline with no stage that restarts.
    core = _restarting_core(True)
    core.open("r", StreamCore("r"))
    route = core.route("r")
    assert route is not None
    core.generational(1, route[1], False)
    assert core.wire_route(route, 1) == [route[1], 0]
    core.generational(1, route[1], True)
    core.generational(0, 0, False)  # a passes the route on: it must take it too
    assert core.wire_route(route, 1) == [route[1], 0]
    assert _restarting_core(False).wire_route((0, 1, 0), 1) == [1, 0]
    pools: PipelineCore[StreamCore] = PipelineCore(["a", "b"], replicas=[1, 2])
    pools.generational(0, 0, True)
    pools.generational(1, 0, True)
    pools.generational(1, 1, True)
    assert pools.wire_route((0, 1), 1) == [1]


def test_adds_aborts_and_links_carry_generations_only_to_processes_that_say_gens() -> None:
    # The coordinator's messages (no I/O: its routing only): the route sent before an add,
    # an abort's routes, and the link of a process started again name generations only to
    # processes whose welcome said "gens".
    import msgspec

    from enginecore.stage._pipelinebase import PipelineBase

    sent: list[tuple[tuple[int, int], object]] = []

    class Replica:  # the coordinator's connection to one process: what it is sent
        def __init__(self, k: int, r: int) -> None:
            self.at = (k, r)

        def _send(self, parts: list[bytes]) -> None:
            sent.append((self.at, msgspec.msgpack.decode(parts[0])))

        def _send_request(self, rid: str, parts: list[bytes], wait: bool) -> None:
            sent.append((self.at, "add"))

    for gens in (True, False):
        sent.clear()
        core = _restarting_core(gens)
        coordinator = object.__new__(PipelineBase)
        coordinator._core = core
        coordinator._replicas = [[Replica(k, r) for r in range(n)] for k, n in enumerate((1, 2, 1))]
        core.open("r", StreamCore("r"))
        route = core.route("r")
        assert route is not None
        coordinator._send_routed(["r"], [], False, None, [])
        coordinator._send_routed_aborts(0, ["r"], {"r": route})
        b = [route[1], 0] if gens else route[1]
        c = [0, 0] if gens else 0
        assert sent == [
            ((0, 0), ["route", ["r"], [[b, c]]]),
            ((0, 0), "add"),
            ((0, 0), ["abort", ["r"], [[b, c]]]),
        ]
    # A link names the new process's generation after its CURVE key ("" without one) when
    # it names one at all, which the coordinator does to a process that said "gens".
    from enginecore.stage._session import ClientSession

    def link(*args: object) -> object:
        return msgspec.msgpack.decode(ClientSession.link_frame(*args)[0])  # type: ignore[arg-type]

    assert link(1, "ipc:///x", "s") == ["link", 1, "ipc:///x", "s"]
    assert link(1, "ipc:///x", "s", "", 2) == ["link", 1, "ipc:///x", "s", "", 2]
    assert link(1, "ipc:///x", "s", "K", 2) == ["link", 1, "ipc:///x", "s", "K", 2]


def test_routing_avoids_an_exited_replica_and_takes_one_only_when_no_other_is_live() -> None:
    # An exited process (its death not reported yet) is taken out of the routing at once;
    # when every live replica of a stage has exited, one of them is taken anyway (the
    # request then ends with the death, as it would have).
    core: PipelineCore[StreamCore] = PipelineCore(["a", "b", "c"], replicas=[1, 3, 1])
    for i in range(6):
        core.open(f"r{i}", StreamCore(f"r{i}"), exited=[(1, 0)])
    assert {core.route(f"r{i}") for i in range(6)} == {(0, 1, 0), (0, 2, 0)}
    core.open("s", StreamCore("s"), exited=[(1, 0), (1, 1), (1, 2)])
    assert core.route("s") == (0, 0, 0)  # the least loaded of those still alive
    core.open_many(["t", "u"], [StreamCore("t"), StreamCore("u")], 0, exited=[(1, 1)])
    assert [core.route("t"), core.route("u")] == [(0, 0, 0), (0, 0, 0)]  # loads 1, 3, 3


# -- a drain: the stages before the first one running have stopped ------------------------------


def test_an_abort_once_the_first_stage_has_drained_goes_to_the_next_stage() -> None:
    # shutdown(drain=...): a has drained and stopped while r runs on in b. The abort goes
    # to b (which chases it to c), and a, which can answer nothing more, counts as applied.
    core = _core("r")
    stream = core._requests["r"].stream
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.stopped(0, 1.0, d)
    assert core.first == 1
    assert d.stage_aborts == []  # nothing was being aborted
    d = PipelineDeliveries()
    core.abort(["r"], d)
    assert d.aborts == []
    assert d.stage_aborts == [(1, ["r"])]
    core.aborted(1, ["r"], 2.0, d)
    assert stream._ended is None  # c has still to apply it
    core.aborted(2, ["r"], 2.0, d)
    assert stream._ended is ABORTED
    assert d.freed == 1
    # Once b has stopped too, an abort goes to c; once every stage has, nowhere.
    core = _core("q")
    for k in (0, 1):
        core.stopped(k, 1.0, PipelineDeliveries())
    d = PipelineDeliveries()
    core.abort(["q"], d)
    assert d.stage_aborts == [(2, ["q"])]


def test_an_abort_the_stopped_stage_never_applied_is_sent_on_from_the_next() -> None:
    # The abort of r reached a after a's drain had ended (a answers nothing more, and
    # chased nothing on): once the coordinator hears that a stopped, b gets it. s's abort,
    # which a applied and chased on, is not sent again.
    core = _core("r", "s", "t")
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.abort(["r", "s"], d)
    assert d.aborts == ["r", "s"]
    core.aborted(0, ["s"], 1.0, d)
    d = PipelineDeliveries()
    core.stopped(0, 2.0, d)
    assert d.stage_aborts == [(1, ["r"])]
    for k in (1, 2):
        core.aborted(k, ["r", "s"], 3.0, d)
    assert core.state("r") is None
    assert core.state("s") is None
    assert core.state("t") is RequestState.LIVE


def test_an_error_whose_replay_would_come_from_a_stopped_stage_ends_the_request() -> None:
    core, stream = _retrying()
    d: PipelineDeliveries[StreamCore] = PipelineDeliveries()
    core.stopped(0, 1.0, d)
    core.error(1, "r", "refused", 2.0, d)  # a cannot replay it: it has stopped
    assert d.replays == []
    assert stream._ended is not None
    exc = stream._ended.exc
    assert isinstance(exc, PipelineRequestError)
    assert exc.message.endswith("refused (not retried: stage 'a' has drained and stopped)")
    assert d.stage_aborts == [(1, ["r"])]  # from b, the first stage still running
