"""Utility round trip through a launched stage vs a raw zmq echo and an mp.Queue stage, p50/p99.

All three peers are processes started with multiprocessing spawn (the first two talk over ipc
sockets in a private temporary directory). Each sample is one blocking call, timed with
``perf_counter_ns()`` in the parent, back to back (a closed loop, one call in flight):

* enginecore: ``StageClient.call_utility("count")`` on a stage running
  ``benchmarks._stage:SinkEngine`` (a trivial utility; the engine never has work, so the
  loop is idle, blocked in ``get()``). The path: the caller encodes and sends on the DEALER
  -> the idle loop thread, which reads the input socket itself while idle, decodes it,
  calls ``engine.utility`` and sends the answer on the PUSH itself while the output thread
  idles -> the caller, which reads the output socket itself while no other call does,
  decodes it. One thread on each side, as in the raw echo; the stage's Python (decoding
  into typed messages, the loop's dispatch, the session) is what it adds.
* baseline: the raw server of ``benchmarks/_stage.py``, one thread: ``recv`` on its ROUTER,
  msgspec decode, encode a reply, ``send`` on the same ROUTER; the parent encodes, sends on
  its DEALER, blocks in ``recv`` and decodes. msgspec encode + decode per message on both
  ends, no extra thread on either side.
* baseline 2: the mp.Queue stage of ``benchmarks/_mpq_stage.py`` (what a user writes by hand
  instead of enginecore) running the same ``SinkEngine``: ``MpqStage.call("count")`` puts
  the call on one ``multiprocessing.Queue`` and blocks on the other for the answer; the
  child, blocked in ``get()``, calls ``engine.utility`` and puts the answer.

Blocks of samples alternate (A B C, C B A, ...); p50 and p99 over all samples of each side;
the ``±`` is the half-range of the per-block percentiles. Goals: enginecore <= 1.5x raw zmq
at p50 and at p99 (docs/performance.md says what the stage adds, and where the time goes),
and <= 1.0x the mp.Queue stage at p50 and at p99, each in every block: the ratio shown is the
median of the per-block ratios (block *i* of each side ran next to the others'), and the
verdict is the highest one.

The cyclic GC is **on** in every process, on both sides, as users run: the peers never touch
it, and the parent runs each block under ``_harness.gc_on`` (a ``gc.collect()`` before the
block, so no side pays for garbage the one before it left).

For the why, the notes also give each side's CPU time per call, summed over its blocks: in
its peer process (all threads, from the kernel's CPU clock of that process, as
``bench_stage_requests`` reads it) and in this process (``time.process_time()``, all
threads). In a closed loop the two ends run one after the other, so CPU that one side adds
over another adds to its round trip.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

from ._harness import Record, Skipped, gc_on, main_single
from .bench_stage_requests import process_cpu
from .bench_wake_latency import latency_records

NAME = "stage_utility"
GOAL = 1.5
GOAL_MPQ = 1.0


def sample_calls(call: Callable[[str], object], n: int) -> list[float]:
    """*n* back-to-back blocking ``call("count")`` round trips, in µs."""
    clock = time.perf_counter_ns
    out: list[float] = []
    for _ in range(n):
        t0 = clock()
        call("count")
        out.append((clock() - t0) / 1e3)
    return out


def sample_stage(client: object, n: int) -> list[float]:
    """*n* back-to-back ``call_utility`` round trips, in µs."""
    from enginecore.stage import StageClient

    assert isinstance(client, StageClient)
    return sample_calls(client.call_utility, n)


def sample_raw(peer: object, n: int) -> list[float]:
    """*n* back-to-back raw echo round trips, in µs."""
    import zmq

    from ._stage import RawPeer

    assert isinstance(peer, RawPeer)
    send, recv = peer.dealer.send, peer.dealer.recv
    encode, decode = peer.encode, peer.decode
    clock = time.perf_counter_ns
    out: list[float] = []
    for i in range(n):
        t0 = clock()
        send(encode(("utility", i, "count", [])))
        try:
            decode(recv())
        except zmq.Again:  # no answer for a while: a dead peer fails the run (RawPeer.wait)
            decode(peer.wait(recv))
        out.append((clock() - t0) / 1e3)
    return out


def sample_mpq(stage: object, n: int) -> list[float]:
    """*n* back-to-back utility round trips through the mp.Queue stage, in µs."""
    from ._mpq_stage import MpqStage

    assert isinstance(stage, MpqStage)
    return sample_calls(stage.call, n)


class Measured(NamedTuple):
    """Every sample of each side, its samples per block, and its CPU µs per call (peer
    process, this process)."""

    pooled: dict[str, list[float]]
    per_block: dict[str, list[list[float]]]
    cpu: dict[str, tuple[float, float]]


def measure(samples: int, blocks: int) -> Measured:
    """Alternate blocks of *samples* round trips per side.

    The sides are ``loop`` (enginecore), ``raw`` (the zmq echo) and ``mpq`` (the mp.Queue
    stage).
    """
    try:
        from enginecore.stage import StageClient

        from ._mpq_stage import MpqStage
        from ._stage import SINK_FACTORY, RawPeer, SinkEngine
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    with (
        StageClient.launch(SINK_FACTORY) as client,
        RawPeer() as peer,
        MpqStage(SinkEngine) as stage,
    ):
        sides: dict[str, Callable[[int], list[float]]] = {
            "loop": lambda n: sample_stage(client, n),
            "raw": lambda n: sample_raw(peer, n),
            "mpq": lambda n: sample_mpq(stage, n),
        }
        assert peer.process.pid is not None  # both started
        assert stage.process.pid is not None
        peer_cpu = {
            "loop": process_cpu(client.pid),
            "raw": process_cpu(peer.process.pid),
            "mpq": process_cpu(stage.process.pid),
        }
        names = list(sides)
        per_block: dict[str, list[list[float]]] = {n: [] for n in names}
        used = {n: [0.0, 0.0] for n in names}
        for side in sides.values():
            side(50)  # warm-up
        for i in range(blocks):
            for name in names if i % 2 == 0 else names[::-1]:
                with gc_on():
                    c0, p0 = peer_cpu[name](), time.process_time()
                    per_block[name].append(sides[name](samples))
                    used[name][0] += peer_cpu[name]() - c0
                    used[name][1] += time.process_time() - p0
    pooled = {n: [x for block in per_block[n] for x in block] for n in names}
    calls = samples * blocks
    cpu = {n: (used[n][0] * 1e6 / calls, used[n][1] * 1e6 / calls) for n in names}
    return Measured(pooled, per_block, cpu)


def cpu_note(cpu: dict[str, tuple[float, float]]) -> str:
    """The CPU per call of every side, for the records' notes."""
    sides = (("enginecore", "loop"), ("raw", "raw"), ("mp.Queue", "mpq"))
    per_side = ", ".join(f"{label} {cpu[n][0]:.1f} / {cpu[n][1]:.1f}" for label, n in sides)
    return f"CPU µs per call, peer / parent: {per_side}"


def run(quick: bool) -> list[Record]:
    samples, blocks = (150, 4) if quick else (500, 10)
    m = measure(samples, blocks)
    pooled, per_block = m.pooled, m.per_block
    vs_mpq = latency_records(
        "stage utility round trip vs mp.Queue stage",
        {"loop": pooled["loop"], "raw": pooled["mpq"]},
        {"loop": per_block["loop"], "raw": per_block["mpq"]},
        GOAL_MPQ,
    )
    records = latency_records("stage utility round trip", pooled, per_block, GOAL) + vs_mpq
    note = cpu_note(m.cpu)
    return [dataclasses.replace(r, note=f"{r.note}; GC on; {note}") for r in records]


if __name__ == "__main__":
    main_single(run, __doc__)
