"""Soak and fuzz the stage process: no single request, client or frame may take it down,
lose a request or leak. Not a timed benchmark: every expectation is a count, and the script
exits 1 if one does not hold. ``docs/soak.md`` has the results of a full run.

Usage (from the repository root)::

    python -m benchmarks.soak_stage              # full run: 100,000 adds, 1,000,000 requests
    python -m benchmarks.soak_stage --quick      # a few seconds (what tests/test_soak.py runs)
    python -m benchmarks.soak_stage --adds 20000 --requests 0 --seed 7

Phase 1, **fuzz** (``_soak_fuzz``): *adds* adds against ``python -m enginecore serve
--keep-requests-on-detach`` serving :class:`~benchmarks._soak_engine.SoakEngine`, 30 %
invalid: malformed frames from a raw peer (``_soak_frames``), data the engine rejects,
duplicate ids across two peers and across two sessions, outputs that cannot be encoded, and
data the client cannot encode. Expected: 0 stage deaths; exactly one error for each invalid
request (``error`` for its id, an unscoped ``error`` for a frame with no readable id, a failed
answer for a call, a ``reject`` for a ``hello``); every valid request completed.

Phase 2, **abort** (``_soak_abort``): *requests* requests through a launched stage, 30 % of
them aborted at a random point of their life. Expected: 0 lost, 0 outputs after an abort,
and the stage's RSS flat within +-10 % after warm-up.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from ._cli import at_least, run_main
from ._soak_abort import AbortConfig, run_abort
from ._soak_engine import POISONS
from ._soak_fuzz import FuzzConfig, run_fuzz
from ._soak_report import PhaseReport

__all__ = ["main", "run"]

QUICK_ADDS = 10_000
QUICK_REQUESTS = 50_000


def run(
    adds: int,
    requests: int,
    *,
    seed: int = 1,
    handovers: int = 10,
    abort_share: float = 0.3,
    warmup: float = 0.1,
    poisons: Sequence[str] = tuple(POISONS),
    on_report: Callable[[PhaseReport], None] | None = None,
) -> list[PhaseReport]:
    """Run the phases whose count is not 0; their reports, each also given to *on_report*
    as soon as its phase ends (phase 2's also if Ctrl-C stops it: what it counted so far,
    without a verdict, before the interrupt goes on)."""
    reports = []
    if adds:
        cfg = FuzzConfig(adds=adds, seed=seed, handovers=handovers, poisons=poisons)
        reports.append(run_fuzz(cfg))
        if on_report is not None:
            on_report(reports[-1])
    if requests:
        reports.append(
            run_abort(
                AbortConfig(requests=requests, seed=seed, abort_share=abort_share, warmup=warmup),
                on_interrupt=on_report,
            )
        )
        if on_report is not None:
            on_report(reports[-1])
    return reports


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak_stage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small counts: {QUICK_ADDS:,} adds, {QUICK_REQUESTS:,} requests, 2 handovers",
    )
    parser.add_argument(
        "--adds", type=at_least(0), help="phase 1 adds (default 100,000; 0 skips it)"
    )
    parser.add_argument(
        "--requests", type=at_least(0), help="phase 2 requests (default 1,000,000; 0 skips it)"
    )
    parser.add_argument(
        "--handovers",
        type=at_least(0),
        help="phase 1 session handovers, evenly spaced (default 10)",
    )
    parser.add_argument(
        "--poison-kinds",
        default=",".join(POISONS),
        help="the unencodable outputs made in phase 1, comma-separated (default: all of "
        + ", ".join(POISONS)
        + ")",
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds every draw (default 1)")
    args = parser.parse_args(argv)
    poisons = [k.strip() for k in args.poison_kinds.split(",") if k.strip()]
    unknown = set(poisons) - set(POISONS)
    if unknown:
        parser.error(f"unknown poison kinds {sorted(unknown)}; known: {', '.join(POISONS)}")
    if not poisons:
        parser.error(f"--poison-kinds names no kind; known: {', '.join(POISONS)}")
    adds = args.adds if args.adds is not None else (QUICK_ADDS if args.quick else 100_000)
    requests = (
        args.requests
        if args.requests is not None
        else (QUICK_REQUESTS if args.quick else 1_000_000)
    )
    handovers = args.handovers if args.handovers is not None else (2 if args.quick else 10)
    if not adds and not requests:
        parser.error("--adds and --requests are both 0: nothing to run")
    print(
        f"stage soak: {adds:,} adds, {requests:,} requests, seed {args.seed}, "
        f"commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M %Z')}",
        flush=True,
    )
    start = time.monotonic()
    shown: list[PhaseReport] = []

    def show(report: PhaseReport) -> None:
        # Each phase's table as soon as it ends: a run stopped by Ctrl-C in phase 2 still
        # shows phase 1's, and phase 2's counts so far.
        print()
        print(report.render(), flush=True)
        shown.append(report)

    reports = run(
        adds, requests, seed=args.seed, handovers=handovers, poisons=poisons, on_report=show
    )
    for report in reports:
        if not any(report is s for s in shown):
            show(report)
    ok = all(r.ok for r in reports)
    print(f"\n{'PASS' if ok else 'FAIL'}: {time.monotonic() - start:.1f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
