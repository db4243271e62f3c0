"""Array round trip: a 16 MiB float32 array client -> engine -> client, vs raw pyzmq and mp.Queue.

Each sample moves one ``numpy`` array of ``4 Mi`` float32 (16 MiB) to the peer process and
back, one at a time; the clock runs from the send to the moment the parent holds the array
that came back. The metric is GB/s of payload moved, counting both directions
(``2 * 16 MiB`` per round trip). All three peers are processes started with
multiprocessing spawn and stay up for the whole run:

* enginecore: a stage running ``benchmarks._stage:EchoEngine`` (its one output per request
  is the ``(req_id, data)`` it was added with; default pair routing, ``is_finished`` always
  true). ``client.add(rid, arr)`` then ``collect()`` of the request's stream, whose one
  payload is the array (the wire carries it out of band, ``docs/wire.md``).
* baseline 1: the raw server of ``benchmarks/_stage.py`` as a zero-copy echo: the parent
  sends ``[msgspec header (dtype, shape), array]`` with ``send_multipart(copy=False)`` on a
  DEALER; the server ``recv_multipart(copy=False)``\\ s on its ROUTER and sends the same
  frames back with ``copy=False``; the parent rebuilds the array with ``np.frombuffer``.
  The physical floor of moving the bytes over ipc.
* baseline 2: the mp.Queue stage of ``benchmarks/_mpq_stage.py`` running the same
  ``EchoEngine``: the array is pickled into one ``multiprocessing.Queue`` and its echo
  pickled back through the other (``MpqStage.echo``).

Every round checks that the array that came back has the shape, dtype and values sent
(outside the clock). Rounds are interleaved. Goals: enginecore >= 0.7x raw pyzmq and >= 2x
the mp.Queue stage, in every round (judged on the lowest per-round ratio). The cyclic GC is
on in every process, on both sides, as users run (``_harness.gc_on`` in the parent). The
stage carries numpy arrays since wire protocol v2: one it refuses fails the run (it used to
skip the script, which hid the regression).
"""

from __future__ import annotations

import time
from itertools import count
from typing import Any

from ._harness import Record, Skipped, gc_on, higher_is_better, interleave, main_single

NAME = "stage_arrays"
ELEMENTS = 4 << 20  # float32: 16 MiB
GOAL_RAW = 0.7
GOAL_MPQ = 2.0

_ids = count()


def make_array() -> Any:
    import numpy as np

    return np.arange(ELEMENTS, dtype=np.float32)


def _check(out: Any, arr: Any) -> None:
    import numpy as np

    assert isinstance(out, np.ndarray), type(out)
    assert (out.shape, out.dtype) == (arr.shape, arr.dtype), (out.shape, out.dtype)
    assert np.array_equal(out, arr)


def _gbps(arr: Any, trips: int, seconds: float) -> float:
    return float(2 * arr.nbytes * trips / seconds / 1e9)


def trip_stage(client: Any, arr: Any, trips: int) -> float:
    """GB/s through the EchoEngine stage: ``add(rid, arr)``, then its stream's one output."""
    rids = [f"a{next(_ids)}" for _ in range(trips)]
    add = client.add
    out = None
    with gc_on():
        t0 = time.perf_counter()
        for rid in rids:
            (out,) = add(rid, arr).collect()
        t1 = time.perf_counter()
    _check(out, arr)
    return _gbps(arr, trips, t1 - t0)


def trip_raw(peer: Any, arr: Any, trips: int) -> float:
    """GB/s through the raw zero-copy echo: a header frame and the array's buffer."""
    import numpy as np
    import zmq

    send, recv = peer.dealer.send_multipart, peer.dealer.recv_multipart
    encode, decode = peer.encode, peer.decode
    out = None
    with gc_on():
        t0 = time.perf_counter()
        for _ in range(trips):
            send([encode(("echo", arr.dtype.str, arr.shape)), arr], copy=False)
            try:
                head, buf = recv(copy=False)
            except zmq.Again:  # no answer for a while: a dead peer fails the run
                head, buf = peer.wait(lambda: recv(copy=False))
            _, dtype, shape = decode(head.buffer)
            out = np.frombuffer(buf.buffer, dtype=dtype).reshape(shape)
        t1 = time.perf_counter()
    _check(out, arr)
    return _gbps(arr, trips, t1 - t0)


def trip_mpq(stage: Any, arr: Any, trips: int) -> float:
    """GB/s through the mp.Queue stage: the array pickled there and back."""
    rids = [f"m{next(_ids)}" for _ in range(trips)]
    echo = stage.echo
    out = None
    with gc_on():
        t0 = time.perf_counter()
        for rid in rids:
            out = echo(rid, arr)
        t1 = time.perf_counter()
    _check(out, arr)
    return _gbps(arr, trips, t1 - t0)


def measure(rounds: int, trips: int) -> dict[str, list[float]]:
    """Launch the three peers and run *rounds* interleaved rounds of *trips* round trips."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise Skipped("needs numpy (pip install -e '.[bench]')") from None
    try:
        from enginecore.stage import StageClient

        from ._mpq_stage import MpqStage
        from ._stage import ECHO_FACTORY, EchoEngine, RawPeer
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    arr = make_array()
    with StageClient.launch(ECHO_FACTORY) as client:
        (out,) = client.add("probe", arr).collect(timeout=60)  # a warm-up trip, checked
        _check(out, arr)
        with RawPeer(zero_copy=True) as peer, MpqStage(EchoEngine) as stage:
            return interleave(
                {
                    "loop": lambda: trip_stage(client, arr, trips),
                    "raw": lambda: trip_raw(peer, arr, trips),
                    "mpq": lambda: trip_mpq(stage, arr, trips),
                },
                rounds=rounds,
            )


def run(quick: bool) -> list[Record]:
    rounds, trips = (2, 1) if quick else (7, 3)
    res = measure(rounds, trips)
    label = f"stage array round trip, {ELEMENTS * 4 >> 20} MiB float32"
    return [
        higher_is_better(
            label, res["loop"], res["raw"], "GB/s", GOAL_RAW,
            note="baseline: raw pyzmq echo, copy=False; GB/s counts both directions; GC on",
        ),
        higher_is_better(
            f"{label} vs mp.Queue stage", res["loop"], res["mpq"], "GB/s", GOAL_MPQ,
            note="baseline: the mp.Queue stage (pickle); GC on",
        ),
    ]  # fmt: skip


if __name__ == "__main__":
    main_single(run, __doc__)
