"""The replica pool under load and under faults: balance, sticky keys, a killed replica, a
stopped replica, replicas added and removed (issue 18's goals beyond ``bench_pool``).

Every part runs a **closed loop** on ``StagePool``\\ s of 4 device-engine replicas
(``enginecore.stage.testing:device``: 5 ms a step, the GIL released, every live request one
output a step): ``CLIENTS`` client threads, each keeping ``SLOTS`` requests outstanding
(a slot sends its next request as soon as its last one ends), with request lengths drawn
from an exponential distribution (mean ``MEAN_LEN`` outputs, at least 1). Every output is
read and checked (a countdown ``n-1 .. 0``). A sampler thread reads each replica's exact
outstanding count (``replica.in_flight``) and the outputs read from it every
``SAMPLE_S``. The GC is on in every process. Each part is judged on every round.

**One pool, not four clients.** Here the 4 clients are 4 groups of threads sharing one
pool (launched stages serve one client), which keeps exact counts for all of them. Four
separate pools over four shared stages (``serve --max-clients 4``), each seeing the others
only through the stages' load reports, are ``bench_pool_shared``.

a. **Balance** (LeastLoaded). Per sample while loaded, max/mean outstanding over the 4
   replicas; the round's figure is the mean over its samples (time-averaged). Goal
   <= 1.25. And the samples where a replica is idle while another has > 2 outstanding:
   goal 0. Baseline, side by side: the same load on a pool that routes at random.
b. **Sticky** (``Sticky()``), keys Zipf(1.1) over 64 keys: the share of requests sent to
   their key's home replica (``Sticky.home``), goal >= 80 %, and max/mean outstanding as
   in (a), goal <= 1.5. Baseline: the same keyed load on the LeastLoaded pool.
c. **SIGKILL** one of 4 replicas under load (``restart=True``; each round kills another
   replica, so each restart is its first within the policy's window): every failed request
   must be the dead replica's and a ``ReplicaDeadError`` (goal 0 others), within 1 s of
   the kill; the three others' service rate in the ``WINDOW_S`` after the kill against the
   ``WINDOW_S`` before, goal >= 0.95; and the time until the restarted replica delivers
   outputs again, goal <= 5 s. *Service rate*: outputs per second per outstanding request
   (the outputs the replicas delivered over the integral of their outstanding count, about
   one per step): a closed loop moves the dead replica's requests onto the others, which
   raises their outputs/s on an engine that batches everything; the rate per request is
   what a slower loop would lower. Their raw outputs/s ratio is in the note. Baseline: the
   same windows on a round without a kill.
d. **SIGSTOP** one of 4 replicas under load, pinged every ``PING_S``: the time until it
   leaves the routing (``routable()`` false), in ping intervals, goal <= 2. And false
   ejections (a healthy replica that reads "stalled", from the pool's warnings and the
   sampler): goal 0, in a burst of 1,280 requests (``add_many``) on the 4 healthy
   replicas and while the stopped one is out.
e. **Membership**: ``remove_replica(drain=True)`` then ``add_replica()`` under load: requests
   lost (ended by an error, or with wrong or missing outputs): goal 0; the service rate of
   the replicas that stay, as in (c), after each change against before, goal >= 0.95.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count, pairwise
from typing import Any

from ._harness import Record, Skipped, gc_on, interleave, main_single, spread

NAME = "pool_faults"
DEVICE = "enginecore.stage.testing:device"
REPLICAS = 4
CLIENTS = 4
SLOTS = 8
MEAN_LEN = 20.0
SAMPLE_S = 0.01
PING_S = 0.2
BURST = 1280
BURST_LEN = 20
KEYS = 64
ZIPF_S = 1.1
GOAL_BALANCE = 1.25
GOAL_STICKY_HOME = 0.8
GOAL_STICKY_BALANCE = 1.5
GOAL_RATE = 0.95
GOAL_FAIL_S = 1.0
GOAL_RESTART_S = 5.0
GOAL_STOP_INTERVALS = 2.0

_runs = count()


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


def keys_of(seed: int) -> list[str]:
    """The 64 keys of a run, most frequent first: their names (and so their homes) change
    with *seed*, so that the rounds cover several placements, not one lucky or unlucky one."""
    return [f"k{seed}-{i}" for i in range(KEYS)]


def home_bound(replicas: Sequence[Any], seed: int, max_mean: float) -> tuple[float, float]:
    """(the largest share of the traffic whose key is at home on one replica, the most that
    can stay at home while that replica holds at most *max_mean* times the mean outstanding
    count): a placement where one replica is home to more than ``max_mean / n`` of the
    traffic must spill the excess."""
    from enginecore.stage import Sticky

    sticky, weights = Sticky(), _zipf_weights(KEYS, ZIPF_S)
    total = sum(weights)
    share: dict[str, float] = {}
    for key, w in zip(keys_of(seed), weights, strict=True):
        name = sticky.home(replicas, key).name
        share[name] = share.get(name, 0.0) + w / total
    top = max(share.values())
    return top, 1.0 - max(0.0, top - max_mean / len(replicas))


@dataclass
class Sample:
    t: float
    in_flight: dict[str, int]
    outputs: dict[str, int]
    routable: dict[str, bool]


@dataclass
class Failure:
    t: float
    replica: str | None  # the replica the error names (None: not a ReplicaDeadError)
    sent_to: str
    kind: str


@dataclass
class Run:
    """What one closed-loop run saw."""

    samples: list[Sample] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    wrong: int = 0  # ended without error but with wrong or missing outputs
    sent: int = 0
    done: int = 0
    home: int = 0
    keyed: int = 0


class Load:
    """``clients * slots`` threads keeping requests outstanding on *pool*, and a sampler."""

    def __init__(
        self,
        pool: Any,
        *,
        clients: int = CLIENTS,
        slots: int = SLOTS,
        mean: float = MEAN_LEN,
        keyed: bool = False,
        seed: int = 0,
    ) -> None:
        from enginecore.stage import Sticky

        self.pool = pool
        self.mean = mean
        self.keyed = keyed
        self.seed = seed
        self.tag = next(_runs)
        self.run = Run()
        self._stop = threading.Event()
        self._counts: list[dict[str, int]] = []
        self._homes = Sticky()  # homes are rendezvous hashes of names: any instance agrees
        self._keys = keys_of(seed)
        self._weights = _zipf_weights(KEYS, ZIPF_S)
        self._threads = [
            threading.Thread(target=self._slot, args=(c, s), daemon=True)
            for c in range(clients)
            for s in range(slots)
        ]
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> Run:
        self._stop.set()
        for t in [*self._threads, self._sampler]:
            t.join(timeout)
        return self.run

    def outputs(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in list(self._counts):
            for name, n in list(c.items()):
                total[name] = total.get(name, 0) + n
        return total

    def _sample(self) -> None:
        from enginecore.stage._pool_core import routable

        samples = self.run.samples
        while not self._stop.wait(SAMPLE_S):
            replicas = self.pool.replicas
            samples.append(
                Sample(
                    time.monotonic(),
                    {r.name: r.in_flight for r in replicas},
                    self.outputs(),
                    {r.name: r.state == "serving" and routable(r) for r in replicas},
                )
            )

    def _slot(self, client: int, slot: int) -> None:
        from enginecore.stage import NoReplicaError, ReplicaDeadError

        rng = random.Random(self.seed * 100_003 + client * 1009 + slot)
        counts: dict[str, int] = {}
        with self._lock:
            self._counts.append(counts)
        run, pool, stop = self.run, self.pool, self._stop
        keys, weights = self._keys, self._weights
        sent = done = wrong = home = keyed = 0
        seq = 0
        while not stop.is_set():
            n = max(1, round(rng.expovariate(1.0 / self.mean)))
            key: Hashable | None = rng.choices(keys, weights)[0] if self.keyed else None
            rid = f"L{self.tag}-{client}-{slot}-{seq}"
            seq += 1
            try:
                stream = pool.add(rid, n, key=key)
            except NoReplicaError:
                time.sleep(0.001)
                continue
            sent += 1
            name = stream.replica.name
            if key is not None:
                keyed += 1
                serving = [r for r in pool.replicas if r.state == "serving"]
                if serving and self._homes.home(serving, key).name == name:
                    home += 1
            expect = n - 1
            counts.setdefault(name, 0)
            try:
                for x in stream:
                    if x != expect:
                        break
                    expect -= 1
                    counts[name] += 1
            except ReplicaDeadError as exc:
                run.failures.append(
                    Failure(time.monotonic(), getattr(exc.replica, "name", None), name, "dead")
                )
                continue
            except Exception as exc:
                run.failures.append(Failure(time.monotonic(), None, name, type(exc).__name__))
                continue
            if expect != -1:
                wrong += 1
            done += 1
        with self._lock:
            run.sent += sent
            run.done += done
            run.wrong += wrong
            run.home += home
            run.keyed += keyed


# -- analysis --------------------------------------------------------------------------------


def _window(samples: Sequence[Sample], t0: float, t1: float) -> list[Sample]:
    return [s for s in samples if t0 <= s.t <= t1]


def balance(samples: Sequence[Sample], names: Sequence[str]) -> tuple[float, int, int]:
    """(mean over loaded samples of max/mean outstanding, samples with a replica idle while
    another has > 2, loaded samples)."""
    ratios: list[float] = []
    idle = 0
    for s in samples:
        loads = [s.in_flight.get(n, 0) for n in names]
        total = sum(loads)
        if total == 0:
            continue
        ratios.append(max(loads) * len(loads) / total)
        if min(loads) == 0 and max(loads) > 2:
            idle += 1
    return (statistics.fmean(ratios) if ratios else float("nan")), idle, len(ratios)


def service(
    samples: Sequence[Sample], names: Sequence[str], t0: float, t1: float
) -> tuple[float, float]:
    """(outputs per second per outstanding request, outputs/s) of *names* in [t0, t1]."""
    w = _window(samples, t0, t1)
    if len(w) < 2:
        return float("nan"), float("nan")
    outputs = sum(w[-1].outputs.get(n, 0) - w[0].outputs.get(n, 0) for n in names)
    area = 0.0
    for a, b in pairwise(w):
        area += sum(a.in_flight.get(n, 0) for n in names) * (b.t - a.t)
    span = w[-1].t - w[0].t
    return (outputs / area if area else float("nan")), outputs / span


# -- parts -----------------------------------------------------------------------------------


def _steady(
    pool: Any, seconds: float, warm: float, *, keyed: bool, seed: int
) -> tuple[Run, float, float]:
    with gc_on():
        load = Load(pool, keyed=keyed, seed=seed)
        with load:
            time.sleep(warm)
            t0 = time.monotonic()
            time.sleep(seconds)
            t1 = time.monotonic()
        return load.run, t0, t1


def balance_parts(pools: dict[str, Any], rounds: int, seconds: float) -> list[Record]:
    """(a) and (b): side by side, one load window per pool per round."""
    names = {k: [r.name for r in p.replicas] for k, p in pools.items()}
    seeds = count()
    warm = min(0.5, seconds / 2)

    bounds: list[tuple[float, float]] = []

    def side(kind: str, keyed: bool) -> Callable[[], tuple[float, int, float, float]]:
        def once() -> tuple[float, int, float, float]:
            seed = next(seeds)
            if kind == "sticky":
                bounds.append(home_bound(pools[kind].replicas, seed, GOAL_STICKY_BALANCE))
            run, t0, t1 = _steady(pools[kind], seconds, warm, keyed=keyed, seed=seed)
            ratio, idle, _ = balance(_window(run.samples, t0, t1), names[kind])
            lost = len(run.failures) + run.wrong
            assert lost == 0, f"{lost} requests failed in a steady run"
            return ratio, idle, run.home / max(1, run.keyed), run.done / (t1 - t0 + warm)

        return once

    res = interleave(
        {
            "least": side("least", False),
            "random": side("random", False),
            "sticky": side("sticky", True),
            "least keyed": side("least", True),
        },
        rounds=rounds,
        warmup=0,
    )
    least, rnd = res["least"], res["random"]
    sticky, lk = res["sticky"], res["least keyed"]
    placements = ", ".join(f"{top:.0%}/{best:.0%}" for top, best in bounds)
    load = (
        f"{CLIENTS} client threads x {SLOTS} outstanding on one pool of {REPLICAS}, lengths "
        f"exp(mean {MEAN_LEN:g}), {seconds:g} s a round, sampled every {SAMPLE_S * 1e3:g} ms"
    )
    out = [
        _absolute(
            "pool balance, 4 clients x 4 replicas: max/mean outstanding",
            [x[0] for x in least], [x[0] for x in rnd], "max/mean", "<=", GOAL_BALANCE,
            f"LeastLoaded; time-averaged per round; baseline: random routing; {load}; GC on",
        ),
        _absolute(
            "pool balance: samples with a replica idle while another has > 2",
            [float(x[1]) for x in least], [float(x[1]) for x in rnd], "samples", "<=", 0,
            f"LeastLoaded, per round; baseline: random routing; {load}; GC on",
        ),
        _absolute(
            "pool sticky, Zipf(1.1) over 64 keys: share on the home replica",
            [x[2] for x in sticky], [x[2] for x in lk], "share", ">=", GOAL_STICKY_HOME,
            f"Sticky(); each round its own 64 key names (placement); per round, the top "
            f"replica's home traffic and the most that can stay home within max/mean "
            f"{GOAL_STICKY_BALANCE:g}: {placements}; baseline: LeastLoaded (ignores keys); "
            f"{load}; GC on",
        ),
        _absolute(
            "pool sticky: max/mean outstanding",
            [x[0] for x in sticky], [x[0] for x in lk], "max/mean", "<=", GOAL_STICKY_BALANCE,
            f"Sticky(), time-averaged per round; baseline: LeastLoaded; {load}; GC on",
        ),
    ]  # fmt: skip
    return out


def _absolute(
    name: str,
    values: Sequence[float],
    baselines: Sequence[float],
    unit: str,
    op: str,
    line: float,
    note: str,
) -> Record:
    """A record judged on an absolute line, every round: the highest round for ``<=``, the
    lowest for ``>=``."""
    v, b = statistics.median(values), statistics.median(baselines)
    met = max(values) <= line if op == "<=" else min(values) >= line
    return Record(
        name, v, unit, b, (v / b if b else float("inf") if v else 1.0), f"{op} {line:g} {unit}",
        met, spread(values), spread(baselines), note, tuple(values), unit,
    )  # fmt: skip


@contextlib.contextmanager
def _warnings() -> Any:
    """Collect the pool's warnings (``enginecore.stage`` logger) while inside."""
    got: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    log = logging.getLogger("enginecore.stage")
    h = Handler(logging.WARNING)
    log.addHandler(h)
    try:
        yield got
    finally:
        log.removeHandler(h)


