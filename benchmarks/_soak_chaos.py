"""What the chaos soaks (``soak_pipeline``, ``soak_pool``) share: the report, the request
ids, one request's life and its checks, and the killer thread that SIGKILLs and freezes
stage processes. Counts only, never a time (docs/soak.md)."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KILL_SEEN_S", "Ids", "Life", "Report", "Rules", "draw", "killer", "left_behind"]

KILL_SEEN_S = 2.0
"""A request may fail with its process's death if a process was killed at most this long
before its add (the death not heard yet when it was routed), or during its life."""


@dataclass(frozen=True)
class Rules:
    """What a soak's requests may meet besides a kill: *held*, the words of the
    :class:`ValueError` of an ``add`` whose id is still held; *errors*, the words of the
    request errors made on purpose (none by default)."""

    held: str
    errors: Sequence[str] = ()


@dataclass
class Report:
    ends: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    freezes: collections.Counter[str] = field(default_factory=collections.Counter)
    membership: collections.Counter[str] = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    last_wave: int = 0
    last_kill: float = float("-inf")  # time.monotonic() of the last SIGKILL
    pids: set[int] = field(default_factory=set)  # every stage process the soak saw
    events: list[str] = field(default_factory=list)  # what the chaos did, and when

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def problem(self, what: str) -> None:
        with self._lock:
            if len(self.problems) < 50:
                self.problems.append(f"{time.monotonic() - self._t0:7.3f} s: {what}")

    def event(self, what: str) -> None:
        """Note what the chaos did (a kill, a freeze, a replica added or removed): printed
        with the problems, to read them against."""
        with self._lock:
            self.events.append(f"{time.monotonic() - self._t0:7.3f} s: {what}")

    def count(self, counter: collections.Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    def render(self, title: str, waves: int = 16) -> tuple[str, bool]:
        """The report as text under *title*, and whether the soak passed (no problem, and
        the last wave of *waves* requests complete)."""
        lines = [
            title,
            f"  ends: {dict(self.ends)}",
            f"  refused at add: {dict(self.refused)}",
            f"  kills: {dict(self.kills)}; restarts: {self.restarts}",
            f"  freezes: {dict(self.freezes)}",
            *([f"  membership: {dict(self.membership)}"] if self.membership else []),
            f"  last wave: {self.last_wave}/{waves} complete",
        ]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        ok = not self.problems and self.last_wave == waves
        if not ok:
            lines += [f"  chaos: {e}" for e in self.events]
        lines.append("  OK" if ok else "  FAILED")
        return "\n".join(lines), ok


class Ids:
    """A small set of request ids; one is taken while its request is live at the caller."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self._free = [f"r{i}" for i in range(n)]
        self._rng = rng
        self._lock = threading.Lock()

    def take(self) -> str | None:
        with self._lock:
            if not self._free:
                return None
            return self._free.pop(self._rng.randrange(len(self._free)))

    def give(self, rid: str) -> None:
        with self._lock:
            self._free.append(rid)


class Life:
    """One request of the soak, from its add to its end: what it read, and the checks of
    how it ended (:meth:`end`)."""

    def __init__(
        self, rid: str, n: int, abort_after: int | None, report: Report, rules: Rules
    ) -> None:
        self.rid, self.n, self.abort_after = rid, n, abort_after
        self.report, self.rules = report, rules
        self.added = time.monotonic()
        self.got: list[Any] = []

    def refused(self, exc: Exception) -> None:
        """``add`` refused it with *exc*: :class:`NoReplicaError` (nothing to route to now),
        or :class:`ValueError` for its id still held (``rules.held`` in its message);
        anything else is a problem."""
        if isinstance(exc, ValueError) and self.rules.held not in str(exc):
            self.report.problem(f"{self.rid}: add raised {exc!r}")
        self.report.count(self.report.refused, type(exc).__name__)

    def end(self, how: str, exc: BaseException | None = None, where: str = "") -> None:
        """It ended *how*: ``finished``, ``aborted``, ``dead`` or ``error`` (with *exc*), or
        ``hung`` (*where*: what the coordinator says of it)."""
        rid, report = self.rid, self.report
        if how == "error" and not any(ok in str(exc) for ok in self.rules.errors):
            report.problem(f"{rid}: {exc!r}")
        elif how == "aborted" and self.abort_after is None:
            report.problem(f"{rid}: aborted, but the soak did not abort it")
        elif how == "dead" and report.last_kill < self.added - KILL_SEEN_S:
            report.problem(f"{rid}: {exc!r}, with no kill near its life")
        elif how == "hung":
            report.problem(
                f"{rid}: no end within the deadline (n={self.n}, got {len(self.got)}, {where})"
            )
        expected = list(range(self.n - 1, -1, -1))
        if how == "finished" and self.got != expected:
            report.problem(f"{rid}: finished with {self.got!r}, expected {expected!r}")
        elif self.got != expected[: len(self.got)]:
            report.problem(f"{rid}: {how} after {self.got!r}, not a prefix of {expected!r}")
        report.count(report.ends, how)


def draw(rng: random.Random, abort_share: float) -> tuple[int, int | None]:
    """A request's length, and after how many outputs the soak aborts it (``None``: never;
    0: at once, before reading any)."""
    n = rng.randint(1, 40)
    return n, rng.randint(0, n) if rng.random() < abort_share else None


def killer(
    rng: random.Random,
    until: float,
    stop: threading.Event,
    report: Report,
    *,
    targets: Callable[[], list[tuple[str, int]]],
    freeze_share: float = 0.0,
) -> None:
    """Until *until*: every 0.2 to 1.2 s, SIGKILL one of the processes *targets* lists (by
    key, ``name`` or ``name[r]``, and pid: those up now), or, *freeze_share* of the time,
    freeze it (SIGSTOP) for 0.1 to 3 s while the chaos goes on. Every frozen process is
    thawed (SIGCONT) before this returns."""
    frozen: dict[int, float] = {}  # pid: when to thaw it

    def thaw(now: float) -> None:
        for pid, at in list(frozen.items()):
            if at <= now:
                del frozen[pid]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    try:
        while not stop.is_set() and time.monotonic() < until:
            wake = time.monotonic() + rng.uniform(0.2, 1.2)
            while (now := time.monotonic()) < wake:  # thaw on time meanwhile
                due = min([wake, *frozen.values()])
                if stop.wait(max(0.0, due - now)):
                    return
                thaw(time.monotonic())
            if time.monotonic() >= until:
                return
            up = [t for t in targets() if t[1] not in frozen]
            if not up:
                continue
            key, pid = rng.choice(up)
            with contextlib.suppress(ProcessLookupError):
                if rng.random() < freeze_share:
                    frozen[pid] = time.monotonic() + rng.uniform(0.1, 3.0)
                    os.kill(pid, signal.SIGSTOP)
                    report.count(report.freezes, key)
                    report.event(
                        f"froze {key} (pid {pid}) until +{frozen[pid] - time.monotonic():.2f} s"
                    )
                else:
                    report.last_kill = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    report.count(report.kills, key)
                    report.event(f"killed {key} (pid {pid})")
    finally:
        thaw(float("inf"))


def left_behind(report: Report) -> None:
    """After the shutdown: a process the soak saw that still exists is a problem."""
    for pid in sorted(report.pids):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        report.problem(f"stage process {pid} is still there after the shutdown")
