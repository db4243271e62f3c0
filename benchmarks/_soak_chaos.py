"""What the chaos soaks (``soak_pipeline``, ``soak_pool``) share: the report, the request
ids, one request's life and its checks, and the killer thread that SIGKILLs and freezes
stage processes. Counts only, never a time (docs/soak.md)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._cli import at_least, seconds, share

__all__ = [
    "KILL_SEEN_S",
    "LONGEST_FREEZE_S",
    "ChaosConfig",
    "Ids",
    "Life",
    "Load",
    "Report",
    "Rules",
    "chaos_threads",
    "draw",
    "drive_async",
    "drive_sync",
    "killer",
    "left_behind",
    "run_kind",
    "wave_async",
    "wave_sync",
]

LONGEST_FREEZE_S = 3.0
"""The longest SIGSTOP freeze of the :func:`killer` (the shortest: 0.1 s)."""

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
    presumed: int = 0  # requests that ended dead because the heartbeat presumed a stage dead
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

    def note_restarts(self, name: str, restarts: int) -> None:
        """How many times *name* (a pool's replica, a pipeline's stage) was restarted, all
        told: noted as a replica leaves the pool, and for the others after the chaos."""
        with self._lock:
            self.restarts[name] = restarts

    def count(self, counter: collections.Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    def render(
        self, title: str, waves: int = 16, interrupted: bool = False, chaos: bool = False
    ) -> tuple[str, bool]:
        """The report as text under *title*, and whether the soak passed (no problem, the
        last wave of *waves* requests complete and, with *chaos* (the killer ran), at least
        one kill or freeze: a run too short for one tested no recovery). *interrupted*: the
        soak was stopped (Ctrl-C, SIGTERM) before its end: what it counted so far, and the
        problems seen, without a verdict (and without the chaos's events: a long run has
        many)."""
        lines = [
            title,
            f"  ends: {dict(self.ends)}",
            f"  refused at add: {dict(self.refused)}",
            # restarts and the last wave are read after the chaos: not in an interrupted run
            f"  kills: {dict(self.kills)}"
            + ("" if interrupted else f"; restarts: {self.restarts}"),
            f"  freezes: {dict(self.freezes)}"
            + (f"; requests ended by a presumed death: {self.presumed}" if self.presumed else ""),
            *([f"  membership: {dict(self.membership)}"] if self.membership else []),
            *([] if interrupted else [f"  last wave: {self.last_wave}/{waves} complete"]),
        ]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        if interrupted:
            lines.append("  INTERRUPTED: the counts so far")
            return "\n".join(lines), False
        idle = chaos and not self.kills and not self.freezes
        if idle:
            lines.append(
                "  PROBLEM: the killer made no kill nor freeze: the run ended before the "
                "chaos began (give more --seconds), and tested no recovery"
            )
        ok = not self.problems and self.last_wave == waves and not idle
        if not ok:
            lines += [f"  chaos: {e}" for e in self.events]
        lines.append("  OK" if ok else "  FAILED")
        return "\n".join(lines), ok

    def finish(self, run: Callable[[], object], title: Callable[[], str], chaos: bool) -> int:
        """A soak's end, for its ``main``: call *run*, print this report under *title()*
        and return the exit code (0: it passed). Ctrl-C or SIGTERM (``run_main``) prints
        what was counted so far, then goes on as a :class:`KeyboardInterrupt`."""
        try:
            run()
        except KeyboardInterrupt:
            print(self.render(title(), interrupted=True)[0], flush=True)
            raise
        text, ok = self.render(title(), chaos=chaos)
        print(text)
        return 0 if ok else 1


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
        if how == "dead" and "presumed dead" in str(exc):
            with report._lock:
                report.presumed += 1
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
    freezes_kill: bool = False,
) -> None:
    """Until *until*: every 0.2 to 1.2 s, SIGKILL one of the processes *targets* lists (by
    key, ``name`` or ``name[r]``, and pid: those up now), or, *freeze_share* of the time,
    freeze it (SIGSTOP) for 0.1 to 3 s while the chaos goes on. Every frozen process is
    thawed (SIGCONT) before this returns. With *freezes_kill* (a freeze may outlast the
    heartbeat timeout: the client presumes the stage dead), a freeze counts as a kill for
    the requests near it (``report.last_kill``), and the first freeze lasts the longest
    (3 s), so that a soak with a short heartbeat timeout always takes that path once."""
    frozen: dict[int, float] = {}  # pid: when to thaw it
    longest_first = freezes_kill

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
                    hold = rng.uniform(0.1, LONGEST_FREEZE_S)
                    if longest_first:
                        hold, longest_first = LONGEST_FREEZE_S, False
                    frozen[pid] = time.monotonic() + hold
                    if freezes_kill:
                        report.last_kill = time.monotonic()
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


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children() -> set[int]:
    """This process's child processes (a zombie too: not reaped), but multiprocessing's
    resource tracker, which lives as long as the interpreter on purpose."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except (OSError, IndexError, ValueError):
            continue
        found.add(int(entry))
    return found