def kill_part(pool: Any, rounds: int, window: float) -> list[Record]:
    """(c): a kill round and a quiet round, alternately, on one pool with restart=True."""
    victims = count()
    seeds = count(1000)

    def round_(kill: bool) -> dict[str, float]:
        serving = [r for r in pool.replicas if r.state == "serving"]
        victim = serving[next(victims) % len(serving)] if kill else serving[0]
        others = [r.name for r in serving if r is not victim]
        old_pid = victim.pid
        with gc_on(), Load(pool, seed=next(seeds)) as load:
            time.sleep(window + 0.3)
            t_kill = time.monotonic()
            if kill:
                os.kill(old_pid, signal.SIGKILL)
            back = float("nan")
            deadline = t_kill + 20
            if kill:
                while time.monotonic() < deadline:
                    if victim.state == "serving" and victim.pid != old_pid:
                        break
                    time.sleep(0.005)
                base = load.outputs().get(victim.name, 0)
                while time.monotonic() < deadline:
                    if load.outputs().get(victim.name, 0) > base:
                        back = time.monotonic() - t_kill
                        break
                    time.sleep(0.005)
            left = t_kill + window - time.monotonic()
            if left > 0:
                time.sleep(left)
            run = load.stop()
        before = service(run.samples, others, t_kill - window, t_kill)
        after = service(run.samples, others, t_kill, t_kill + window)
        fails = run.failures
        wrong = [f for f in fails if f.kind != "dead" or f.replica != victim.name]
        wrong_n = len(wrong) + run.wrong
        if not kill:
            wrong_n = len(fails) + run.wrong
        latest = max((f.t - t_kill for f in fails if f.replica == victim.name), default=0.0)
        return {
            "rate": after[0] / before[0],
            "raw": after[1] / before[1],
            "others_failed": float(wrong_n),
            "failed": float(len(fails)),
            "latest": latest,
            "back": back,
        }

    res = interleave({"kill": lambda: round_(True), "quiet": lambda: round_(False)}, rounds, 0)
    k, q = res["kill"], res["quiet"]

    def col(rows: list[dict[str, float]], key: str) -> list[float]:
        return [r[key] for r in rows]

    raw = ", ".join(f"{x:.2f}" for x in col(k, "raw"))
    failed = ", ".join(f"{x:.0f}" for x in col(k, "failed"))
    setup = (
        f"closed loop {CLIENTS}x{SLOTS} on {REPLICAS} launched replicas, restart=True; windows "
        f"of {window:g} s before and after the kill; each round kills another replica"
    )
    return [
        _absolute(
            "pool SIGKILL 1 of 4: requests failed that were not the dead replica's",
            col(k, "others_failed"), col(q, "others_failed"), "requests", "<=", 0,
            f"failed per round (all the dead replica's, ReplicaDeadError): {failed}; "
            f"baseline: failures in a round without a kill; {setup}; GC on",
        ),
        _absolute(
            "pool SIGKILL 1 of 4: last of its requests failed after the kill",
            col(k, "latest"), [0.0] * len(q), "s", "<=", GOAL_FAIL_S,
            f"time from os.kill to the last ReplicaDeadError raised to a client; {setup}; GC on",
        ),
        _absolute(
            "pool SIGKILL 1 of 4: the other three's service rate, after/before",
            col(k, "rate"), col(q, "rate"), "after/before", ">=", GOAL_RATE,
            f"outputs per outstanding request-second; their raw outputs/s after/before: {raw} "
            f"(the closed loop moves the dead one's requests onto them); baseline: the same "
            f"windows without a kill; {setup}; GC on",
        ),
        _absolute(
            "pool SIGKILL 1 of 4, restart=True: serving again after",
            col(k, "back"), [0.0] * len(q), "s", "<=", GOAL_RESTART_S,
            f"from os.kill to its first output read after the restart (backoff 0.5 s, "
            f"then a spawn); {setup}; GC on",
        ),
    ]  # fmt: skip


