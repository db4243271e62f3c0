"""``python -m enginecore top ADDRESS...``: a live terminal view of one or more stages.

Each stage is read as an *observer* (:class:`~enginecore.stage.StageObserver`): a ``stats``
request on its input socket, answered by the stage's input thread, so ``top`` works beside
the client that uses the stage, never attaches, and never waits for a step. Every interval
it asks every stage at once and waits for the answers until the next tick, so a stage that
does not answer delays none of the others. Rates and step-time quantiles are computed from
the difference between two answers of a stage (the stage's own uptime is the clock).

A stage served with CURVE is observed with a listed key pair and the stage's public key
(``--curve-secret-key FILE --curve-server-key FILE``, ``docs/security.md``); a refused
observer shows the :class:`~enginecore.stage.AuthenticationError` under the table.

Needs the ``zmq`` extra and ``rich`` (the ``top`` extra: ``pip install 'enginecore[top]'``),
both imported only when ``top`` runs.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import select
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._stats import STEP_BUCKETS, quantile

if TYPE_CHECKING:
    from rich.table import Table

    from .stage import CurveKeys, StageObserver, StageStatistics

__all__ = ["DEAD_AFTER", "STALLED_AFTER", "StageRow", "main"]

STALLED_AFTER = 2.0
"""Seconds without an answer from a stage that answered before: ``stalled`` (a stopped or
starved process, as ``client.health()`` says after two heartbeat intervals)."""
DEAD_AFTER = 5.0
"""Seconds without an answer from a stage that answered before: ``dead`` (the heartbeat
timeout of a connected client)."""


@dataclass
class StageRow:
    """What ``top`` knows of one stage: its latest answer, and the rates since the one
    before it."""

    address: str
    stats: StageStatistics | None = None
    answered_at: float | None = None  # time.monotonic() of the latest answer
    steps_per_s: float | None = None
    outputs_per_s: float | None = None
    p50: float | None = None  # step time quantiles (seconds; an upper bound), None: no step
    p99: float | None = None
    window: str = ""  # what p50 and p99 cover: "interval" or "run"
    error: str | None = None

    def update(self, stats: StageStatistics, now: float) -> None:
        """A new answer: rates and quantiles from the difference with the previous one
        (over the whole run for the first, and after the stage restarted)."""
        prev = self.stats
        hist = stats.loop.step_histogram
        if prev is not None and prev.pid == stats.pid and stats.steps >= prev.steps:
            dt = stats.uptime_seconds - prev.uptime_seconds
            if dt > 0:
                self.steps_per_s = (stats.steps - prev.steps) / dt
                self.outputs_per_s = (stats.outputs - prev.outputs) / dt
            delta = tuple(a - b for a, b in zip(hist, prev.loop.step_histogram, strict=True))
            if any(delta):
                self.p50, self.p99 = _quantiles(delta)
                self.window = "interval"
            elif self.window != "interval":
                self.p50, self.p99 = _quantiles(hist)
            # else: no step since the last answer; keep the last interval's quantiles
        else:
            self.steps_per_s = self.outputs_per_s = None
            self.p50, self.p99 = _quantiles(hist)
            self.window = "run"
        self.stats = stats
        self.answered_at = now
        self.error = None

    def health(self, now: float) -> str:
        """``ok``, ``stalled``, ``dead`` or ``unreachable`` (never answered)."""
        if self.answered_at is None:
            return "unreachable"
        silent = now - self.answered_at
        if silent >= DEAD_AFTER:
            return "dead"
        if silent >= STALLED_AFTER:
            return "stalled"
        if self.stats is not None and self.stats.stalled:
            return "stalled"  # it answers, but a step has run past its step_timeout
        return "ok"


def _quantiles(hist: tuple[int, ...]) -> tuple[float | None, float | None]:
    if not any(hist):
        return None, None
    return quantile(hist, STEP_BUCKETS, 0.5), quantile(hist, STEP_BUCKETS, 0.99)


class Poller:
    """Asks every stage for its statistics and gathers the answers. *curve*: the
    :class:`~enginecore.stage.CurveKeys` of each stage (``None``: without CURVE), one per
    address."""

    def __init__(
        self, addresses: Sequence[str], curve: Sequence[CurveKeys | None] | None = None
    ) -> None:
        import zmq

        from .stage import StageObserver

        self._zmq = zmq
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.rows = [StageRow(a) for a in addresses]
        keys = list(curve) if curve is not None else [None] * len(addresses)
        self._observers: list[StageObserver | None] = []
        for row, key in zip(self.rows, keys, strict=True):
            try:
                self._observers.append(StageObserver(row.address, self._ctx, curve=key))
            except zmq.ZMQError as exc:  # a malformed address: shown, not fatal
                row.error = str(exc)
                self._observers.append(None)
        self._waiting: set[int] = set()

    def request(self) -> None:
        """Ask every stage; the answers are taken by :meth:`collect`."""
        self._waiting = set()
        for i, obs in enumerate(self._observers):
            if obs is not None:
                obs.request()
                self._waiting.add(i)

    def collect(self, until: float, stdin: int | None = None) -> bool:
        """Take answers until every stage answered or *until* (``time.monotonic()``) has
        passed; a key pressed on *stdin* meanwhile is read. Returns whether it was ``q``."""
        zmq = self._zmq
        poller = zmq.Poller()
        for i in self._waiting:
            obs = self._observers[i]
            assert obs is not None
            poller.register(obs.socket, zmq.POLLIN)
            poller.register(obs.monitor, zmq.POLLIN)
        if stdin is not None:
            poller.register(stdin, zmq.POLLIN)
        while self._waiting:
            left = until - time.monotonic()
            if left <= 0:
                return False
            # At most an hour a poll: libzmq takes the milliseconds as a C int (24.8 days).
            ready = dict(poller.poll(min(max(1, math.ceil(left * 1000)), 3_600_000)))
            if stdin is not None and stdin in ready and _quit_key(stdin):
                return True
            for i in list(self._waiting):
                obs = self._observers[i]
                assert obs is not None
                row = self.rows[i]
                if obs.monitor in ready:
                    failure = obs.failure()
                    if failure is not None:  # refused (CURVE): shown, not waited for
                        row.error = str(failure)
                        self._waiting.discard(i)
                        poller.unregister(obs.socket)
                        poller.unregister(obs.monitor)
                        continue
                if obs.socket not in ready:
                    continue
                try:
                    stats = obs.answer()
                except Exception as exc:  # a stage that answers nonsense: shown
                    row.error = str(exc)
                    stats = None
                if stats is not None:
                    row.update(stats, time.monotonic())
                    self._waiting.discard(i)
                    poller.unregister(obs.socket)
                    poller.unregister(obs.monitor)
        return False

    def close(self) -> None:
        for obs in self._observers:
            if obs is not None:
                obs.close()
        self._ctx.term()


def _quit_key(fd: int) -> bool:
    try:
        data = os.read(fd, 64)
    except OSError:
        return False
    return not data or b"q" in data or b"Q" in data  # EOF: nobody can press q any more


def _fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def _fmt_step(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return f">{STEP_BUCKETS[-1]:g} s"
    if seconds < 1.0:
        return f"≤{seconds * 1e3:g} ms"
    return f"≤{seconds:g} s"


_HEALTH_STYLE = {"ok": "green", "stalled": "yellow", "dead": "bold red", "unreachable": "red"}


def render(rows: Sequence[StageRow], now: float, *, interval: float, live: bool) -> Table:
    """The table of *rows*, as it is at *now*."""
    from rich.table import Table
    from rich.text import Text

    title = f"enginecore top: {len(rows)} stage{'s' if len(rows) != 1 else ''}"
    if live:
        title += f", every {interval:g} s; q quits"
    table = Table(title=title, title_justify="left", expand=False)
    for name, justify in (
        ("stage", "left"),
        ("pid", "right"),
        ("address", "left"),
        ("health", "left"),
        ("steps/s", "right"),
        ("outputs/s", "right"),
        ("running", "right"),
        ("waiting", "right"),
        ("queue", "right"),
        ("step p50", "right"),
        ("step p99", "right"),
        ("backlog", "right"),
        ("cut", "right"),
    ):
        # Numbers and health keep their width; a narrow terminal shortens the names.
        shrinks = name in ("stage", "address")
        table.add_column(
            name,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=True,
            min_width=None if shrinks else max(len(name), 11 if name == "health" else 5),
        )
    for row in rows:
        health = row.health(now)
        s = row.stats
        if s is None:
            table.add_row(
                "-",
                "-",
                Text(row.address),
                Text(health, style=_HEALTH_STYLE[health]),
                *["-"] * 9,
            )
            continue
        engine = s.engine
        running = engine.get("running", s.live)
        waiting = engine.get("waiting")
        table.add_row(
            Text(s.name),
            str(s.pid),
            Text(row.address),
            Text(health, style=_HEALTH_STYLE[health]),
            _fmt_rate(row.steps_per_s),
            _fmt_rate(row.outputs_per_s),
            f"{running:g}",
            "-" if waiting is None else f"{waiting:g}",
            str(s.loop.queue_depth),
            _fmt_step(row.p50),
            _fmt_step(row.p99),
            str(s.backlog),
            str(s.cut_clients),
        )
    errors = [f"{r.address}: {r.error}" for r in rows if r.error]
    if errors:
        # Text, not a str: rich would read "[...]" in an error (a Z85 key, an IPv6
        # address, a stage's name) as its markup, and raise on a closing tag it cannot match.
        table.caption = Text("\n".join(errors))
        table.caption_justify = "left"
    return table


@contextlib.contextmanager
def _keys() -> Iterator[int | None]:
    """stdin in cbreak mode (keys arrive one by one, unechoed; Ctrl-C still interrupts),
    restored afterwards; ``None`` when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (``kill``, ``timeout``, a supervisor) quits the live view as Ctrl-C does:
    its default action would end the process at once, leaving the terminal in the
    alternate screen, in cbreak mode (typing unechoed) and with the cursor hidden."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print_once(table: Table) -> None:
    from rich.console import Console
    from rich.measure import Measurement

    if sys.stdout.isatty():
        Console().print(table)
        return
    # Not a terminal (a pipe, a file): as wide as the table wants, no colour, no styles.
    wide = Console(width=10_000, no_color=True)
    width = Measurement.get(wide, wide.options, table).maximum
    out = io.StringIO()
    Console(file=out, width=width, no_color=True, highlight=False).print(table)
    # Without the padding a title or caption gets to the table's width.
    sys.stdout.write("".join(line.rstrip() + "\n" for line in out.getvalue().splitlines()))