def left_behind(
    report: Report, within: float = 0.0, children_before: set[int] | None = None
) -> None:
    """After the shutdown: a process the soak saw that still exists (*within* seconds
    after, for processes that another process ends in its own time: Ray's actors) is a
    problem; and with *children_before* (this process's children before the soak), so is
    a child process started since and still there, one the soak never saw serving too (a
    restart or an added replica that the killer and the last phase missed)."""
    until = time.monotonic() + within

    def find() -> list[int]:
        seen = {p for p in report.pids if _exists(p)}
        if children_before is not None:
            seen |= _children() - children_before
        return sorted(seen)

    while (left := find()) and time.monotonic() < until:
        time.sleep(0.1)
    for pid in left:
        where = "" if pid in report.pids else " (a child the soak never saw serving)"
        report.problem(f"stage process {pid} is still there after the shutdown{where}")


@dataclass(frozen=True)
class Load:
    """The requests a soak sends until *end_at* (``time.monotonic()``): *concurrency* in
    flight, ids drawn from *ids*, *abort_share* of them aborted, each allowed *deadline*
    seconds from its add to its end; *seed* draws them."""

    end_at: float
    concurrency: int
    ids: int
    abort_share: float
    deadline: float
    seed: int


def drive_sync(
    target: Any,
    load: Load,
    report: Report,
    rules: Rules,
    dead: type[BaseException],
    where: Callable[[str], str],
) -> None:
    """Drive *target* (a ``Pipeline`` or ``StagePool``: ``add``, ``abort``, streams with
    ``get``) from ``load.concurrency`` threads until ``load.end_at``: each request is added,
    read to its end (aborted as :func:`draw` says) and checked (:class:`Life`). *dead*: the
    error of a request whose process was killed; *where*: what the target says of a request
    that hung."""
    from enginecore.stage import NoReplicaError

    rng = random.Random(load.seed)
    rng_lock = threading.Lock()
    ids = Ids(load.ids, rng)

    def one(life: Life) -> None:
        rid = life.rid
        try:
            stream = target.add(rid, life.n)
        except (NoReplicaError, ValueError) as exc:
            life.refused(exc)
            time.sleep(0.01)  # nothing to route to now: no busy loop
            return
        deadline = time.monotonic() + load.deadline
        if life.abort_after == 0:
            target.abort([rid])
        try:
            while True:
                try:
                    payload = stream.get(timeout=max(0.0, deadline - time.monotonic()))
                except StopIteration:
                    break
                life.got.append(payload)
                if len(life.got) == life.abort_after:
                    target.abort([rid])
        except dead as exc:
            life.end("dead", exc)
        except TimeoutError:
            life.end("hung", where=where(rid))
        except Exception as exc:
            life.end("error", exc)
        else:
            life.end("aborted" if stream.aborted else "finished")

    stop = threading.Event()  # Ctrl-C: each thread ends its request, then stops

    def worker() -> None:
        while not stop.is_set() and time.monotonic() < load.end_at:
            rid = ids.take()
            if rid is None:
                time.sleep(0.01)
                continue
            with rng_lock:
                n, abort_after = draw(rng, load.abort_share)
            try:
                one(Life(rid, n, abort_after, report, rules))
            except Exception as exc:
                report.problem(f"{rid}: {type(exc).__name__}: {exc}")
            finally:
                ids.give(rid)

    workers = [threading.Thread(target=worker) for _ in range(load.concurrency)]
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    except BaseException:  # KeyboardInterrupt: stop now, not at load.end_at
        stop.set()
        for t in workers:
            if t.ident is not None:
                t.join(load.deadline)
        raise


