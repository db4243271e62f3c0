"""The hand-written chain of stages a careful user would write instead of a ``Pipeline``.

One child process per stage, started with multiprocessing *spawn* (like a launched stage),
one ``multiprocessing.Queue`` between each stage and the next (and from the last one to
the parent), pickle (the queues' own format), and nothing else: no IO threads of our own,
no coordinator, no checks, no abort. It is the baseline of ``bench_stage_pipeline``, in the
style of ``_mpq_stage.py`` (the one-stage version).

Each child (:func:`serve`) builds its engine from ``factory(**kwargs)`` (a picklable
callable: ``enginecore.stage.testing.device`` or ``.relay``), blocks in ``get()`` while the
engine is idle (with a timeout, only to notice a dead parent), drains every message already
queued, applies them in order, then steps while the engine has work and ``put``\\ s each
step's outputs to the next queue as **one** list of ``(rid, payload, last)``. A stage
takes ``("adds", [(rid, data), ...])`` (the parent's requests, for the first stage) and
those lists of items: the first item of a request is its ``add``, the next ones ``feed``
it, and ``last`` closes its input (``close_input``), as a pipeline's stage is fed. ``None``
stops a child; it passes it on first, so that the parent reads it last.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import os
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from ._cli import ignore_ctrl_c

__all__ = ["MpqChain", "serve"]

_ORPHAN_CHECK_S: Final = 1.0  # a child whose parent is gone notices within this long
Q = multiprocessing.queues.Queue


def serve(inq: Q[Any], outq: Q[Any], parent_pid: int, factory: Callable[..., Any], kw: Any) -> None:
    """Target of one stage's child: the engine loop between two queues."""
    ignore_ctrl_c()
    engine = factory(**kw)
    has_work, step, route = engine.has_work, engine.step, engine.route_outputs
    add = engine.add
    feed, close = getattr(engine, "feed", None), getattr(engine, "close_input", None)
    live: set[str] = set()  # requests fed from the previous stage, input still open
    get, put = inq.get, outq.put
    while True:
        msgs = []
        if not has_work():
            try:
                msgs.append(get(timeout=_ORPHAN_CHECK_S))
            except queue.Empty:
                if os.getppid() != parent_pid:
                    return
                continue
        while True:
            try:
                msgs.append(get(False))
            except queue.Empty:
                break
        for msg in msgs:
            if msg is None:
                put(None)
                return
            if msg[0] == "adds":
                for rid, data in msg[1]:
                    add(rid, data)
                continue
            for rid, payload, last in msg:
                if rid in live:
                    feed(rid, payload)  # type: ignore[misc]
                else:
                    add(rid, payload)
                    live.add(rid)
                if last:
                    live.discard(rid)
                    close(rid)  # type: ignore[misc]
        if has_work():
            rids, fins, payloads = route(step())
            if rids:
                put(list(zip(rids, payloads, fins, strict=True)))


class MpqChain:
    """The parent's end of a chain of :func:`serve` children, one per ``(factory, kwargs)``
    of *stages*. :meth:`run` sends a burst of requests to the first stage and reads the last
    stage's outputs until every request has had its last one. One thread at a time;
    :meth:`close` (also on leaving a ``with`` block) stops every child, or kills it."""

    def __init__(self, stages: Sequence[tuple[Callable[..., Any], dict[str, Any]]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._queues: list[Q[Any]] = [ctx.Queue() for _ in range(len(stages) + 1)]
        self.processes = [
            ctx.Process(
                target=serve,
                args=(self._queues[k], self._queues[k + 1], os.getpid(), factory, kw),
                name=f"bench-mpq-chain-{k}",
                daemon=True,
            )
            for k, (factory, kw) in enumerate(stages)
        ]
        self._closed = False
        try:
            for proc in self.processes:
                proc.start()
        except BaseException:
            self.close()
            raise

    def run(self, items: list[tuple[str, Any]], timeout: float = 60.0) -> dict[str, list[Any]]:
        """Send *items* to the first stage at once; return each request's outputs.

        ``RuntimeError`` if a stage's child has died (looked for whenever no message came
        for ``_ORPHAN_CHECK_S``), ``TimeoutError`` if none came for *timeout* seconds."""
        streams: dict[str, list[Any]] = {rid: [] for rid, _ in items}
        left = len(streams)
        self._queues[0].put(("adds", items))
        get = self._queues[-1].get
        while left:
            try:
                msg = get(timeout=_ORPHAN_CHECK_S)
            except queue.Empty:
                msg = self._wait(timeout)
            for rid, payload, last in msg:
                streams[rid].append(payload)
                left -= last
        return streams

    def _wait(self, timeout: float) -> Any:
        """The last queue's next message, waited for while every child runs."""
        deadline = time.monotonic() + timeout
        while True:
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
                raise RuntimeError(f"a stage of the mp.Queue chain died ({codes})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mp.Queue chain did not answer within {timeout:g} s")
            try:
                return self._queues[-1].get(timeout=_ORPHAN_CHECK_S)
            except queue.Empty:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        whole = all(p.is_alive() for p in self.processes)
        if whole:
            self._queues[0].put(None)
            try:
                while self._queues[-1].get(timeout=5.0) is not None:
                    pass
            except queue.Empty:
                pass
        for proc in self.processes:
            if proc.pid is None:  # never started
                continue
            # A broken chain cannot pass the None on: its live children are killed at once.
            proc.join(5 if whole else 0)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for q in self._queues:
            q.cancel_join_thread()  # the children are gone: nothing left to flush to them
            q.close()

    def __enter__(self) -> MpqChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
