"""Run every benchmark and print one table: enginecore next to its raw baseline, same run.

Usage::

    python -m benchmarks                    # full run, over 10 minutes
    python -m benchmarks --quick            # smoke run for CI (never gates on a time)
    python -m benchmarks --json out.json --chart docs/performance.png --markdown out.md
    python -m benchmarks --only throughput,wake_latency
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from ._cli import output_path, run_main
from ._harness import Record, Skipped, fmt_per_round, fmt_ratio, format_table, write_json

MODULES = (
    "bench_idle_cpu",
    "bench_throughput",
    "bench_overhead",
    "bench_statistics",
    "bench_wake_latency",
    "bench_shutdown_latency",
    "bench_gil_release",
    "bench_pipeline",
    "bench_stage_utility",
    "bench_stage_output",
    "bench_stage_load",
    "bench_stage_ingest",
    "bench_stage_requests",
    "bench_stage_arrays",
    "bench_stage_curve",
    "bench_ray",
    "bench_pool",
    "bench_stage_pipeline",
    "bench_metrics",
    "bench_pool_faults",
    "bench_pool_shared",
    "bench_pipeline_faults",
    "bench_pipeline_pool",
    "bench_transformers",
    "bench_transformers_aborts",
    "bench_openai_server",
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms"
    )


def write_chart(path: str, records: Sequence[Record]) -> bool:
    """One small panel per metric: baseline and enginecore bars, titled with the ratio."""
    if not records:  # every benchmark skipped or failed: nothing to draw (0 rows: an error)
        print("chart skipped: no records", file=sys.stderr)
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart skipped: needs matplotlib (pip install -e '.[bench]')", file=sys.stderr)
        return False
    cols = 3
    rows = (len(records) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.1 * rows), squeeze=False)
    for ax, r in zip(axes.flat, records, strict=False):
        colors = ["#9e9e9e", "#2e7d32" if r.met else "#c62828"]
        heights = [r.baseline, r.value]
        spreads = [r.baseline_spread, r.spread]
        # A bar cannot go below zero; clip the lower half of the spread.
        lower = [min(sp, h) for sp, h in zip(spreads, heights, strict=True)]
        ax.bar(
            ["baseline", "enginecore"],
            heights,
            yerr=[lower, spreads],
            color=colors,
            capsize=4,
        )
        if not any(heights):
            ax.set_ylim(0, 1)
        ratio = fmt_ratio(r.ratio)
        ax.set_title(
            f"{r.name}\n{ratio} (rounds {fmt_per_round(r)}), goal {r.goal}: "
            f"{'met' if r.met else 'MISSED'}",
            fontsize=8,
        )
        ax.set_ylabel(r.unit, fontsize=8)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(records) :]:
        ax.set_visible(False)
    fig.suptitle(f"enginecore vs raw baselines, same run\n{machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="enginecore benchmarks, each side by side with its raw baseline.",
    )
    parser.add_argument("--quick", action="store_true", help="small smoke run (a few minutes)")
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="write one JSON object per metric"
    )
    parser.add_argument(
        "--chart", metavar="PATH", type=output_path, help="write a PNG chart (needs matplotlib)"
    )
    parser.add_argument(
        "--markdown", metavar="PATH", type=output_path, help="write the table as Markdown"
    )
    parser.add_argument(
        "--only",
        metavar="NAMES",
        help=f"comma-separated subset of: {', '.join(m.removeprefix('bench_') for m in MODULES)}",
    )
    args = parser.parse_args(argv)

    selected = list(MODULES)
    if args.only is not None:
        wanted = {n.strip().removeprefix("bench_") for n in args.only.split(",") if n.strip()}
        if not wanted:
            parser.error(f"--only names no benchmark: {args.only!r}")
        unknown = wanted - {m.removeprefix("bench_") for m in MODULES}
        if unknown:
            parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        selected = [m for m in MODULES if m.removeprefix("bench_") in wanted]

    header = f"{'quick' if args.quick else 'full'} run on {machine()}"
    print(header, flush=True)
    records: list[Record] = []
    failed: list[str] = []
    t_all = time.perf_counter()
    for name in selected:
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"{__package__}.{name}")
            run: Callable[[bool], list[Record]] = mod.run
            got = run(args.quick)
        except Skipped as exc:
            print(f"  {name}: skipped: {exc}", file=sys.stderr, flush=True)
            continue
        except Exception:
            # One broken benchmark must not lose the others' records (minutes of them):
            # its traceback now, the run goes on, and the command fails at the end.
            print(f"  {name}: FAILED:", file=sys.stderr, flush=True)
            traceback.print_exc()
            failed.append(name)
            continue
        records.extend(got)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    table = format_table(records)
    print()
    print(table)
    # A row reported without a goal (an A/A control, a p99 for the record) is not a goal met.
    judged = [r for r in records if r.goal != "report"]
    missed = [r.name for r in judged if not r.met]
    reported = len(records) - len(judged)
    print(f"\n{len(judged) - len(missed)}/{len(judged)} goals met", end="")
    print(f"; missed: {', '.join(missed)}" if missed else "", end="")
    print(
        f"; {reported} row{'s' if reported != 1 else ''} reported without a goal"
        if reported
        else "",
        end="",
    )
    print(f" ({time.perf_counter() - t_all:.0f} s)")

    if args.json:
        write_json(args.json, records, args.quick)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(f"{header}\n\n{table}\n")
    if args.chart:
        write_chart(args.chart, records)
    if failed:
        print(f"failed (no records): {', '.join(failed)}", file=sys.stderr)
        return 1
    # Timing never fails the command: CI runs --quick as a smoke test only.
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