def stop_part(pool: Any, rounds: int, burst: int) -> list[Record]:
    """(d): per round, a burst on the 4 healthy replicas, then SIGSTOP one under load."""
    from enginecore.stage._pool_core import routable

    victims = count()
    seeds = count(2000)
    out: dict[str, list[float]] = {"detect": [], "false": [], "back": []}
    tags = count()
    for _ in range(rounds):
        serving = [r for r in pool.replicas if r.state == "serving"]
        assert len(serving) == REPLICAS
        victim = serving[next(victims) % len(serving)]
        with gc_on(), _warnings() as said:
            # the burst, the 4 healthy
            tag = next(tags)
            stop_watch = threading.Event()
            ejected = [0]
            w = threading.Thread(target=_watch, args=(serving, stop_watch, ejected), daemon=True)
            w.start()
            streams = pool.add_many([(f"B{tag}-{i}", BURST_LEN) for i in range(burst)])
            for s in streams:
                got = s.collect(timeout=60)
                assert got == list(range(BURST_LEN - 1, -1, -1))
            stop_watch.set()
            w.join()
            burst_false = ejected[0] + sum("has not answered" in m for m in said)
            said.clear()
            # SIGSTOP one under load
            others = [r for r in serving if r is not victim]
            with Load(pool, seed=next(seeds)) as load:
                time.sleep(0.5)
                t_stop = time.monotonic()
                os.kill(victim.pid, signal.SIGSTOP)
                try:
                    while routable(victim) and time.monotonic() < t_stop + 10 * PING_S:
                        time.sleep(0.0005)
                    detect = time.monotonic() - t_stop
                    t_out = time.monotonic()
                    time.sleep(2 * PING_S)
                finally:
                    os.kill(victim.pid, signal.SIGCONT)
                t_cont = time.monotonic()
                while not routable(victim) and time.monotonic() < t_cont + 10:
                    time.sleep(0.001)
                back = time.monotonic() - t_cont
                run = load.stop()
            pid = str(victim.pid)
            stop_false = sum(
                1
                for s in _window(run.samples, t_stop, t_out + 2 * PING_S)
                for r in others
                if not s.routable.get(r.name, False)
            ) + sum("has not answered" in m and pid not in m for m in said)
            lost = len(run.failures) + run.wrong
            assert lost == 0, f"{lost} requests failed while a replica was stopped"
        out["detect"].append(detect / PING_S)
        out["false"].append(float(burst_false + stop_false))
        out["back"].append(back)
    return [
        _absolute(
            "pool SIGSTOP 1 of 4: out of the routing after",
            out["detect"], [GOAL_STOP_INTERVALS] * rounds, "intervals", "<=",
            GOAL_STOP_INTERVALS,
            f"from SIGSTOP until routable() is false, in ping intervals of {PING_S:g} s "
            f"(launch(ping_interval=)); baseline: the goal; back in the routing "
            f"{statistics.median(out['back']) * 1e3:.0f} ms after SIGCONT (median); closed loop "
            f"{CLIENTS}x{SLOTS}; GC on",
        ),
        _absolute(
            "pool SIGSTOP: false ejections",
            out["false"], [0.0] * rounds, "ejections", "<=", 0,
            f"a healthy replica read stalled or left the routing (the pool's warnings, and a "
            f"2 ms watch during a burst of {burst} x {BURST_LEN} outputs on 4 healthy "
            f"replicas, {SAMPLE_S * 1e3:g} ms samples while one is stopped); GC on",
        ),
    ]  # fmt: skip


