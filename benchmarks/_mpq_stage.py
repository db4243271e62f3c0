"""The hand-written stage a careful user would write instead of ``enginecore.stage``.

A child process started with multiprocessing *spawn* (like a launched stage), one
``multiprocessing.Queue`` in each direction, pickle on both (the queues' own format), and
nothing else: no IO threads of our own, no wire protocol, no checks. It is the baseline of
the "what does enginecore buy over the obvious thing" benchmarks (``bench_stage_requests``,
``bench_stage_utility``, ``bench_stage_arrays``, ``bench_stage_output``,
``bench_stage_ingest``).

The child (:func:`serve`) blocks in ``get()`` while its engine is idle (with a timeout, only
to notice a dead parent; a busy child looks for its parent once a second), drains every
message already queued with non-blocking gets, applies them in order, then steps while the
engine has work and ``put``\\ s each step's outputs as **one** list.

Messages, parent -> child (tuples):

* ``("add", rid, data)``, ``("adds", [(rid, data), ...])``: requests, applied in order;
* ``("abort", [rid, ...])``: applied, then answered ``("aborted", [rid, ...])``;
* ``("utility", call_id, name, args)``: answered ``("utility", call_id, result, error)``;
* ``("quit",)``: answered ``("bye",)``, then the child returns (exit code 0).

Child -> parent: a step's outputs as a ``list``, anything else is a ``tuple``. The child
also puts ``("ready",)`` once at start. The parent (:class:`MpqStage`) routes each output
``(rid, left)`` of a :class:`~enginecore.CountdownEngine` into a per-request list and knows a
request has finished when ``left == 0``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.queues
import os
import queue
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from enginecore import CountdownEngine

from ._cli import ignore_ctrl_c

__all__ = ["MpqStage", "serve"]

# A child whose parent is gone notices within this long and exits (no orphans).
_ORPHAN_CHECK_S: Final = 1.0

Q = multiprocessing.queues.Queue


def serve(inq: Q[Any], outq: Q[Any], parent_pid: int, factory: Callable[[], Any]) -> None:
    """Target of the child process: the engine loop over two ``multiprocessing.Queue``\\ s."""
    ignore_ctrl_c()
    engine = factory()
    get, put, clock = inq.get, outq.put, time.monotonic
    has_work, step, add = engine.has_work, engine.step, engine.add
    next_check = clock() + _ORPHAN_CHECK_S  # while busy, look for the parent this often
    put(("ready",))
    while True:
        if has_work():
            msgs = []
            if clock() > next_check:
                if os.getppid() != parent_pid:
                    outq.cancel_join_thread()  # nobody will read what is still queued
                    return
                next_check = clock() + _ORPHAN_CHECK_S
        else:
            try:
                msgs = [get(timeout=_ORPHAN_CHECK_S)]
            except queue.Empty:
                if os.getppid() != parent_pid:
                    outq.cancel_join_thread()
                    return
                continue
        while True:
            try:
                msgs.append(get(False))
            except queue.Empty:
                break
        for msg in msgs:
            kind = msg[0]
            if kind == "adds":
                for rid, data in msg[1]:
                    add(rid, data)
            elif kind == "add":
                add(msg[1], msg[2])
            elif kind == "abort":
                engine.abort(msg[1])
                put(("aborted", msg[1]))
            elif kind == "utility":
                try:
                    put(("utility", msg[1], engine.utility(msg[2], msg[3]), None))
                except Exception as exc:
                    put(("utility", msg[1], None, repr(exc)))
            elif kind == "quit":
                put(("bye",))
                return
        if has_work():
            outs = step()
            if outs:
                put(outs)


class MpqStage:
    """The parent's end of a running :func:`serve` child. One thread at a time.

    ``streams[rid]`` collects the outputs of each request added since it was created (pop
    them when done with them); ``live`` holds the requests that have not finished yet.
    ``close()`` (idempotent; also on leaving a ``with`` block) asks the child to quit and
    waits for it; a child that does not quit within 5 s is killed.
    """

    def __init__(
        self, factory: Callable[[], Any] = CountdownEngine, startup_timeout: float = 30.0
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._in: Q[Any] = ctx.Queue()
        self._out: Q[Any] = ctx.Queue()
        self.streams: dict[str, list[Any]] = {}
        self.live: set[str] = set()
        self._answers: dict[int, tuple[Any, ...]] = {}
        self._call_ids = itertools.count(1)
        self._closed = False
        self.process = ctx.Process(
            target=serve,
            args=(self._in, self._out, os.getpid(), factory),
            name="bench-mpq-stage",
            daemon=True,
        )
        try:
            self.process.start()
            if self._get(startup_timeout) != ("ready",):
                raise RuntimeError("the mp.Queue stage did not start")
        except BaseException:
            self.close()
            raise

    # -- requests ----------------------------------------------------------------------------

    def add(self, rid: str, data: Any) -> None:
        """One put per request."""
        self.streams[rid] = []
        self.live.add(rid)
        self._in.put(("add", rid, data))

    def add_many(self, items: Iterable[tuple[str, Any]], streams: bool = True) -> None:
        """One put for a whole burst of ``(rid, data)`` pairs. Without *streams*, nothing
        is registered for them: their outputs are for :meth:`read_outputs` (a consumer of
        the outputs in order, like a stage client's ``add_many(..., streams=False)``)."""
        items = list(items)
        if streams:
            per_rid, live = self.streams, self.live
            for rid, _ in items:
                per_rid[rid] = []
                live.add(rid)
        self._in.put(("adds", items))

    def read_outputs(self, n: int, timeout: float = 60.0) -> int:
        """Read the child's step lists in order until *n* outputs have come, without
        routing them (requests added with ``streams=False``); returns how many came (the
        last list may hold more)."""
        deadline = time.monotonic() + timeout
        get = self._out.get
        seen = 0
        while seen < n:
            try:
                msg = get(timeout=_ORPHAN_CHECK_S)
            except queue.Empty:
                msg = self._get(deadline - time.monotonic())  # raises if the child died
            if msg.__class__ is list:
                seen += len(msg)
            else:
                self._handle(msg)
        return seen

    def forget(self, rids: Iterable[str]) -> None:
        """Drop the bookkeeping of *rids* (requests whose engine never ends them)."""
        for rid in rids:
            self.streams.pop(rid, None)
            self.live.discard(rid)

    def abort(self, rids: list[str]) -> None:
        """Ask the child to abort *rids*; they leave :attr:`live` once it has."""
        self._in.put(("abort", rids))

    def collect(self, timeout: float = 60.0) -> None:
        """Route outputs into :attr:`streams` until no request is live."""
        deadline = time.monotonic() + timeout
        while self.live:
            self._handle(self._get(deadline - time.monotonic()))

    def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        """A utility round trip: put the call, block for its answer (routing any outputs)."""
        call_id = next(self._call_ids)
        self._in.put(("utility", call_id, name, args))
        deadline = time.monotonic() + timeout
        answers = self._answers
        while call_id not in answers:
            self._handle(self._get(deadline - time.monotonic()))
        _, _, result, error = answers.pop(call_id)
        if error is not None:
            raise RuntimeError(f"utility {name!r} failed in the mp.Queue stage: {error}")
        return result

    def echo(self, rid: str, data: Any, timeout: float = 60.0) -> Any:
        """Add *rid* to an engine with one output per request; return that output's payload."""
        self._in.put(("add", rid, data))
        deadline = time.monotonic() + timeout
        while True:
            msg = self._get(deadline - time.monotonic())
            if msg.__class__ is list:
                for out_rid, payload in msg:
                    if out_rid == rid:
                        return payload
            else:
                self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if msg.__class__ is list:  # one step's outputs, (rid, left) each
            streams, live = self.streams, self.live
            for rid, left in msg:
                streams[rid].append(left)
                if not left:
                    live.discard(rid)
        elif msg[0] == "utility":
            self._answers[msg[1]] = msg
        elif msg[0] == "aborted":
            self.live.difference_update(msg[1])

    def _get(self, timeout: float) -> Any:
        """The child's next message; raise if it died or *timeout* seconds passed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._out.get(timeout=_ORPHAN_CHECK_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the mp.Queue stage died (exit code {self.process.exitcode})"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError("the mp.Queue stage did not answer in time") from None

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        proc = self.process
        if proc.pid is not None:
            if proc.is_alive():
                self._in.put(("quit",))
                # Read until its goodbye: the child's queue flushes everything it put before
                # it can exit, so it must not be left writing into a full pipe.
                deadline = time.monotonic() + 5.0
                try:
                    while self._get(deadline - time.monotonic()) != ("bye",):
                        pass
                except (RuntimeError, TimeoutError):
                    pass
            proc.join(5)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for q in (self._in, self._out):
            q.cancel_join_thread()  # the child is gone: nothing left to flush to it
            q.close()

    def __enter__(self) -> MpqStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
