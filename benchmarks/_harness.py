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
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "NoopEngine",
    "Record",
    "Skipped",
    "fmt_per_round",
    "fmt_ratio",
    "fmt_value",
    "format_table",
    "gc_on",
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

    ``per_round`` holds the figure the goal is judged on, one per round (or sample block, or
    window), in round order; ``per_round_unit`` says what it is: ``"x"`` for a ratio
    enginecore/baseline of that round, else the unit of an absolute figure (a difference
    over the baseline, a CPU budget, ...). A goal is met only when **every** round clears
    the line: for a higher-is-better goal the lowest per-round figure, for a lower-is-better
    one the highest (see :func:`higher_is_better`, :func:`lower_is_better`). A record
    without rounds leaves ``per_round`` empty and says in ``note`` how it was judged.

    ``ratio`` is the median of the per-round ratios where there are paired rounds, else
    ``value / baseline``. ``spread`` and ``baseline_spread`` are the half-range of each
    side's per-round results (same unit as the value).
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
    per_round: tuple[float, ...] = ()
    per_round_unit: str = "x"

    @property
    def per_round_min(self) -> float | None:
        return min(self.per_round) if self.per_round else None

    @property
    def per_round_max(self) -> float | None:
        return max(self.per_round) if self.per_round else None

    def as_json(self) -> dict[str, object]:
        d = asdict(self)
        # JSON has no inf/nan; a zero baseline (idle CPU) gives an infinite ratio.
        d["ratio"] = _finite(self.ratio)
        d["per_round"] = [_finite(x) for x in self.per_round]
        lo, hi = self.per_round_min, self.per_round_max
        d["per_round_min"] = None if lo is None else _finite(lo)
        d["per_round_max"] = None if hi is None else _finite(hi)
        return d


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


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
    """A throughput-like metric from paired rounds; goal: every round's ratio ``>= min_ratio``.

    ``values[i]`` and ``baselines[i]`` ran back to back in round *i*, so they saw the same
    machine. The reported ratio is the median of the per-round ratios, which cancels the
    drift between rounds that a ratio of two medians would keep; the verdict is the
    **lowest** per-round ratio against the goal, so a goal whose spread straddles the line
    is missed.
    """
    ratios = tuple(ratio(x, y) for x, y in zip(values, baselines, strict=True))
    return Record(
        name, statistics.median(values), unit, statistics.median(baselines),
        statistics.median(ratios), f">= {min_ratio:g}x", min(ratios) >= min_ratio,
        spread(values), spread(baselines), note, ratios,
    )  # fmt: skip


def lower_is_better(
    name: str,
    values: Sequence[float],
    baselines: Sequence[float],
    unit: str,
    max_ratio: float,
    pooled: tuple[float, float] | None = None,
    note: str = "",
) -> Record:
    """A latency-like metric from paired rounds; goal: every round's ratio ``<= max_ratio``.

    ``values[i]`` and ``baselines[i]`` are round (or sample block) *i* of each side, taken
    back to back. The ratio is the median of the per-round ratios and the verdict is the
    **highest** one against the goal. The value and baseline shown are the medians of the
    rounds, or *pooled* ``(value, baseline)`` where given (percentiles over every sample).
    """
    ratios = tuple(ratio(x, y) for x, y in zip(values, baselines, strict=True))
    if pooled is None:
        pooled = (statistics.median(values), statistics.median(baselines))
    v, b = pooled
    return Record(
        name, v, unit, b, statistics.median(ratios), f"<= {max_ratio:g}x",
        max(ratios) <= max_ratio, spread(values), spread(baselines), note, ratios,
    )  # fmt: skip


def report_only(rec: Record) -> Record:
    """*rec* as a figure reported without a goal (``goal="report"``, counted as met): its
    rounds are kept out of the verdict columns, and the note gives them."""
    rounds = ", ".join(f"{x:.3g}" for x in rec.per_round)
    note = f"{rec.note}; report only, not judged against a goal (rounds: {rounds})"
    fields = {**rec.__dict__, "goal": "report", "met": True, "per_round": (), "note": note}
    return Record(**fields)


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


class PairedRound(NamedTuple):
    """One round of :func:`paired_blocks`: each side's median seconds per unit over its runs,
    and the median of the paired differences (*a* - *b*), the round's cost figure."""

    a: float
    b: float
    diff: float