def _watch(replicas: list[Any], stop: threading.Event, ejected: list[int]) -> None:
    """Thread: count, every 2 ms until *stop*, the replicas of *replicas* out of the routing."""
    from enginecore.stage._pool_core import routable

    while not stop.wait(0.002):
        ejected[0] += sum(1 for r in replicas if not routable(r))


def membership_part(pool: Any, rounds: int, window: float) -> list[Record]:
    """(e): per round, remove a replica (drained) under load, then add one back."""
    seeds = count(3000)
    rem: list[float] = []
    add: list[float] = []
    raw_rem: list[float] = []
    raw_add: list[float] = []
    quiet: list[float] = []
    lost: list[float] = []
    for _ in range(rounds):
        with gc_on(), Load(pool, seed=next(seeds)) as load:
            time.sleep(2 * window + 0.3)
            serving = [r for r in pool.replicas if r.state == "serving"]
            gone = serving[0]
            stay = [r.name for r in serving[1:]]
            t_rem = time.monotonic()
            pool.remove_replica(gone, drain=True, timeout=30)
            time.sleep(max(0.0, t_rem + window - time.monotonic()) + window)
            t_add = time.monotonic()
            pool.add_replica(DEVICE, startup_timeout=120, ping_interval=PING_S)
            time.sleep(max(0.0, t_add + window - time.monotonic()))
            run = load.stop()
        s = run.samples
        q0 = service(s, stay, t_rem - 2 * window, t_rem - window)
        b = service(s, stay, t_rem - window, t_rem)
        a = service(s, stay, t_rem, t_rem + window)
        b2 = service(s, stay, t_add - window, t_add)
        a2 = service(s, stay, t_add, t_add + window)
        rem.append(a[0] / b[0])
        raw_rem.append(a[1] / b[1])
        add.append(a2[0] / b2[0])
        raw_add.append(a2[1] / b2[1])
        quiet.append(b[0] / q0[0])
        lost.append(float(len(run.failures) + run.wrong))
    setup = (
        f"closed loop {CLIENTS}x{SLOTS} on {REPLICAS} launched replicas; windows of {window:g} s "
        f"before and after the change; baseline: two windows before it, no change"
    )

    def fmt(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    return [
        _absolute(
            "pool membership: requests lost in a drained remove and an add",
            lost, [0.0] * rounds, "requests", "<=", 0,
            f"ended by an error, or with wrong or missing outputs; {setup}; GC on",
        ),
        _absolute(
            "pool remove_replica(drain=True): the others' service rate, after/before",
            rem, quiet, "after/before", ">=", GOAL_RATE,
            f"outputs per outstanding request-second; raw outputs/s after/before: "
            f"{fmt(raw_rem)}; {setup}; GC on",
        ),
        _absolute(
            "pool add_replica: the others' service rate, after/before",
            add, quiet, "after/before", ">=", GOAL_RATE,
            f"outputs per outstanding request-second, the spawn inside the window; raw "
            f"outputs/s after/before: {fmt(raw_add)}; {setup}; GC on",
        ),
    ]  # fmt: skip


def run(quick: bool) -> list[Record]:
    try:
        from enginecore.stage import Scored, StagePool, Sticky
    except ImportError as exc:
        raise Skipped(f"needs the zmq extra (pip install -e '.[zmq]'): {exc}") from None
    rng = random.Random(7)

    def at_random(view: Any, request: Any) -> float:
        return rng.random()

    with contextlib.ExitStack() as stack:
        common: dict[str, Any] = {
            "replicas": REPLICAS, "startup_timeout": 120, "ping_interval": PING_S,
        }  # fmt: skip
        pools = {
            "least": stack.enter_context(StagePool.launch(DEVICE, restart=True, **common)),
            "random": stack.enter_context(
                StagePool.launch(DEVICE, routing=Scored(at_random), **common)
            ),
            "sticky": stack.enter_context(StagePool.launch(DEVICE, routing=Sticky(), **common)),
        }  # fmt: skip
        if quick:
            records = balance_parts(pools, rounds=2, seconds=1.0)
        else:
            records = balance_parts(pools, rounds=6, seconds=3.0)
        for key in ("random", "sticky"):
            pools.pop(key).close()
        pool = pools["least"]
        if quick:
            records += stop_part(pool, rounds=1, burst=BURST)
            records += kill_part(pool, rounds=1, window=1.0)
            records += membership_part(pool, rounds=1, window=1.0)
        else:
            records += stop_part(pool, rounds=4, burst=BURST)
            records += kill_part(pool, rounds=4, window=2.0)
            records += membership_part(pool, rounds=4, window=2.0)
    return records


if __name__ == "__main__":
    main_single(run, __doc__)