def _once(poller: Poller, interval: float) -> int:
    """Two rounds *interval* apart, the table printed as soon as the second is in (printed
    an interval later, every answer read a healthy stage ``stalled`` past 2 s). Exit code
    1 unless every stage answered the second round: one that answered only the first is
    named under the table."""
    tick = time.monotonic() + interval
    poller.request()
    poller.collect(tick)
    first = [row.answered_at for row in poller.rows]
    time.sleep(max(0.0, tick - time.monotonic()))  # the rates cover one interval
    poller.request()
    poller.collect(time.monotonic() + interval)
    silent = 0
    for row, before in zip(poller.rows, first, strict=True):
        if row.answered_at is None or row.answered_at == before:
            silent += 1
            if row.answered_at is not None and row.error is None:
                row.error = f"no answer to the second request within {interval:g} s"
    _print_once(render(poller.rows, time.monotonic(), interval=interval, live=False))
    return 1 if silent else 0


def run(
    addresses: Sequence[str],
    *,
    interval: float,
    once: bool,
    curve: Sequence[CurveKeys | None] | None = None,
) -> int:
    """``top``: until ``q`` or Ctrl-C; with *once*, two rounds *interval* apart (so that
    the rates mean something), one table printed. *curve*: each stage's keys, as
    :class:`Poller`'s. Returns the exit code."""
    poller = Poller(addresses, curve)
    try:
        if once:
            return _once(poller, interval)
        return _live(poller, interval)
    finally:
        poller.close()


