"""Four separate pools over four shared replicas (issue 18's "4 clients x 4 replicas", with
the clients really separate): does routing on the stages' load reports keep the replicas
balanced when no pool sees the others' requests directly?

Four headless device-engine stages (``python -m enginecore serve --engine
enginecore.stage.testing:device --max-clients 4``: 5 ms a step, the GIL released, every
live request one output a step) and four ``StagePool.connect`` pools over all four, in
this process. The load is ``bench_pool_faults``'s closed loop: each client keeps ``SLOTS``
requests outstanding, lengths drawn from an exponential distribution (mean ``MEAN_LEN``
outputs, at least 1), every output read and checked. A sampler reads each replica's
outstanding count every ``SAMPLE_S``: the sum over the pools of ``replica.in_flight``
(each pool's count is exact for its own requests).

Sides, alternated in each round:

- **4 pools**: 4 clients, one pool each (``SLOTS`` threads per pool). A pool sees the
  others only through each replica's load report (``live`` minus its own), at most a load
  interval old: ``serve``'s default for a stage with ``--max-clients`` above 1, 5 ms (one
  device step: a report on every step's outputs). The goal is judged on this side: no flag.
- **4 pools, reports every 50 ms**: the same on four other stages served with
  ``--load-interval 0.05`` (the one-client default, and every stage's before issue 18's
  fix: 10 device steps).
- **1 pool** (the measurement issue 18 recorded before stages took several clients): the
  same 4 x ``SLOTS`` threads on one pool over the first four stages, which counts every
  request exactly.

Judged per round, as ``bench_pool_faults`` (a): the time-averaged max/mean outstanding over
the 4 replicas, goal <= 1.25; and the samples with a replica idle while another has > 2
outstanding, goal 0. GC on in every process.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import count
from typing import Any

from ._harness import Record, Skipped, gc_on, interleave, main_single, report_only
from .bench_pool_faults import (
    CLIENTS,
    DEVICE,
    GOAL_BALANCE,
    MEAN_LEN,
    REPLICAS,
    SAMPLE_S,
    SLOTS,
    Load,
    Sample,
    _absolute,
    _window,
    balance,
)

NAME = "pool_shared"


class _Member(Load):
    """One pool's share of the load, without a sampler of its own (:class:`Shared` samples
    every pool at once)."""

    def _sample(self) -> None:
        return


class Shared:
    """The load of ``len(pools)`` clients, one per pool, and one sampler over them all;
    replicas are matched across pools by address."""

    def __init__(self, pools: list[Any], *, clients_per_pool: int, seed: int) -> None:
        self.pools = pools
        self.loads = [
            _Member(p, clients=clients_per_pool, slots=SLOTS, seed=seed * 17 + i)
            for i, p in enumerate(pools)
        ]
        self.samples: list[Sample] = []

    def sample_until(self, until: float) -> None:
        replicas = [r for p in self.pools for r in p.replicas]
        while time.monotonic() < until:
            counts: dict[str, int] = {}
            for r in replicas:
                counts[r.address] = counts.get(r.address, 0) + r.in_flight
            self.samples.append(Sample(time.monotonic(), counts, {}, {}))
            time.sleep(SAMPLE_S)

    def run(self, seconds: float, warm: float) -> tuple[list[Sample], float, float, int]:
        with gc_on(), contextlib.ExitStack() as stack:
            for load in self.loads:
                stack.enter_context(load)
            time.sleep(warm)
            t0 = time.monotonic()
            self.sample_until(t0 + seconds)
            t1 = time.monotonic()
        lost = sum(len(load.run.failures) + load.run.wrong for load in self.loads)
        return self.samples, t0, t1, lost


def _serve(procs: list[subprocess.Popen[str]], *options: str) -> str:
    """Start a ``serve`` stage, in *procs* at once (the run's clean-up stops every one there,
    this one too if Ctrl-C comes while it starts); its input address."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "enginecore", "serve", "--engine", DEVICE,
            "--bind", "tcp://127.0.0.1:*", "--max-clients", str(CLIENTS), *options,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if match is None:
        raise RuntimeError(f"serve did not start: {line!r}")
    return match.group(1)


def run(quick: bool) -> list[Record]:
    try:
        from enginecore.stage import StagePool
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    rounds, seconds = (2, 1.0) if quick else (6, 3.0)
    warm = min(0.5, seconds / 2)
    seeds = count()
    procs: list[subprocess.Popen[str]] = []
    try:
        addresses: dict[str, list[str]] = {"default": [], "50 ms": []}
        for kind, options in (("default", ()), ("50 ms", ("--load-interval", "0.05"))):
            for _ in range(REPLICAS):
                addresses[kind].append(_serve(procs, *options))
        with contextlib.ExitStack() as stack:
            pools = {
                kind: [
                    stack.enter_context(StagePool.connect(addresses[kind])) for _ in range(CLIENTS)
                ]
                for kind in addresses
            }

            def side(kind: str, n_pools: int) -> Callable[[], tuple[float, int]]:
                def once() -> tuple[float, int]:
                    shared = Shared(
                        pools[kind][:n_pools], clients_per_pool=CLIENTS // n_pools, seed=next(seeds)
                    )
                    samples, t0, t1, lost = shared.run(seconds, warm)
                    assert lost == 0, f"{lost} requests failed in a steady run"
                    ratio, idle, _ = balance(_window(samples, t0, t1), addresses[kind])
                    return ratio, idle

                return once

            res = interleave(
                {
                    "4 pools": side("default", CLIENTS),
                    "4 pools, 50 ms reports": side("50 ms", CLIENTS),
                    "1 pool": side("default", 1),
                },
                rounds=rounds,
                warmup=0,
            )
            for group in pools.values():
                for p in group:
                    p.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    four, slow, one = res["4 pools"], res["4 pools, 50 ms reports"], res["1 pool"]
    load = (
        f"{CLIENTS} clients x {SLOTS} outstanding over {REPLICAS} shared `serve --max-clients "
        f"{CLIENTS}` device stages, lengths exp(mean {MEAN_LEN:g}), {seconds:g} s a round, "
        f"sampled every {SAMPLE_S * 1e3:g} ms"
    )
    return [
        _absolute(
            "pool shared, 4 pools x 4 replicas: max/mean outstanding",
            [x[0] for x in four], [x[0] for x in one], "max/mean", "<=", GOAL_BALANCE,
            f"LeastLoaded, serve's default load interval for --max-clients > 1 (5 ms); "
            f"time-averaged per round; baseline: the same 4 clients as threads of one pool; "
            f"{load}; GC on",
        ),
        _absolute(
            "pool shared: samples with a replica idle while another has > 2",
            [float(x[1]) for x in four], [float(x[1]) for x in one], "samples", "<=", 0,
            f"per round; serve's default (5 ms); baseline: one pool; {load}; GC on",
        ),
        report_only(_absolute(
            "pool shared, load reports every 50 ms: max/mean outstanding",
            [x[0] for x in slow], [x[0] for x in one], "max/mean", "<=", GOAL_BALANCE,
            f"LeastLoaded, stages with --load-interval 0.05 (the default before); baseline: "
            f"one pool; {load}; GC on",
        )),
        _absolute(
            "pool shared, reports every 50 ms: samples with a replica idle while another has > 2",
            [float(x[1]) for x in slow], [float(x[1]) for x in one], "samples", "<=", 0,
            f"per round; --load-interval 0.05; baseline: one pool; {load}; GC on",
        ),
    ]  # fmt: skip


if __name__ == "__main__":
    main_single(run, __doc__)