async def drive_async(
    target: Any,
    load: Load,
    report: Report,
    rules: Rules,
    dead: type[BaseException],
    where: Callable[[str], str],
) -> None:
    """:func:`drive_sync` for an ``AsyncPipeline`` or ``AsyncStagePool``: one task per
    request, ``load.concurrency`` at once."""
    from enginecore.stage import NoReplicaError

    rng = random.Random(load.seed)
    ids = Ids(load.ids, rng)
    sem = asyncio.Semaphore(load.concurrency)
    tasks: set[asyncio.Task[None]] = set()

    def _settled(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            # one() handles every Exception; what ends it otherwise (a KeyboardInterrupt
            # raised in it) has left the event loop already, to the soak's way out: taken
            # here, it is not logged again as "Task exception was never retrieved" after
            # the soak's last line.
            task.exception()

    async def one(life: Life) -> None:
        rid = life.rid
        try:
            try:
                stream = await target.add(rid, life.n)
            except (NoReplicaError, ValueError) as exc:
                life.refused(exc)
                await asyncio.sleep(0.01)  # nothing to route to now: no busy loop
                return
            deadline = time.monotonic() + load.deadline
            if life.abort_after == 0:
                await target.abort([rid])
            try:
                while True:
                    try:
                        payload = await stream.get(timeout=max(0.0, deadline - time.monotonic()))
                    except StopAsyncIteration:
                        break
                    life.got.append(payload)
                    if len(life.got) == life.abort_after:
                        await target.abort([rid])
            except dead as exc:
                life.end("dead", exc)
            except TimeoutError:
                life.end("hung", where=where(rid))
            except Exception as exc:
                life.end("error", exc)
            else:
                life.end("aborted" if stream.aborted else "finished")
        except Exception as exc:
            report.problem(f"{rid}: {type(exc).__name__}: {exc}")
        finally:
            ids.give(rid)
            sem.release()

    try:
        while time.monotonic() < load.end_at:
            await sem.acquire()
            rid = ids.take()
            if rid is None:
                sem.release()
                await asyncio.sleep(0.01)
                continue
            task = asyncio.create_task(one(Life(rid, *draw(rng, load.abort_share), report, rules)))
            tasks.add(task)
            task.add_done_callback(_settled)
        if tasks:
            await asyncio.wait(tasks)
    except asyncio.CancelledError:  # Ctrl-C or SIGTERM: the requests in flight end uncounted
        left = list(tasks)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        raise


def wave_sync(target: Any, n: int, timeout: float) -> list[list[Any] | Exception]:
    """The last wave: *n* requests of 5 outputs through *target*, each one's outputs or
    its error (the add's error alone, if an add fails)."""
    try:
        streams = [target.add(f"last{i}", 5) for i in range(n)]
    except Exception as exc:
        return [exc]
    out: list[list[Any] | Exception] = []
    for stream in streams:
        try:
            out.append(stream.collect(timeout=timeout))
        except Exception as exc:
            out.append(exc)
    return out


async def wave_async(target: Any, n: int, timeout: float) -> list[list[Any] | Exception]:
    """:func:`wave_sync` for an asyncio target."""
    try:
        streams = [await target.add(f"last{i}", 5) for i in range(n)]
    except Exception as exc:
        return [exc]
    return list(
        await asyncio.gather(*(s.collect(timeout=timeout) for s in streams), return_exceptions=True)
    )


def chaos_threads(
    stop: threading.Event,
    report: Report,
    until: float,
    seed: int,
    targets: Callable[[], list[tuple[str, int]]],
    freeze_share: float,
    kills: bool = True,
    freezes_kill: bool = False,
) -> list[threading.Thread]:
    """The :func:`killer`'s thread (none without *kills*), not started."""
    if not kills:
        return []
    return [
        threading.Thread(
            target=killer,
            args=(random.Random(seed + 1), until, stop, report),
            kwargs={
                "targets": targets,
                "freeze_share": freeze_share,
                "freezes_kill": freezes_kill,
            },
            daemon=True,
        )
    ]


@dataclass
class ChaosConfig:
    """What both soaks take: how long (*seconds*, the chaos stopping *quiet* seconds before
    the end), the requests (:class:`Load`'s), which client (*kind*: ``"sync"`` or
    ``"async"``) and the share of the killer's picks that freeze instead of kill."""

    seconds: float = 60.0
    seed: int = 1
    concurrency: int = 32
    ids: int = 48
    abort_share: float = 0.2
    deadline: float = 30.0
    quiet: float = 5.0
    kind: str = "async"
    freeze_share: float = 0.0

    def load(self) -> Load:
        """The requests, from now for :attr:`seconds`."""
        return Load(
            end_at=time.monotonic() + self.seconds,
            concurrency=self.concurrency,
            ids=self.ids,
            abort_share=self.abort_share,
            deadline=self.deadline,
            seed=self.seed,
        )

    @staticmethod
    def arguments(parser: argparse.ArgumentParser) -> None:
        """Add the command-line options of these settings to *parser*."""
        c = ChaosConfig
        parser.add_argument(
            "--seconds",
            type=seconds,
            default=c.seconds,
            help=f"how long the load runs (default {c.seconds:g}); the chaos stops "
            f"{c.quiet:g} s (at most half the run) before the end, then a last wave of "
            "requests must complete",
        )
        parser.add_argument(
            "--seed", type=int, default=c.seed, help=f"seeds every draw (default {c.seed})"
        )
        parser.add_argument(
            "--concurrency",
            type=at_least(1),
            default=c.concurrency,
            help=f"requests in flight (default {c.concurrency})",
        )
        parser.add_argument(
            "--ids",
            type=at_least(1),
            default=c.ids,
            help=f"request ids drawn from this many (default {c.ids}), so that an id is reused "
            "soon after it ends",
        )
        parser.add_argument(
            "--deadline",
            type=seconds,
            default=c.deadline,
            help=f"seconds a request may take from its add to its end (default {c.deadline:g})",
        )
        parser.add_argument(
            "--kind",
            choices=("sync", "async"),
            default=c.kind,
            help="the blocking client, driven from threads, or the asyncio one, from tasks "
            f"(default {c.kind})",
        )
        parser.add_argument(
            "--freeze-share",
            type=share,
            default=c.freeze_share,
            help="the share (0 to 1) of the killer's picks that freeze (SIGSTOP for "
            f"0.1 to {LONGEST_FREEZE_S:g} s) instead of SIGKILL (default {c.freeze_share:g})",
        )

    @staticmethod
    def settings(args: argparse.Namespace) -> dict[str, Any]:
        """The settings :meth:`arguments` parsed, as keyword arguments."""
        return {
            "seconds": args.seconds,
            "seed": args.seed,
            "concurrency": args.concurrency,
            "ids": args.ids,
            "deadline": args.deadline,
            "kind": args.kind,
            "freeze_share": args.freeze_share,
            "quiet": min(ChaosConfig.quiet, args.seconds / 2),
        }


async def _stopped_by_signals(soak: Coroutine[Any, Any, None]) -> None:
    """Await *soak* (an async soak's body) in the main task, which SIGINT and SIGTERM
    cancel; once it has cleaned up (its ``finally``: the pipeline's or pool's shutdown),
    the signal goes on to the handler it had before (``run_main``'s), as a
    :class:`KeyboardInterrupt`.

    Not a handler that raises where it lands: the event loop's thread is mostly in another
    task or a callback (a request's task, the pipeline's readers, a restart), and a
    :class:`KeyboardInterrupt` raised there left the loop from there, so that ``asyncio.run``
    cancelled every task at once, the pipeline's own among them (a restart mid-way), while
    the soak's ``finally`` awaited its shutdown; a task left pending by that teardown
    printed "Task was destroyed but it is pending!" at exit, after the soak's last line.
    A second signal before the cleanup ends is raised at once, as before."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    caught: list[int] = []
    previous: dict[int, Any] = {}

    def pass_on(signum: int, frame: Any) -> None:
        old = previous[signum]
        if callable(old):
            old(signum, frame)  # run_main's: a KeyboardInterrupt
        raise KeyboardInterrupt

    def on_signal(signum: int, frame: Any) -> None:
        if caught:  # a second one: the cleanup hangs, or the user is in a hurry
            pass_on(signum, frame)
        caught.append(signum)
        loop.call_soon_threadsafe(main.cancel)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) not in (signal.SIG_IGN, None):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        await soak
    except asyncio.CancelledError:
        if not caught:
            raise
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
    if caught:
        pass_on(caught[0], None)


def run_kind(
    kind: str,
    sync: Callable[[Report], None],
    asynchronous: Callable[[Report], Coroutine[Any, Any, None]],
    gone_within: float = 0.0,
    report: Report | None = None,
    children: bool = True,
) -> Report:
    """Run a soak in the form *kind* names, then look for processes left behind (allowed
    *gone_within* seconds to go, :func:`left_behind`). Its findings go into *report* (a new
    one by default), which the caller can render if the soak is interrupted. With
    *children*, a child process of this one started during the soak and still there after
    it is a problem too (whether the soak saw its pid or not)."""
    report = Report() if report is None else report
    before = _children() if children else None
    if kind == "async":
        asyncio.run(_stopped_by_signals(asynchronous(report)))
    elif kind == "sync":
        sync(report)
    else:
        raise ValueError(f"kind must be 'sync' or 'async', got {kind!r}")
    left_behind(report, gone_within, before)
    return report
