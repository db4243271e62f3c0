"""The soak's bookkeeping: expectations with a pass/fail each, violations, stage RSS."""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Final

__all__ = [
    "Check",
    "PhaseReport",
    "Stall",
    "handle_samples",
    "read_handles",
    "read_rss_kib",
    "rss_samples",
]

MAX_EXAMPLES: Final = 5
"""Examples kept per kind of violation (distinct ones)."""


@dataclasses.dataclass
class Check:
    """One expectation: what it says, what was measured, whether it held."""

    expectation: str
    measured: str
    ok: bool


class Stall(Exception):
    """Nothing arrived for too long while something was expected: the phase ends here."""


class PhaseReport:
    """What one phase of the soak found: its checks, its violations (counted by kind, with
    a few examples each), its counters and its elapsed time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.checks: list[Check] = []
        self.violations: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, list[str]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.rss_kib: list[tuple[int, int]] = []  # (progress, VmRSS in KiB)
        self.handles: list[tuple[int, int, int]] = []  # (progress, open fds, threads)
        self.notes: list[str] = []
        self.started = time.monotonic()
        self.elapsed = 0.0
        self.interrupted = False

    def violation(self, kind: str, example: str) -> None:
        """Record one violated expectation of kind *kind*."""
        self.violations[kind] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < MAX_EXAMPLES and example not in examples:
            examples.append(example)

    def sample(self, progress: int, pid: int) -> None:
        """Sample process *pid*'s RSS, open fds and threads, at *progress*."""
        self.rss_kib.append((progress, read_rss_kib(pid)))
        self.handles.append((progress, *read_handles(pid)))

    def check(self, expectation: str, measured: str, ok: bool) -> None:
        self.checks.append(Check(expectation, measured, ok))

    def finish(self) -> None:
        self.elapsed = time.monotonic() - self.started
        self.check(
            "no violation seen while running (unexpected event, wrong payload or order)",
            f"{sum(self.violations.values())} violations",
            not self.violations,
        )

    def interrupt(self) -> None:
        """The phase was stopped (Ctrl-C, SIGTERM) before its end: :meth:`render` shows
        what it counted so far, without a verdict."""
        self.elapsed = time.monotonic() - self.started
        self.interrupted = True

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(c.ok for c in self.checks)

    def render(self) -> str:
        verdict = "INTERRUPTED, no verdict" if self.interrupted else "PASS" if self.ok else "FAIL"
        lines = [f"## {self.name}: {verdict} ({self.elapsed:.1f} s)", ""]
        if self.checks:
            width = max(len(c.expectation) for c in self.checks)
            lines.append(f"| {'expectation':<{width}} | result | measured |")
            lines.append(f"|{'-' * (width + 2)}|--------|----------|")
            for c in self.checks:
                verdict = "PASS" if c.ok else "FAIL"
                lines.append(f"| {c.expectation:<{width}} | {verdict:<6} | {c.measured} |")
            lines.append("")
        if self.counts:
            lines.append(
                "counts: " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.counts.items()))
            )
        for note in self.notes:
            lines.append(note)
        for kind, n in self.violations.most_common():
            lines.append(f"VIOLATION x{n}: {kind}")
            lines.extend(f"    e.g. {ex}" for ex in self.examples[kind])
        return "\n".join(lines)


def rss_samples(samples: list[tuple[int, int]], unit: str, n: int = 10) -> str:
    """About *n* of *samples* ``(progress, KiB)``, evenly spaced, the last one included."""
    every = max(1, len(samples) // n)
    picked = samples[::every]
    if picked[-1] != samples[-1]:
        picked.append(samples[-1])
    return f"stage RSS ({unit}: MiB): " + ", ".join(f"{i:,}: {kib / 1024:.1f}" for i, kib in picked)


def read_rss_kib(pid: int) -> int:
    """VmRSS of process *pid*, in KiB (``-1`` if it cannot be read: the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def read_handles(pid: int) -> tuple[int, int]:
    """Open file descriptors and threads of process *pid* (``-1`` each if it cannot be
    read: the process is gone)."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return -1, -1
    return fds, threads


def handle_samples(samples: list[tuple[int, int, int]], unit: str, n: int = 10) -> str:
    """About *n* of *samples* ``(progress, fds, threads)``, evenly spaced, the last one
    included."""
    every = max(1, len(samples) // n)
    picked = samples[::every]
    if picked[-1] != samples[-1]:
        picked.append(samples[-1])
    return f"stage fds/threads ({unit}: fds/threads): " + ", ".join(
        f"{i:,}: {fds}/{threads}" for i, fds, threads in picked
    )
