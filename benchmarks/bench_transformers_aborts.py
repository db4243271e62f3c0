"""Aborts on a real engine: 2,000 requests (200 with ``--quick``), 30 % aborted mid-stream.

A launched stage runs ``TransformersEngine`` on a tiny random Llama (``make_random_model``).
Requests go in waves of 64 (prompts 8-32 tokens, 8-32 new tokens, from a fixed seed); of
each wave, a fixed 30 % are aborted as soon as their first output has arrived. Every stream
must end, finished or aborted, within 60 s of its wave; the stage's resident memory is read
from ``/proc`` after a warm-up wave and again at the end, and the engine's ``kv_usage``
(its ``stats()``, through ``client.stats()``) once the last stream has ended.

Goals (issue 21): 0 streams lost, ``kv_usage`` back to 0, the stage's RSS within ±10 %.
There is no baseline to run beside it: the line is absolute (the baseline column is the
ideal).
"""

from __future__ import annotations

import random
import tempfile
import time
from typing import Any

from ._harness import Record, Skipped, main_single

NAME = "transformers_aborts"
WAVE = 64
ABORTED = 0.3


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _wave(client: Any, rng: random.Random, prefix: str) -> tuple[int, int]:
    """One wave; returns (streams that did not end in time, streams aborted)."""
    streams = []
    doomed = []
    for i in range(WAVE):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(8, 32))]
        rid = f"{prefix}{i}"
        streams.append(client.add(rid, {"prompt": prompt, "max_tokens": rng.randint(8, 32)}))
        if rng.random() < ABORTED:
            doomed.append(streams[-1])
    for stream in doomed:
        try:
            stream.get(timeout=60)  # its first output: it is mid-stream now
        except StopIteration:
            continue  # finished in one step
        client.abort([stream.req_id])
    lost = aborted = 0
    deadline = time.monotonic() + 60
    for stream in streams:
        try:
            stream.collect(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            lost += 1
            continue
        aborted += stream.aborted
    return lost, aborted


def run(quick: bool) -> list[Record]:
    try:
        import transformers  # noqa: F401

        from enginecore.engines.transformers import make_random_model
        from enginecore.stage import StageClient
    except ImportError as exc:
        raise Skipped(
            f"needs torch and transformers (pip install -e '.[transformers]'): {exc}"
        ) from None
    waves = 3 if quick else 31  # + one warm-up wave: 256 or 2,048 requests in all
    rng = random.Random(21)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_model(tmp, hidden_size=64, layers=2, vocab=512)
        engine = "enginecore.engines.transformers:TransformersEngine"
        with StageClient.launch(engine, {"model": path}) as client:
            _wave(client, rng, "warm-")
            rss0 = _rss_kib(client.pid)
            lost = aborted = 0
            t0 = time.perf_counter()
            for w in range(waves):
                wave_lost, wave_aborted = _wave(client, rng, f"w{w}-")
                lost += wave_lost
                aborted += wave_aborted
            took = time.perf_counter() - t0
            kv = float(client.stats().engine.get("kv_usage", -1.0))
            rss1 = _rss_kib(client.pid)
    n = waves * WAVE
    growth = 100.0 * (rss1 - rss0) / rss0
    note = (
        f"{n} requests, {aborted} aborted mid-stream, in {took:.1f} s; "
        f"stage RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB; judged on this one run"
    )
    return [
        _line("streams lost", float(lost), "streams", "<= 0 streams", lost == 0, note),
        _line("kv_usage at the end", abs(kv), "of the budget", "<= 0 (all freed)", kv == 0.0, note),
        _line(
            "stage RSS change",
            abs(growth),
            "%",
            "<= 10 % (either way)",
            abs(growth) <= 10.0,
            f"{growth:+.1f} %; " + note,
        ),
    ]


def _line(name: str, value: float, unit: str, goal: str, met: bool, note: str) -> Record:
    """A record against an absolute line: one run, the ideal (0) as its baseline."""
    return Record(
        name=f"aborts on a real engine: {name}",
        value=value,
        unit=unit,
        baseline=0.0,
        ratio=float("nan"),
        goal=goal,
        met=met,
        note=note,
        per_round=(value,),
        per_round_unit=unit,
    )


if __name__ == "__main__":
    main_single(run, __doc__)
