"""Phase 1 of the stage soak: many adds, a share of them invalid in every way, against one
``python -m enginecore serve --keep-requests-on-detach`` stage. See ``soak_stage.py``.

Two peers talk to the stage at once:

- **main**, a :class:`~enginecore.stage.StageClient` attached with ``connect()`` and the
  ordered event stream on: it sends the valid requests, the data the engine rejects and the
  poisoned requests (``add_many(..., streams=False)``) and reads **every** event of the
  stage, in the stage's order, whoever caused it (the stage has one output socket and one
  attached client: events about the other peer's messages come here too).
- **intruder**, a raw ``DEALER`` that never says ``hello``. The protocol takes messages
  other than ``hello`` from any peer (``wire.md`` section 3, no authentication), so it is a
  second client on the input side: it sends the malformed frames, some valid adds, and the
  duplicates of main's live ids; its invalid ``hello`` s are answered on its own socket.

Duplicate ids across two clients are made in the two ways a stage can see them:

- **concurrently**: an *anchor* request (``["hold"]``: one output, then live and silent until
  aborted) is added by one peer; once its output has arrived (so it is live in the stage),
  the other peer adds the same id. Each such add must get exactly one ``error`` ("live in
  the stage"), the engine must never see it, and the anchor must go on (its ``aborted``
  comes when main aborts it, after its duplicates' errors). Since two peers' messages are
  not ordered, a duplicate is only sent once the anchor is known to be live, and the anchor
  is only aborted once every duplicate's error has arrived.
- **across sessions**: a serve stage has one client at a time, so main ends its session
  (``close()``, a ``bye``) leaving two anchors live (``--keep-requests-on-detach``), and a
  new main attaches and adds the same ids. This happens ``handovers`` times; each time every
  other request of the session has ended before the ``bye``, so nothing is lost to the
  session change (the stage drops what was queued for the previous client, by design).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec
import zmq

from enginecore.stage import (
    Aborted,
    EngineDeadError,
    ErrorReport,
    Fatal,
    Outputs,
    ProtocolError,
    Shutdown,
    StageClient,
    UtilityResult,
)

from . import _soak_frames as frames
from ._soak_engine import POISONS
from ._soak_report import PhaseReport, Stall, handle_samples, rss_samples

__all__ = ["FuzzConfig", "run_fuzz"]

FACTORY: Final = "benchmarks._soak_engine:soak_engine"
ROOT: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL_S: Final = 30.0
"""A phase that waits this long for an expected event without any arriving fails."""

# Request kinds.
VALID, REJECTED, POISONED, MALFORMED, ANCHOR = (
    "valid",
    "rejected",
    "poisoned",
    "malformed",
    "anchor",
)

# Data the engine refuses (RequestRejected): wire-valid, so the client sends it.
BAD_DATA: Final[list[Any]] = [
    0,
    -5,
    "3",
    None,
    2.5,
    True,
    b"\x03",
    [],
    [3],
    {"steps": 3},
    ["hold", 1],
    ["poison", 3, 3, "set"],  # the poisoned output would be past the last one
    ["poison", 3, 0, "no such kind"],
]

# Data the client refuses before sending: it cannot be encoded.
UNSENDABLE: Final[list[Callable[[], Any]]] = [
    lambda: {1, 2},
    object,
    lambda: 2**64,
    lambda: [1, {"k": frozenset()}],
    lambda: {1.5: 2},
    lambda: "bad \ud800 text",
]

# Shares of the adds, by category; the invalid ones add up to 30 %.
SHARES: Final[dict[str, float]] = {
    "valid": 0.665,
    "valid_raw": 0.035,  # by the intruder, with a trailing element (receivers ignore it)
    "rejected": 0.06,
    "rejected_raw_array": 0.01,  # an int64 array, in and out of band: the engine refuses it
    "poisoned": 0.07,
    "unsendable": 0.01,
    "malformed_add": 0.05,
    "malformed_adds": 0.01,
    "malformed_unscoped": 0.03,
    "malformed_call": 0.005,
    "malformed_hello": 0.005,
    "duplicate": 0.05,
}

ANCHORS_MAX: Final = 4  # anchors live at once
DUPS_PER_ANCHOR: Final = 16  # duplicates sent for one anchor before it is retired


class FuzzConfig:
    def __init__(
        self,
        adds: int = 100_000,
        seed: int = 1,
        window: int = 2000,
        handovers: int = 10,
        poisons: Sequence[str] = tuple(POISONS),
    ) -> None:
        self.adds = adds
        self.seed = seed
        self.window = window
        self.handovers = handovers
        self.poisons = list(poisons)  # the kinds of unencodable outputs made


class _Req:
    __slots__ = (
        "abort_sent",
        "dup_errors",
        "dups_sent",
        "held",
        "j",
        "kind",
        "label",
        "next",
        "outputs",
        "owner",
    )

    def __init__(self, kind: str, label: str, k: int = 0, j: int = -1) -> None:
        self.kind = kind
        self.label = label  # the category, for the report
        self.next = k - 1  # the next countdown payload expected
        self.j = j  # the index of the poisoned output
        self.outputs = 0
        self.owner = ""  # anchors: "main" or "intruder"; poisoned: the kind of poison
        self.held = False  # anchors: its one output arrived (it is live)
        self.dups_sent = 0
        self.dup_errors = 0
        self.abort_sent = False


class _Server:
    """``python -m enginecore serve`` on ipc sockets in a private directory; its log in a
    file there, shown on failure."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ecsoak")
        self.log_path = os.path.join(self.dir, "serve.log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        try:
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "enginecore",
                        "serve",
                        "--engine",
                        FACTORY,
                        "--bind",
                        f"ipc://{self.dir}/in",
                        "--keep-requests-on-detach",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                )
        except BaseException:
            self.remove()
            raise
        try:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            match = re.search(r"listening on (\S+)", line)
            if match is None:
                raise RuntimeError(f"serve did not start: {line!r}\n{self.log_tail()}")
            self.address = match.group(1)
        except BaseException:  # Ctrl-C too: no serve process or socket folder left
            self.stop()
            self.remove()
            raise

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return code

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _connect(address: str) -> StageClient:
    """Attach, retrying while the previous session is still winding down (its ``bye`` and
    this ``hello`` travel on different connections, so ``hello`` may come first)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return StageClient.connect(address, ordered_events=True)
        except ProtocolError as exc:
            if time.monotonic() > deadline or "attached" not in str(exc):
                raise
            time.sleep(0.01)


class _Fuzz:
    def __init__(self, cfg: FuzzConfig, server: _Server, report: PhaseReport) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.server = server
        self.r = report
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.intruder = self.ctx.socket(zmq.DEALER)
        self.intruder.setsockopt(zmq.LINGER, 0)
        self.intruder.connect(server.address)
        self.main = _connect(server.address)
        self.pid = self.main.pid
        self.live: dict[str, _Req] = {}
        self.ended: dict[str, str] = {}  # rid -> its label
        self.ids = itertools.count()
        self.call_ids = itertools.count(-(2**40), -1)  # below the client's own (positive)
        self.calls: dict[int, str] = {}  # call id -> "malformed" | "barrier"
        self.barrier_answers: dict[int, Any] = {}
        self.anchors: list[str] = []  # live anchors, oldest first
        self.deferred_dups = 0
        self.expect = {"unscoped": 0, "rejects": 0}
        self.got = {"unscoped": 0, "rejects": 0}
        self.draining = False
        self.last_event = time.monotonic()
        self.categories = list(SHARES)
        self.weights = list(SHARES.values())
        self.ops: collections.Counter[str] = collections.Counter()
        self.engine_live: Any = None
        self.stage_live: int | None = None  # the stage's own live requests, at the end

    # -- sending ---------------------------------------------------------------------------------

    def rid(self, prefix: str) -> str:
        return f"{prefix}{next(self.ids)}"

    def track(self, rid: str, req: _Req) -> None:
        self.live[rid] = req
        self.r.counts[f"sent {req.label}"] += 1

    def send_raw(self, parts: list[bytes]) -> None:
        self.intruder.send_multipart(parts)

    def send_ops(self, n: int) -> int:
        """Send *n* adds (frames) of random categories; return how many were sent."""
        rng = self.rng
        items: list[tuple[str, Any]] = []
        for cat in rng.choices(self.categories, self.weights, k=n):
            self.ops[cat] += 1
            if cat == "valid":
                rid, k = self.rid("v"), rng.randint(1, 6)
                self.track(rid, _Req(VALID, "valid", k))
                items.append((rid, k))
            elif cat == "valid_raw":
                rid, k = self.rid("w"), rng.randint(1, 6)
                self.track(rid, _Req(VALID, "valid (raw peer)", k))
                self.send_raw([msgspec.msgpack.encode(["add", rid, k, "trailing"])])
            elif cat == "rejected":
                rid = self.rid("x")
                self.track(rid, _Req(REJECTED, "rejected by the engine"))
                items.append((rid, rng.choice(BAD_DATA)))
            elif cat == "rejected_raw_array":
                rid = self.rid("y")
                self.track(rid, _Req(REJECTED, "rejected by the engine (raw array)"))
                n_items = rng.choice([1, 1024])  # 8 B inline, 8 KiB out of band
                arr = frames._X(1, msgspec.msgpack.encode(["<i8", [n_items], 0]))
                self.send_raw([msgspec.msgpack.encode(["add", rid, arr]), b"\1" * 8 * n_items])
            elif cat == "poisoned":
                rid, k = self.rid("p"), rng.randint(1, 6)
                j = rng.randrange(k)
                kind = rng.choice(self.cfg.poisons)
                req = _Req(POISONED, "unencodable output", k, j)
                req.owner = kind
                self.track(rid, req)
                items.append((rid, ["poison", k, j, kind]))
            elif cat == "unsendable":
                self.r.counts["sent unsendable data (client refuses)"] += 1
                try:
                    self.main.add(self.rid("u"), rng.choice(UNSENDABLE)(), stream=False)
                except TypeError:
                    self.r.counts["client refused unsendable data (TypeError)"] += 1
                except Exception as exc:
                    self.r.violation(
                        "client.add of unsendable data raised something else than TypeError",
                        repr(exc),
                    )
                else:
                    self.r.violation("client.add sent unsendable data", "no exception")
            elif cat == "malformed_add":
                name = rng.choice(list(frames.SCOPED_ADD))
                rid = self.rid("m")
                self.track(rid, _Req(MALFORMED, "malformed add (id readable)"))
                self.r.counts[f"malformed add {name}"] += 1
                self.send_raw(frames.SCOPED_ADD[name](rid))
            elif cat == "malformed_adds":
                name = rng.choice(list(frames.SCOPED_ADDS))
                parts, bad, good = frames.SCOPED_ADDS[name]([self.rid("n") for _ in range(3)])
                for rid in bad:
                    self.track(rid, _Req(MALFORMED, "malformed adds item (ids readable)"))
                for rid, k in good:
                    self.track(rid, _Req(VALID, "valid (adds beside a bad item)", k))
                self.r.counts[f"malformed adds {name}"] += 1
                self.send_raw(parts)
            elif cat == "malformed_unscoped":
                name = rng.choice(list(frames.UNSCOPED))
                self.expect["unscoped"] += 1
                self.r.counts[f"unscoped {name}"] += 1
                self.send_raw(frames.UNSCOPED[name](rng))
            elif cat == "malformed_call":
                name = rng.choice(list(frames.SCOPED_CALL))
                cid = next(self.call_ids)
                self.calls[cid] = "malformed"
                self.r.counts[f"malformed utility {name}"] += 1
                self.send_raw(frames.SCOPED_CALL[name](cid))
            elif cat == "malformed_hello":
                name = rng.choice(list(frames.BAD_HELLO))
                self.expect["rejects"] += 1
                self.r.counts[f"bad hello {name}"] += 1
                self.send_raw(frames.BAD_HELLO[name]())
            else:
                assert cat == "duplicate"
                self.deferred_dups += 1
        if items:
            self.main.add_many(items, streams=False)
        self.send_dups()
        return n

    def new_anchor(self) -> None:
        owner = self.rng.choice(["main", "intruder"])
        rid = self.rid("A")
        req = _Req(ANCHOR, "anchor (held until aborted)")
        req.owner = owner
        self.track(rid, req)
        self.anchors.append(rid)
        if owner == "main":
            self.main.add_many([(rid, ["hold"])], streams=False)
        else:
            self.send_raw([msgspec.msgpack.encode(["add", rid, ["hold"]])])

    def send_dups(self) -> None:
        """Send the deferred duplicates to live anchors (from the peer that did not add
        them); start anchors while more are needed; retire those that are done."""
        for rid in list(self.anchors):
            req = self.live[rid]
            if not req.held or req.abort_sent:
                continue
            while self.deferred_dups and req.dups_sent < DUPS_PER_ANCHOR:
                self.deferred_dups -= 1
                req.dups_sent += 1
                self.r.counts["sent duplicate id (other peer, concurrently)"] += 1
                if req.owner == "main":
                    self.send_raw([msgspec.msgpack.encode(["add", rid, 3])])
                else:
                    self.main.add_many([(rid, 3)], streams=False)
            done = req.dups_sent >= DUPS_PER_ANCHOR or (self.draining and not self.deferred_dups)
            if done and req.dup_errors == req.dups_sent:
                req.abort_sent = True
                self.main.abort([rid])
                self.anchors.remove(rid)
        starting = sum(not self.live[a].held for a in self.anchors)
        while self.deferred_dups > starting * DUPS_PER_ANCHOR and len(self.anchors) < ANCHORS_MAX:
            self.new_anchor()
            starting += 1

    # -- receiving -------------------------------------------------------------------------------

    def pump(self, timeout: float) -> bool:
        """Handle the events that arrived (waiting up to *timeout* for the first)."""
        try:
            events = self.main.get_events(timeout)
        except TimeoutError:
            events = []
        while self.intruder.poll(0):
            reply = msgspec.msgpack.decode(self.intruder.recv())
            if reply[0] == "reject":
                self.got["rejects"] += 1
            else:
                self.r.violation("the intruder got something else than a reject", repr(reply))
        if not events:
            if time.monotonic() - self.last_event > STALL_S:
                raise Stall(f"no event for {STALL_S:.0f} s")
            return False
        self.last_event = time.monotonic()
        for ev in events:
            self.handle(ev)
        self.send_dups()
        return True

    def end(self, rid: str) -> None:
        req = self.live.pop(rid)
        self.ended[rid] = f"{req.label}: {req.owner}" if req.kind is POISONED else req.label
        self.r.counts[f"ended as expected: {req.label}"] += 1

    def not_live(self, rid: str, what: str) -> None:
        label = self.ended.get(rid)
        if label is not None:
            self.r.violation(f"{what} for a request that had ended ({label})", rid)
        else:
            self.r.violation(f"{what} for an id never added", rid)

    def handle(self, ev: Any) -> None:
        cls = ev.__class__
        if cls is Outputs:
            live = self.live
            for rid, fin, payload in zip(ev.req_ids, ev.finished, ev.payloads, strict=True):
                req = live.get(rid) if rid is not None else None
                if req is None:
                    self.not_live(rid, "an output")
                    continue
                kind = req.kind
                if kind is VALID or kind is POISONED:
                    if type(payload) is not int or payload != req.next:
                        self.r.violation(
                            "wrong payload", f"{rid}: {payload!r}, expected {req.next}"
                        )
                    if fin != (payload == 0):
                        self.r.violation("wrong finished flag", f"{rid}: {payload!r} {fin}")
                    req.next -= 1
                    req.outputs += 1
                    if fin:
                        if kind is POISONED:
                            self.r.violation("a poisoned request finished normally", rid)
                        self.end(rid)
                elif kind is ANCHOR:
                    if payload != "held" or req.held or fin:
                        self.r.violation("wrong anchor output", f"{rid}: {payload!r} {fin}")
                    req.held = True
                else:
                    self.r.violation(f"an output of a request that was {kind}", rid)
        elif cls is ErrorReport:
            self.on_error(ev.req_id, ev.message)
        elif cls is Aborted:
            for rid in ev.req_ids:
                req = self.live.get(rid)
                if req is None or req.kind is not ANCHOR or not req.abort_sent:
                    self.r.violation("an unexpected aborted event", rid)
                    continue
                self.end(rid)
        elif cls is UtilityResult:
            what = self.calls.pop(ev.call_id, None)
            if what == "malformed":
                if ev.error is not None and ev.error.startswith("ProtocolError("):
                    self.r.counts["failed utility answer (malformed call)"] += 1
                else:
                    self.r.violation("a malformed call was answered", repr(ev))
            elif what == "barrier":
                self.barrier_answers[ev.call_id] = ev
            # else: an answer to main's own call_utility (its future has it)
        elif cls is Fatal:
            self.r.violation("the stage reported a fatal error", ev.message)
        elif cls is Shutdown:
            self.r.violation("the stage shut down unasked", "shutdown event")

    def on_error(self, rid: str | None, message: str) -> None:
        if rid is None:
            self.got["unscoped"] += 1
            if not message.startswith("invalid message"):
                self.r.violation("an unscoped error that is not about a frame", message)
            return
        req = self.live.get(rid)
        if req is None:
            self.not_live(rid, "an error")
            return
        kind = req.kind
        if kind is REJECTED:
            if not message.startswith(("need an int", "bad poison request")):
                self.r.violation("a rejection with another message", f"{rid}: {message}")
            self.end(rid)
        elif kind is MALFORMED:
            if not message.startswith("invalid message"):
                self.r.violation("a malformed add's error with another message", message)
            self.end(rid)
        elif kind is POISONED:
            if "cannot be encoded" not in message:
                self.r.violation("a poisoned request's error with another message", message)
            if req.outputs != req.j:
                self.r.violation(
                    "a poisoned request's outputs before its error",
                    f"{rid}: {req.outputs} outputs, expected {req.j}",
                )
            self.end(rid)
        elif kind is ANCHOR:
            req.dup_errors += 1
            if "live in the stage" not in message:
                # The engine saw it (its own "already live" rejection): not the stage's
                # refusal, so not counted as one.
                self.r.violation("a duplicate id refused by another check", f"{rid}: {message}")
            else:
                self.r.counts["duplicate refused (live in the stage)"] += 1
            if req.dup_errors > req.dups_sent:
                self.r.violation("more errors than duplicates for an anchor", rid)
        else:
            self.r.violation("an error for a valid request", f"{rid}: {message}")

    # -- phases ----------------------------------------------------------------------------------

    def wait(self, done: Callable[[], bool], what: str) -> None:
        self.last_event = time.monotonic()
        while not done():
            try:
                self.pump(1.0)
            except Stall as exc:
                raise Stall(f"{exc} while waiting for {what}") from None

    def barrier(self) -> None:
        """Once it returns, every event caused by what was sent before has arrived: a valid
        call from the intruder is answered after the loop applied the intruder's messages;
        a malformed one after the input thread's errors for its earlier frames; main's own
        call after main's messages."""
        valid, malformed = next(self.call_ids), next(self.call_ids)
        self.calls[valid] = self.calls[malformed] = "barrier"
        self.send_raw([msgspec.msgpack.encode(["utility", valid, "live", []])])
        self.send_raw(frames.SCOPED_CALL["utility_bad_args"](malformed))
        future = self.main.call_utility_future("live")
        self.wait(
            lambda: future.done() and {valid, malformed} <= self.barrier_answers.keys(),
            "the barrier calls",
        )
        self.engine_live = future.result()

    def drain(self) -> None:
        self.draining = True
        self.send_dups()
        self.wait(lambda: not self.live and not self.deferred_dups, "every request to end")
        self.barrier()
        self.draining = False

    def handover(self) -> None:
        """End main's session with two anchors live; a new main adds their ids."""
        held = [self.rid("H") for _ in range(2)]
        for rid in held:
            req = _Req(ANCHOR, "anchor across sessions")
            req.owner = "previous session"
            self.track(rid, req)
        self.main.add_many([(rid, ["hold"]) for rid in held], streams=False)
        self.draining = True
        self.send_dups()
        self.wait(
            lambda: all(self.live[h].held for h in held) and self.live.keys() == set(held),
            "every request but two anchors to end",
        )
        self.barrier()
        self.draining = False
        self.main.close()
        self.main = _connect(self.server.address)
        if self.main.pid != self.pid:
            self.r.violation("a new stage process after a handover", str(self.main.pid))
        self.r.counts["session handovers"] += 1
        self.main.add_many([(rid, 3) for rid in held], streams=False)
        for rid in held:
            self.live[rid].dups_sent = 1
            self.r.counts["sent duplicate id (next session)"] += 1
        self.wait(lambda: all(self.live[h].dup_errors for h in held), "the duplicates' errors")
        for rid in held:
            self.live[rid].abort_sent = True
        self.main.abort(held)
        self.wait(lambda: not (self.live.keys() & set(held)), "the anchors' aborted event")

    def run(self) -> None:
        cfg = self.cfg
        sent = 0

        # Handover i (1-based) comes once i * adds / (handovers + 1) adds are sent: a batch
        # never runs past the next one, and any left (more handovers than adds) come at the
        # end, so that the run makes exactly cfg.handovers of them.
        def done() -> int:
            return self.r.counts["session handovers"]

        def due() -> int:  # adds sent before the next handover
            return (done() + 1) * cfg.adds // (cfg.handovers + 1)

        next_rss = 0
        while sent < cfg.adds:
            while done() < cfg.handovers and sent >= due():
                self.handover()
            if sent >= next_rss:
                self.r.sample(sent, self.pid)
                next_rss += max(1, cfg.adds // 20)
            if len(self.live) < cfg.window:
                batch = min(256, cfg.adds - sent)
                if done() < cfg.handovers:
                    batch = min(batch, due() - sent)
                sent += self.send_ops(batch)
                self.pump(0)
            else:
                self.pump(1.0)
        while done() < cfg.handovers:
            self.handover()
        self.drain()
        self.r.sample(sent, self.pid)
        # The intruder's hello rejects travel on its own socket: wait for them too.
        self.wait(lambda: self.got["rejects"] >= self.expect["rejects"], "the hello rejects")
        self.stage_live = self.main.stats(timeout=30).live

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.main.close()
        self.intruder.close(linger=0)
        self.ctx.term()


def run_fuzz(cfg: FuzzConfig) -> PhaseReport:
    """Run the phase; its report (``report.ok``)."""
    r = PhaseReport(f"fuzz: {cfg.adds:,} adds, 30 % invalid")
    logging.getLogger("enginecore.stage").setLevel(logging.ERROR)  # one warning per bad frame
    server = _Server()
    fuzz: _Fuzz | None = None
    died = ""
    code: int | None = None
    try:
        fuzz = _Fuzz(cfg, server, r)
        try:
            fuzz.run()
        except Stall as exc:
            r.violation("stalled", str(exc))
            fuzz.engine_live = None  # a handover's barrier read it, not the end's
        except EngineDeadError as exc:
            died = str(exc)
            fuzz.engine_live = None
        if server.proc.poll() is not None:
            died = died or f"exit code {server.proc.returncode}"
        if not died:
            fuzz.main.shutdown()
            code = server.proc.wait(15)
    finally:
        if fuzz is not None:
            fuzz.close()
        stop_code = server.stop()
        code = stop_code if code is None else code
        tail = server.log_tail()
        server.remove()
    _checks(r, fuzz, died, code, tail)
    return r


def _checks(r: PhaseReport, fuzz: _Fuzz | None, died: str, code: int | None, tail: str) -> None:
    r.check(
        "0 stage deaths (alive to the end; exit code 0 after shutdown)",
        died or f"exit code {code}",
        not died and code == 0,
    )
    if fuzz is None:
        r.finish()
        return
    c = r.counts
    for label in sorted({k[len("sent ") :] for k in c if k.startswith("sent ")}):
        if label.startswith(("duplicate", "unsendable")):
            continue
        sent, ended = c[f"sent {label}"], c[f"ended as expected: {label}"]
        if label.startswith("valid"):
            what = "completed, every output in order"
        elif label.startswith("anchor"):
            what = "aborted once its duplicates were refused"
        else:
            what = "got exactly 1 error and no output"
        r.check(f"every {label} request {what}", f"{ended:,} / {sent:,}", ended == sent)
    dups = c["sent duplicate id (other peer, concurrently)"] + c["sent duplicate id (next session)"]
    refused = c["duplicate refused (live in the stage)"]
    r.check(
        "every duplicate id got exactly 1 error (live in the stage), its request went on",
        f"{refused:,} / {dups:,}",
        refused == dups,
    )
    unsendable = c["sent unsendable data (client refuses)"]
    typeerrors = c["client refused unsendable data (TypeError)"]
    r.check(
        "every unsendable data refused by the client (TypeError), nothing sent",
        f"{typeerrors:,} / {unsendable:,}",
        typeerrors == unsendable,
    )
    calls = sum(v for k, v in c.items() if k.startswith("malformed utility "))
    failed = c["failed utility answer (malformed call)"]
    r.check(
        "every malformed call (id readable) got exactly 1 failed answer",
        f"{failed:,} / {calls:,}",
        failed == calls,
    )
    got, expect = fuzz.got, fuzz.expect
    r.check(
        "every frame with no readable id got exactly 1 unscoped error",
        f"{got['unscoped']:,} / {expect['unscoped']:,}",
        got["unscoped"] == expect["unscoped"],
    )
    r.check(
        "every invalid hello got exactly 1 reject",
        f"{got['rejects']:,} / {expect['rejects']:,}",
        got["rejects"] == expect["rejects"],
    )
    after = sum(v for k, v in r.violations.items() if k.startswith("an output for a request"))
    r.check(
        "0 outputs after a request's error (or after its aborted event)", f"{after:,}", after == 0
    )
    live = fuzz.engine_live
    not_asked = "not asked: the phase ended early"
    r.check(
        "the engine holds nothing at the end ([countdowns, held, poisoned])",
        not_asked if live is None else repr(live),
        live == [0, 0, 0],
    )
    r.check(
        "the stage holds nothing at the end (its live requests)",
        not_asked if fuzz.stage_live is None else f"{fuzz.stage_live:,}",
        fuzz.stage_live == 0,
    )
    ops = fuzz.ops
    total = sum(ops.values())
    invalid = total - ops["valid"] - ops["valid_raw"]
    r.notes.append(
        f"adds drawn: {total:,}, invalid {invalid:,} ({invalid / max(total, 1):.1%}): "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(ops.items()))
    )
    r.notes.append(
        f"plus {c['sent anchor (held until aborted)'] + c['sent anchor across sessions']:,} "
        "anchor adds and the duplicates across sessions"
    )
    if r.rss_kib:
        r.notes.append(rss_samples(r.rss_kib, "adds sent") + " (reported, not gated)")
    if r.handles:
        r.notes.append(handle_samples(r.handles, "adds sent"))
    if not r.ok and tail:
        r.notes.append("stage log (tail):\n" + tail)
    r.finish()
