"""A real stage process: a CountdownEngine in a child process, driven through StageClient.

Run it:  python examples/toy_stage.py     (Ctrl-C or SIGTERM ends it early, cleanly)

The parent launches the stage (multiprocessing spawn; the engine loop runs on the child's
main thread, with ZMQ IO threads around it), submits about a thousand requests of random
length, aborts some of them mid-stream, calls a few utilities, reads the ordered event
stream until every request has finished or been aborted, showing a progress bar fed by the
stage's load reports (``client.load()``), prints a summary and the stage's own statistics
(``client.stats()``), and shuts the stage down. Exit code 0 when the stage shut down
cleanly.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from collections.abc import Callable

from enginecore.stage import Aborted, Outputs, StageClient, UtilityError

N_REQUESTS = 1000
ABORT_FRACTION = 0.1
SEED = 2024


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


class Progress:
    """A one-line progress bar on a terminal (redrawn at most 10 times a second); elsewhere
    (a pipe, a log), a line at each quarter."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stdout.isatty()
        self._drawn_at = 0.0
        self._quarter = 0

    def update(self, done: int, load: LoadLine) -> None:
        now = time.perf_counter()
        if self.tty:
            if now - self._drawn_at < 0.1 and done < self.total:
                return
            self._drawn_at = now
            filled = 30 * done // self.total
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r[{bar}] {done}/{self.total} {load}", end="", flush=True)
            if done >= self.total:
                print()
        elif 4 * done >= (self._quarter + 1) * self.total:
            self._quarter = 4 * done // self.total
            print(f"progress   {100 * done // self.total:3d}% ({done}/{self.total}) {load}")


class LoadLine:
    """What the stage's latest load report says, for the progress bar."""

    def __init__(self, client: StageClient) -> None:
        self.client = client

    def __str__(self) -> str:
        load = self.client.load()  # pushed with the outputs; reading it sends nothing
        if load is None:
            return ""
        running = int(load.engine.get("running", load.live))
        return f"{running:4d} running, report {load.age * 1e3:4.1f} ms old"


def main() -> int:
    rng = random.Random(SEED)
    started = time.perf_counter()
    # "enginecore:CountdownEngine" is the import string of the factory: the class itself.
    with StageClient.launch("enginecore:CountdownEngine", ordered_events=True) as client:
        print(f"stage up in {time.perf_counter() - started:.2f} s (pid {client.pid})")

        # One request consumed through its own iterator.
        hello = client.add("hello", 4)
        print(f"request 'hello' streamed {list(hello)}, finished={hello.finished}")

        # A thousand more in one frame, without streams: consumed through the ordered
        # event stream, a batch of events at a time.
        t0 = time.perf_counter()
        items = [(f"req-{i}", rng.randint(1, 512)) for i in range(N_REQUESTS)]
        client.add_many(items, streams=False)
        added_at = dict.fromkeys((rid for rid, _ in items), time.perf_counter())
        # Abort a tenth of them at once: the stage applies it between two steps.
        client.abort(rng.sample(sorted(added_at), int(N_REQUESTS * ABORT_FRACTION)))
        live_now = client.call_utility_future("num_requests")
        third = client.call_utility_future("div", 1, 3)
        by_zero = client.call_utility_future("div", 1, 0)

        latencies: list[float] = []
        completed: set[str] = set()
        aborted: set[str] = set()
        outputs = 0
        progress, load_line = Progress(N_REQUESTS), LoadLine(client)
        while len(completed) + len(aborted) < N_REQUESTS:
            for event in client.get_events(timeout=30):
                if isinstance(event, Outputs):  # one engine step's outputs
                    now = time.perf_counter()
                    for rid, finished in zip(event.req_ids, event.finished, strict=True):
                        if rid not in added_at:
                            continue
                        outputs += 1
                        if finished:
                            completed.add(rid)
                            latencies.append(now - added_at[rid])
                elif isinstance(event, Aborted):
                    # Ids that had already finished are reported too; they stay completed.
                    aborted.update(rid for rid in event.req_ids if rid not in completed)
            progress.update(len(completed) + len(aborted), load_line)
        elapsed = time.perf_counter() - t0

        print(f"utility num_requests -> {live_now.result(5)}")
        print(f"utility div(1, 3)    -> {third.result(5):.4f}")
        try:
            by_zero.result(5)
        except UtilityError as exc:
            print(f"utility div(1, 0)    -> error {exc.remote_repr}")
        stats = client.stats()  # answered by the stage without waiting for its loop
        exit_code = client.shutdown()

    latencies.sort()
    print()
    print(f"requests   {N_REQUESTS}: {len(completed)} completed, {len(aborted)} aborted")
    print(f"outputs    {outputs} in {elapsed:.2f} s")
    print(
        f"throughput {len(completed) / elapsed:,.0f} requests/s, {outputs / elapsed:,.0f} outputs/s"
    )
    print(
        f"latency    p50 {percentile(latencies, 0.5) * 1e3:.1f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1e3:.1f} ms (add -> finished)"
    )
    loop = stats.loop
    print(
        f"stage      {loop.steps} steps, step p50 <= {loop.step_quantile(0.5) * 1e3:g} ms, "
        f"p99 <= {loop.step_quantile(0.99) * 1e3:g} ms, max {loop.step_seconds_max * 1e3:.1f} ms"
    )
    print(
        f"           busy {loop.busy_seconds:.2f} s, idle {loop.idle_seconds:.2f} s; "
        f"{stats.outputs} outputs, {loop.adds} adds, {loop.aborts} aborts, "
        f"{stats.load_reports} load reports"
    )
    print(f"stage      exited with code {exit_code}")
    return 0 if exit_code == 0 else 1


def cli(main: Callable[[], int | None]) -> int:
    """Run *main* as a command: ``--help`` prints this module's docstring, and Ctrl-C or
    SIGTERM stops it early, cleanly: the ``with`` blocks shut the stages down on the way out,
    then one line on stderr and status 130 or 143 (no traceback, nothing left behind)."""
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    terminated = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return main() or 0
    except KeyboardInterrupt:
        print("terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(cli(main))