def paired_blocks(
    a: Callable[[], float], b: Callable[[], float], rounds: int, blocks: int
) -> list[PairedRound]:
    """Rounds of a cost measurement of two sides in one process (*a*, *b*: each runs a short
    block and returns seconds per unit). A round is *blocks* pairs of runs, the sides
    alternated (``A B, B A, A B, ...``); its cost figure is the median of the pairs'
    differences. A pause of this shared machine (a neighbour's burst, a preemption, a
    collection) then spoils one pair, not the round, and a slow stretch covers both sides
    of a pair alike. One warm-up pair runs first."""
    a()
    b()
    out: list[PairedRound] = []
    for _ in range(rounds):
        xs: list[float] = []
        ys: list[float] = []
        for j in range(blocks):
            if j % 2:
                ys.append(b())
                xs.append(a())
            else:
                xs.append(a())
                ys.append(b())
        diffs = [x - y for x, y in zip(xs, ys, strict=True)]
        out.append(
            PairedRound(statistics.median(xs), statistics.median(ys), statistics.median(diffs))
        )
    return out


@contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic GC out of a timed region (both sides get the same treatment).

    Only for the core micro-benchmarks of the loop, which time code paths of a few hundred
    nanoseconds in one process: a collection there costs far more than the code under test
    and lands on whichever side happens to cross the allocation threshold, noise that is
    neither side's own cost. The stage benchmarks run with the GC on (:func:`gc_on`).
    """
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextmanager
def gc_on() -> Iterator[None]:
    """A timed region with the cyclic GC **on**, as users run (the stage benchmarks).

    Collects first, outside the clock, so that no side pays for garbage that the side
    before it left; then makes sure the GC is enabled, and restores its state after.
    """
    gc.collect()
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was:
            gc.disable()


def fmt_value(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "inf"
    if unit in ("msgs/s", "outputs/s"):
        return f"{x / 1e6:.3f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3g}"


def fmt_per_round(r: Record) -> str:
    """The range of the per-round figures a record is judged on, or ``n/a`` without rounds."""
    lo, hi = r.per_round_min, r.per_round_max
    if lo is None or hi is None:
        return "n/a"
    if r.per_round_unit == "x":
        return f"{fmt_ratio(lo).removesuffix('x')}..{fmt_ratio(hi)}"
    return f"{lo:.3g}..{hi:.3g} {r.per_round_unit}"


def fmt_ratio(x: float) -> str:
    """``1.23x``; ``inf`` for an infinite ratio (a zero baseline), ``n/a`` for none (NaN: an
    absolute line without a baseline)."""
    if math.isnan(x):
        return "n/a"
    return "inf" if not math.isfinite(x) else f"{x:.2f}x"


def format_table(records: Sequence[Record]) -> str:
    """A Markdown table: value ± spread, baseline ± spread, median ratio, the per-round range
    the verdict is judged on, goal, met, note."""
    head = [
        "metric", "unit", "enginecore", "baseline", "ratio", "per round (judged)", "goal", "met",
        "note",
    ]  # fmt: skip
    rows = [head, ["---"] * len(head)]
    for r in records:
        rows.append(
            [
                r.name,
                r.unit,
                f"{fmt_value(r.value, r.unit)} ± {fmt_value(r.spread, r.unit)}",
                f"{fmt_value(r.baseline, r.unit)} ± {fmt_value(r.baseline_spread, r.unit)}",
                fmt_ratio(r.ratio),
                fmt_per_round(r),
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
    from ._cli import output_path, run_main

    first = " ".join((doc or "").strip().split("\n\n")[0].split())  # the first paragraph
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    parser = argparse.ArgumentParser(
        prog=f"python -m {spec.name}" if spec is not None else None,
        description=first or None,
    )
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="also write the records as JSON"
    )

    def main(argv: Sequence[str] | None) -> int:
        args = parser.parse_args(argv)
        t0 = time.perf_counter()
        try:
            records = run(args.quick)
        except Skipped as exc:
            print(f"skipped: {exc}")
            return 0
        print(format_table(records))
        print(f"\n({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        if args.json:
            write_json(args.json, records, args.quick)
        return 0

    code = run_main(main)
    if code:
        sys.exit(code)
