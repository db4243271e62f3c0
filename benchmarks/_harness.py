"""Shared plumbing for the benchmarks: interleaved runs, statistics, records, the table.

Every benchmark measures enginecore and its raw baseline *in the same process, in the same
run*, interleaved (A B B A A B ...) so that drift on a shared, noisy machine hits both sides
alike. Nothing here ever compares against a number from another run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

__all__ = [
    "NoopEngine",
    "Record",
    "Skipped",
    "fmt_value",
    "format_table",
    "higher_is_better",
    "interleave",
    "lower_is_better",
    "main_single",
    "no_gc",
    "percentile",
    "sink",
    "spread",
    "write_json",
]

T = TypeVar("T")


class Skipped(Exception):
    """Raised by a benchmark's ``run()`` when an optional dependency is missing."""


class NoopEngine:
    """An engine that never has work and ignores every message.

    Benchmarks subclass it and override only the method they time, so each engine states
    just what differs. Overriding costs nothing on the loop's path: it binds the methods once.
    """

    def has_work(self) -> bool:
        return False

    def add(self, req_id: str, data: Any) -> None:
        pass

    def abort(self, req_ids: Sequence[str]) -> None:
        pass

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        return None

    def step(self) -> list[Any]:
        return []


@dataclass(frozen=True)
class Record:
    """One metric from one run: enginecore's value next to its baseline from the same run.

    ``ratio`` is ``value / baseline``, except for paired rounds where it is the median of the
    per-round ratios (see :func:`higher_is_better`). ``spread`` and ``baseline_spread`` are the
    half-range of the per-round results (same unit as the value). ``note`` says how the goal
    was judged when that is not just the ratio.
    """

    name: str
    value: float
    unit: str
    baseline: float
    ratio: float
    goal: str
    met: bool
    spread: float = 0.0
    baseline_spread: float = 0.0
    note: str = ""

    def as_json(self) -> dict[str, object]:
        d = asdict(self)
        # JSON has no inf/nan; a zero baseline (idle CPU) gives an infinite ratio.
        if not math.isfinite(self.ratio):
            d["ratio"] = None
        return d


def ratio(value: float, baseline: float) -> float:
    if baseline == 0:
        return math.inf if value else 1.0
    return value / baseline


def higher_is_better(
    name: str,
    values: Sequence[float],
    baselines: Sequence[float],
    unit: str,
    min_ratio: float,
    note: str = "",
) -> Record:
    """A throughput-like metric from paired rounds; goal ``ratio >= min_ratio``.

    ``values[i]`` and ``baselines[i]`` ran back to back in round *i*, so they saw the same
    machine. The ratio is the median of the per-round ratios, which cancels the drift between
    rounds that a ratio of two medians would keep.
    """
    v, b = statistics.median(values), statistics.median(baselines)
    ratios = sorted(x / y for x, y in zip(values, baselines, strict=True))
    r = statistics.median(ratios)
    paired = f"per-round ratios {ratios[0]:.2f}..{ratios[-1]:.2f}"
    return Record(
        name, v, unit, b, r, f">= {min_ratio:g}x", r >= min_ratio,
        spread(values), spread(baselines), f"{note}; {paired}" if note else paired,
    )  # fmt: skip


def lower_is_better(
    name: str,
    value: float,
    baseline: float,
    unit: str,
    max_ratio: float,
    spreads: tuple[float, float] = (0.0, 0.0),
    note: str = "",
) -> Record:
    """A latency-like metric whose goal is ``value/baseline <= max_ratio``."""
    r = ratio(value, baseline)
    return Record(
        name, value, unit, baseline, r, f"<= {max_ratio:g}x", r <= max_ratio,
        spreads[0], spreads[1], note,
    )  # fmt: skip


def sink() -> Callable[[object], None]:
    """A C-level no-op ``emit``: costs the same on both sides and keeps nothing alive."""
    d: deque[object] = deque(maxlen=0)
    return d.append


def spread(xs: Sequence[float]) -> float:
    """Half the range of *xs*: the ``±`` printed next to a median."""
    return (max(xs) - min(xs)) / 2 if len(xs) > 1 else 0.0


def percentile(xs: Sequence[float], p: float) -> float:
    """The *p*-th percentile (0-100) of *xs*, nearest-rank on the sorted data."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no samples")
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def interleave(
    sides: dict[str, Callable[[], T]], rounds: int, warmup: int = 1
) -> dict[str, list[T]]:
    """Run each side once per round, alternating which goes first (A B, B A, A B, ...).

    *warmup* rounds run first and are thrown away (imports, caches, thread start-up).
    Returns the results of each side, in round order.
    """
    names = list(sides)
    out: dict[str, list[T]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            result = sides[n]()
            if i >= warmup:
                out[n].append(result)
    return out


@contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic GC out of a timed region (both sides get the same treatment)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def fmt_value(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "inf"
    if unit in ("msgs/s", "outputs/s"):
        return f"{x / 1e6:.3f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3g}"


def format_table(records: Sequence[Record]) -> str:
    """A Markdown table: value ± spread, baseline ± spread, ratio, goal, met, note."""
    head = ["metric", "unit", "enginecore", "baseline", "ratio", "goal", "met", "note"]
    rows = [head, ["---"] * len(head)]
    for r in records:
        rows.append(
            [
                r.name,
                r.unit,
                f"{fmt_value(r.value, r.unit)} ± {fmt_value(r.spread, r.unit)}",
                f"{fmt_value(r.baseline, r.unit)} ± {fmt_value(r.baseline_spread, r.unit)}",
                "inf" if not math.isfinite(r.ratio) else f"{r.ratio:.2f}x",
                r.goal,
                "yes" if r.met else "NO",
                r.note,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for row in rows:
        cells = [("-" * widths[i]) if c == "---" else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str, records: Sequence[Record], quick: bool) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump([r.as_json() for r in records], f, indent=2)
        f.write("\n")


def main_single(run: Callable[[bool], list[Record]], doc: str | None) -> None:
    """``python -m benchmarks.bench_x [--quick] [--json PATH]`` for one benchmark module."""
    first = (doc or "").strip().splitlines()
    parser = argparse.ArgumentParser(description=first[0] if first else None)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    args = parser.parse_args()
    t0 = time.perf_counter()
    try:
        records = run(args.quick)
    except Skipped as exc:
        print(f"skipped: {exc}")
        return
    print(format_table(records))
    print(f"\n({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:
        write_json(args.json, records, args.quick)
