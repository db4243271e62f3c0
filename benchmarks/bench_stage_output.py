"""Output streaming: a stage emitting many outputs per step, read from the ordered event stream.

Every producer is a process started with multiprocessing spawn; the stage and the raw
server stream to the parent over an ipc PUSH -> PULL pair in a private temporary
directory, the mp.Queue stage over its ``multiprocessing.Queue``. Each round streams
``REQUESTS x steps`` outputs; the clock runs from the parent's first send to the moment the
parent holds the last output.

* enginecore: a stage running ``enginecore:CountdownEngine``, launched with
  ``ordered_events=True``. The parent adds ``REQUESTS`` requests of *steps* steps each with
  ``add_many(..., streams=False)``, as a consumer that reads only the ordered event stream
  does, then reads ``client.get_event()`` until it has seen every output. With wire v2 a
  step's outputs are one ``Outputs`` event (routed by the engine's ``route_outputs``, sent
  by the stage's output thread, put by the client's receiver thread, as one event, on the
  ordered event queue); with v1 (a client without ``Outputs``), one ``Output`` event per
  output. Reported beside it, not judged: the same with a stream per request (``add``),
  which the receiver fills too, though this consumer never reads it (what every run
  measured before ``streams=False`` existed).
* baseline: the raw server of ``benchmarks/_stage.py``, one thread, runs the same
  ``CountdownEngine`` to the end and PUSHes each step's outputs as one msgspec-encoded frame
  in the stage's event shape (v2: one ``["outputs", req_ids, finished, remainings]``; v1:
  ``["output", req_id, finished, remaining]`` per output); the parent ``recv``\\ s on its
  PULL, decodes each frame with msgspec and counts the outputs.
* the side a user would write instead: the hand-written mp.Queue stage of
  ``benchmarks/_mpq_stage.py`` running the same ``CountdownEngine``; the parent puts the
  ``REQUESTS`` requests as one message (``add_many(..., streams=False)``: nothing
  registered per request, as on the stage side), and reads the child's step lists (one
  pickled list of ``(req_id, remaining)`` per step) from its queue in order, counting the
  outputs (``MpqStage.read_outputs``).

Rounds are interleaved (the stage's side next to each baseline in every round); the result
is outputs per second. Goals, judged on the lowest per-round ratio: enginecore >= 0.5x raw
(see docs/performance.md for what the stage's two extra thread hand-offs per output cost)
and >= 1.0x the mp.Queue stage, in every round. The cyclic GC is on in every process,
on both sides, as users run (``_harness.gc_on`` in the parent: a ``gc.collect()`` before each
round's clock, so no side pays for the garbage of the one before it).
"""

from __future__ import annotations

import importlib
import time
from itertools import count
from typing import Any

from ._harness import (
    Record,
    Skipped,
    gc_on,
    higher_is_better,
    interleave,
    main_single,
    report_only,
)

NAME = "stage_output"
GOAL = 0.5
GOAL_MPQ = 1.0
REQUESTS = 256  # outputs per step; one raw frame per step, under the stage's 512 cap

_rounds = count()


def columnar() -> bool:
    """Whether ``enginecore.stage`` speaks wire v2 (one ``Outputs`` event per step)."""
    return hasattr(importlib.import_module("enginecore.stage"), "Outputs")


