"""What ZeroMQ CURVE costs a stage over TCP: utility round trip and 16 MiB arrays, with and without.

Two headless stages (``python -m enginecore serve``, the ``echo`` engine of
``enginecore.stage.testing``) run side by side on loopback TCP, as they would between hosts
(TCP is TCP; only the wire's latency differs): one plain (``--bind tcp://127.0.0.1:*``), one
with CURVE (``--curve-secret-key``, ``--authorized-clients``: encrypted frames, and a ZAP
handler that checked the client's key once, at connect). A ``StageClient`` connects to each,
the second with ``curve=CurveKeys.load(...)``; the keys are made for the run by
``enginecore.stage._curve.keygen`` in a temporary directory.

* **utility round trip**: back-to-back ``call_utility("echo")`` (a closed loop, one call in
  flight), timed with ``perf_counter_ns`` in the parent; blocks of samples alternate (A B,
  B A, ...). p50 and p99 per side; goal: CURVE <= 1.2x plain at p50 in every block (p99 is
  reported, no goal). CURVE adds one XSalsa20-Poly1305 box per
  frame on each side (docs/performance.md has the numbers and a bare pyzmq comparison).
* **16 MiB array round trip**: ``client.add(rid, {"a": arr})`` then ``collect()``: 4 Mi
  float32 to the stage and back, checked outside the clock; GB/s of payload counting both
  directions. Reported, no goal: here CURVE encrypts and authenticates every byte twice
  (once each way) on libzmq's IO threads.

The cyclic GC is on everywhere (``_harness.gc_on`` in the parent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._harness import Record, Skipped, gc_on, higher_is_better, interleave, main_single
from .bench_wake_latency import latency_records

NAME = "stage_curve"
GOAL = 1.2
ELEMENTS = 4 << 20  # float32: 16 MiB
ECHO = "enginecore.stage.testing:echo"


@contextlib.contextmanager
def served(*args: str, engine: str = ECHO) -> Iterator[str]:
    """A ``serve`` process of *engine* with *args*; yields its input address; stops it after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "enginecore", "serve", "--engine", engine, "--bind",
         "tcp://127.0.0.1:*", "--step-timeout", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"listening on (\S+)", line)
        if match is None:
            raise RuntimeError(f"serve did not start: {line!r}")
        yield match.group(1)
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def stages() -> Iterator[tuple[Any, Any]]:
    """``(plain client, CURVE client)``, each attached to a stage of its own."""
    try:
        from enginecore.stage import CurveKeys, StageClient
        from enginecore.stage._curve import keygen
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    with tempfile.TemporaryDirectory(prefix="ec-curve-") as tmp:
        root = Path(tmp)
        stage_public, stage_secret = keygen(root / "stage", "stage")
        keygen(root / "clients", "bench")
        keys = CurveKeys.load(root / "clients" / "bench.key_secret", stage_public)
        clients = str(root / "clients")
        curve_args = ("--curve-secret-key", stage_secret, "--authorized-clients", clients)
        with (
            served() as plain_address,
            served(*curve_args) as curve_address,
            StageClient.connect(plain_address) as plain,
            StageClient.connect(curve_address, curve=keys) as curve,
        ):
            yield plain, curve
            with contextlib.suppress(Exception):
                plain.shutdown()
            with contextlib.suppress(Exception):
                curve.shutdown()


def sample_utility(client: Any, n: int) -> list[float]:
    """*n* back-to-back ``call_utility("echo", 1)`` round trips, in µs."""
    call = client.call_utility
    clock = time.perf_counter_ns
    out: list[float] = []
    for _ in range(n):
        t0 = clock()
        call("echo", 1)
        out.append((clock() - t0) / 1e3)
    return out


def utility_records(plain: Any, curve: Any, samples: int, blocks: int) -> list[Record]:
    sides = {"loop": curve, "raw": plain}  # latency_records' names: judged, baseline
    per_block: dict[str, list[list[float]]] = {n: [] for n in sides}
    for client in sides.values():
        sample_utility(client, 100)  # warm-up
    names = list(sides)
    for i in range(blocks):
        for name in names if i % 2 == 0 else names[::-1]:
            with gc_on():
                per_block[name].append(sample_utility(sides[name], samples))
    pooled = {n: [x for block in per_block[n] for x in block] for n in names}
    records = latency_records(
        "utility round trip over TCP, CURVE vs plain", pooled, per_block, GOAL
    )
    p50, p99 = (dataclasses.replace(r, note=f"{r.note}; GC on") for r in records)
    return [p50, as_report(p99)]  # the goal is on p50; p99 is for the record


def as_report(rec: Record) -> Record:
    """*rec* without a goal: reported only."""
    note = f"{rec.note}; reported, not judged (no goal)"
    return dataclasses.replace(rec, goal="report", met=True, per_round=(), note=note)


def array_record(plain: Any, curve: Any, rounds: int) -> Record:
    import numpy as np

    arr = np.arange(ELEMENTS, dtype=np.float32)
    ids = iter(range(1 << 30))

    def round_trip(client: Any) -> float:
        rid = f"a{next(ids)}"
        with gc_on():
            t0 = time.perf_counter()
            (back,) = client.add(rid, {"a": arr}).collect()
            elapsed = time.perf_counter() - t0
        got = back["a"]
        assert got.dtype == arr.dtype
        assert np.array_equal(got, arr)  # outside the clock
        return 2 * arr.nbytes / elapsed / 1e9

    out = interleave(
        {"curve": lambda: round_trip(curve), "plain": lambda: round_trip(plain)}, rounds
    )
    rec = higher_is_better(
        "16 MiB array round trip over TCP, CURVE vs plain",
        out["curve"],
        out["plain"],
        "GB/s",
        0.0,
        note=f"{rounds} rounds, both directions counted; GC on",
    )
    return as_report(rec)


def run(quick: bool) -> list[Record]:
    samples, blocks, rounds = (150, 4, 4) if quick else (1000, 10, 20)
    with stages() as (plain, curve):
        records = utility_records(plain, curve, samples, blocks)
        records.append(array_record(plain, curve, rounds))
    return records


if __name__ == "__main__":
    main_single(run, __doc__)