def _live(poller: Poller, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    with (
        contextlib.suppress(KeyboardInterrupt),
        _sigterm_interrupts(),
        _keys() as stdin,
        Live(console=console, screen=True, auto_refresh=False, transient=True) as view,
    ):
        while True:
            tick = time.monotonic() + interval
            poller.request()
            # Draw as soon as the answers are in (or most of the tick has passed), then
            # wait out the tick for a key.
            quit_ = poller.collect(time.monotonic() + 0.9 * interval, stdin)
            now = time.monotonic()
            view.update(render(poller.rows, now, interval=interval, live=True), refresh=True)
            if quit_:
                return 0
            if stdin is None:
                time.sleep(max(0.0, tick - time.monotonic()))
            elif _wait_key(stdin, tick):
                return 0
    return 0  # Ctrl-C


def _wait_key(fd: int, until: float) -> bool:
    """Wait for a key until *until*; whether it was ``q``."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready and _quit_key(fd):
            return True


def main(
    addresses: Sequence[str],
    *,
    interval: float,
    once: bool,
    curve: Sequence[CurveKeys | None] | None = None,
) -> int:
    """Entry point for ``python -m enginecore top``: exit code 2 when an optional
    dependency is missing, or for the live view (no *once*) when stdout is not a
    terminal."""
    try:
        import rich  # noqa: F401
    except ImportError:
        print(
            "python -m enginecore top needs rich: pip install 'enginecore[top]'",
            file=sys.stderr,
        )
        return 2
    try:
        import enginecore.stage  # noqa: F401
    except ImportError as exc:
        print(f"python -m enginecore top: {exc}", file=sys.stderr)
        return 2
    if not once and not sys.stdout.isatty():
        # rich's Live draws nothing off a terminal: the view would run unseen until killed.
        print(
            "python -m enginecore top: the live view needs a terminal on stdout; "
            "use --once to print one table (for a pipe, a file or a script)",
            file=sys.stderr,
        )
        return 2
    return run(addresses, interval=interval, once=once, curve=curve)