def run_stage(client: Any, steps: int, streams: bool = False) -> float:
    """Outputs per second through a CountdownEngine stage and ``get_event()``; with
    *streams*, each request has a stream too (filled, never read)."""
    stage = importlib.import_module("enginecore.stage")
    outputs_v2 = getattr(stage, "Outputs", None)
    output_v1 = getattr(stage, "Output", None)
    total = REQUESTS * steps
    prefix = f"s{next(_rounds)}-"  # fresh ids: the previous round's streams may linger
    ids = [f"{prefix}{i}" for i in range(REQUESTS)]
    get_event = client.get_event
    with gc_on():
        t0 = time.perf_counter()
        if not streams:
            # This consumer reads the ordered event stream only: a stream per request would
            # buffer every output a second time, unread.
            client.add_many([(rid, steps) for rid in ids], streams=False)
        else:
            for rid in ids:
                client.add(rid, steps)
        seen = 0
        if outputs_v2 is not None:
            while seen < total:
                ev = get_event()
                if ev.__class__ is outputs_v2:
                    seen += len(ev.payloads)
        else:
            while seen < total:
                if get_event().__class__ is output_v1:
                    seen += 1
        t1 = time.perf_counter()
    return total / (t1 - t0)


def run_raw(peer: Any, steps: int) -> float:
    """Outputs per second from the raw one-thread producer to a PULL in this process."""
    import zmq

    total = REQUESTS * steps
    recv, decode = peer.pull.recv, peer.decode
    v2 = columnar()
    with gc_on():
        t0 = time.perf_counter()
        peer.dealer.send(peer.encode(("stream", REQUESTS, steps, v2)))
        seen = 0
        # A recv that waited LIVENESS_MS for a frame finishes in RawPeer.wait: a dead
        # peer fails the run instead of hanging it.
        if v2:
            while seen < total:
                try:
                    frame = recv()
                except zmq.Again:
                    frame = peer.wait(recv)
                seen += len(decode(frame)[0][3])
        else:
            while seen < total:
                try:
                    frame = recv()
                except zmq.Again:
                    frame = peer.wait(recv)
                seen += len(decode(frame))
        t1 = time.perf_counter()
    return total / (t1 - t0)


def run_mpq(stage: Any, steps: int) -> float:
    """Outputs per second from the hand-written mp.Queue stage, its step lists read in order
    and counted."""
    total = REQUESTS * steps
    prefix = f"m{next(_rounds)}-"
    items = [(f"{prefix}{i}", steps) for i in range(REQUESTS)]
    with gc_on():
        t0 = time.perf_counter()
        stage.add_many(items, streams=False)
        seen = stage.read_outputs(total)
        t1 = time.perf_counter()
    assert seen == total, (seen, total)
    return total / (t1 - t0)


def run(quick: bool) -> list[Record]:
    try:
        from enginecore.stage import StageClient

        from ._mpq_stage import MpqStage
        from ._stage import RawPeer
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    steps, rounds = (40, 3) if quick else (400, 7)
    with (
        StageClient.launch("enginecore:CountdownEngine", ordered_events=True) as client,
        RawPeer() as peer,
        MpqStage() as stage,
    ):
        # The stage's side sits between its two baselines: next to each in every round.
        res = interleave(
            {
                "streams": lambda: run_stage(client, steps, streams=True),
                "raw": lambda: run_raw(peer, steps),
                "loop": lambda: run_stage(client, steps),
                "mpq": lambda: run_mpq(stage, steps),
            },
            rounds=rounds,
        )
    return [
        higher_is_better(
            f"stage output stream, {REQUESTS} requests x {steps} steps",
            res["loop"],
            res["raw"],
            "msgs/s",
            GOAL,
            note="requests added without streams, read from the ordered event stream; GC on",
        ),
        higher_is_better(
            f"stage output stream vs mp.Queue stage, {REQUESTS} requests x {steps} steps",
            res["loop"],
            res["mpq"],
            "msgs/s",
            GOAL_MPQ,
            note="baseline: the hand-written mp.Queue stage, one put of the requests, its "
            "step lists read in order; GC on",
        ),
        report_only(
            higher_is_better(
                f"stage output stream, {REQUESTS} requests x {steps} steps, a stream per "
                "request too",
                res["streams"],
                res["raw"],
                "msgs/s",
                GOAL,
                note="every output also buffered in its request's stream, never read; GC on",
            )
        ),
    ]


if __name__ == "__main__":
    main_single(run, __doc__)
