"""Request ingest: ``client.add`` of N requests into a stage vs raw msgspec messages on a DEALER,
and vs the hand-written mp.Queue stage.

Every receiver is a process started with multiprocessing spawn; the stage and the raw
server are reached over an ipc DEALER -> ROUTER pair in a private temporary directory (the
socket types of a stage's input), the mp.Queue stage over its ``multiprocessing.Queue``.
The parent sends N ``add`` messages as fast as it can, fire and forget, then one barrier
message whose answer says how many adds were applied; the clock runs from the first send to
the barrier's answer.

* enginecore: ``client.add(req_id, 1)`` N times, then ``client.call_utility("count")``, on a
  stage running ``benchmarks._stage:SinkEngine`` (``add`` only counts; the engine never has
  work, so nothing is emitted). Per add, the client checks and encodes the frame and
  registers a ``RequestStream``; the stage's input thread decodes and validates it and puts
  an ``Add`` on ``input_queue``; the loop thread drains it and calls ``engine.add``. The
  barrier's answer comes back through the output thread and the client's receiver thread.
  (After the clock stops, the requests are aborted so the next round starts clean.)
* baseline: ``dealer.send(msgspec.msgpack.encode(("add", req_id, 1)))`` N times, then a
  ``count`` round trip, against the raw one-thread server of ``benchmarks/_stage.py``,
  which decodes each frame with msgspec and counts it.
* the side a user would write instead: the hand-written mp.Queue stage of
  ``benchmarks/_mpq_stage.py`` with the same ``SinkEngine``: ``stage.add(req_id, 1)`` N
  times (one ``put`` each; the parent keeps a list and a set entry per request, as the
  client keeps a stream), then ``stage.call("count")``, a utility round trip through the
  queues. (After the clock stops, that bookkeeping is dropped.)

Every side checks that the barrier's answer is N. Rounds are interleaved (the stage's side
next to each baseline in every round); the result is adds per second. Goals, judged on the
lowest per-round ratio: enginecore >= 0.5x raw (see docs/performance.md) and >= 1.0x the
mp.Queue stage, in every round. The cyclic GC is on in every process, on every side, as
users run (``_harness.gc_on`` in the parent).
"""

from __future__ import annotations

import time
from itertools import count
from typing import Any

from ._harness import Record, Skipped, gc_on, higher_is_better, interleave, main_single

NAME = "stage_ingest"
GOAL = 0.5
GOAL_MPQ = 1.0

_rounds = count()


def _ids(n: int) -> list[str]:
    prefix = f"i{next(_rounds)}-"
    return [f"{prefix}{i}" for i in range(n)]


def run_stage(client: Any, n: int) -> float:
    """Adds per second through ``StageClient.add`` into a SinkEngine stage."""
    ids = _ids(n)
    add = client.add
    with gc_on():
        t0 = time.perf_counter()
        for rid in ids:
            add(rid, 1)
        got = client.call_utility("count")
        t1 = time.perf_counter()
    assert got == n, (got, n)
    # The streams of these requests never end by themselves; an abort ends them (outside the
    # clock), and the barrier makes sure the client has dropped them before the next round.
    client.abort(ids)
    client.call_utility("count")
    return n / (t1 - t0)


def run_raw(peer: Any, n: int) -> float:
    """Adds per second as raw msgspec frames on a DEALER into the one-thread server."""
    import zmq

    ids = _ids(n)
    send, encode = peer.dealer.send, peer.encode
    with gc_on():
        t0 = time.perf_counter()
        for rid in ids:
            frame = encode(("add", rid, 1))
            try:
                send(frame)
            except zmq.Again:  # blocked a while: a dead peer fails the run (RawPeer.wait)
                peer.wait(lambda: send(frame))  # noqa: B023 - called at once
        got = peer.call(("count", 1))[2]
        t1 = time.perf_counter()
    assert got == n, (got, n)
    return n / (t1 - t0)


def run_mpq(stage: Any, n: int) -> float:
    """Adds per second through the hand-written mp.Queue stage: one put per add."""
    ids = _ids(n)
    add = stage.add
    with gc_on():
        t0 = time.perf_counter()
        for rid in ids:
            add(rid, 1)
        got = stage.call("count")
        t1 = time.perf_counter()
    assert got == n, (got, n)
    stage.forget(ids)  # a SinkEngine never ends them; outside the clock
    return n / (t1 - t0)


def run(quick: bool) -> list[Record]:
    try:
        from enginecore.stage import StageClient

        from ._mpq_stage import MpqStage
        from ._stage import SINK_FACTORY, RawPeer, SinkEngine
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    n, rounds = (10_000, 3) if quick else (100_000, 7)
    with (
        StageClient.launch(SINK_FACTORY) as client,
        RawPeer() as peer,
        MpqStage(SinkEngine) as stage,
    ):
        # The stage's side sits between its two baselines: next to each in every round.
        res = interleave(
            {
                "raw": lambda: run_raw(peer, n),
                "loop": lambda: run_stage(client, n),
                "mpq": lambda: run_mpq(stage, n),
            },
            rounds=rounds,
        )
    return [
        higher_is_better(
            f"stage ingest, {n} adds", res["loop"], res["raw"], "msgs/s", GOAL, note="GC on"
        ),
        higher_is_better(
            f"stage ingest vs mp.Queue stage, {n} adds",
            res["loop"],
            res["mpq"],
            "msgs/s",
            GOAL_MPQ,
            note="baseline: the hand-written mp.Queue stage, one put per add; GC on",
        ),
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
