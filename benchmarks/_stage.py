"""Shared pieces of the stage-runtime benchmarks: the raw baseline process and two engines.

The raw baseline is what a hand-written stage process would be with nothing but pyzmq and
msgspec: **one thread**, a ``ROUTER`` it reads requests from and a ``PUSH`` it streams
outputs on, bound to ipc sockets in a private temporary directory, exactly like a launched
stage (``docs/stage.md``). It has no input thread, no loop thread, no output thread and no
queues between them, and the parent side has no receiver thread: every hop that the stage
runtime adds is missing. It is started with multiprocessing *spawn*, like a stage.

With ``zero_copy=True`` the raw server is instead an echo of multipart frames received and
sent with ``copy=False`` (the raw baseline of the array round trip).

This module is imported by the spawned children (the raw server, and a stage whose factory is
``benchmarks._stage:SinkEngine`` or ``benchmarks._stage:EchoEngine``): spawn gives a child the
parent's ``sys.path``, and ``python -m benchmarks`` (or pytest) from the repository root puts
the root on it.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.process
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec
import zmq

from enginecore import CountdownEngine

from ._cli import ignore_ctrl_c

__all__ = [
    "ECHO_FACTORY",
    "LIVENESS_MS",
    "REPLY_TIMEOUT_S",
    "SINK_FACTORY",
    "EchoEngine",
    "RawPeer",
    "SinkEngine",
    "raw_server",
    "wait_for",
]

SINK_FACTORY: Final = "benchmarks._stage:SinkEngine"
ECHO_FACTORY: Final = "benchmarks._stage:EchoEngine"

# A raw server whose parent is gone notices within this long and exits (no orphans).
_ORPHAN_CHECK_MS: Final = 1000

# The parent's sockets give up a blocked recv (or send) this often to see whether the peer
# process still runs: a dead peer fails the benchmark instead of hanging it. The hot loops
# pay nothing for it until a recv has waited this long (a socket option, no poll per call).
LIVENESS_MS: Final = 1000

# How long the parent waits for an answer from a live peer before it gives up.
REPLY_TIMEOUT_S: Final = 60.0

T = TypeVar("T")


def wait_for(
    attempt: Callable[[], T],
    processes: Sequence[multiprocessing.process.BaseProcess],
    what: str,
    timeout: float = REPLY_TIMEOUT_S,
) -> T:
    """Retry *attempt* (a recv or send on a socket with a ``LIVENESS_MS`` timeout, which
    raises ``zmq.Again`` when that runs out) until it succeeds. Between tries, raise
    ``RuntimeError`` naming *what* if one of *processes* has exited (a dead peer would
    otherwise be waited for forever), and ``TimeoutError`` after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except zmq.Again:
            dead = [p for p in processes if not p.is_alive()]
            if dead:
                codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
                raise RuntimeError(f"{what} died ({codes}); no answer will come") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not answer within {timeout:g} s") from None


class SinkEngine:
    """Never has work; counts ``add`` calls. ``utility("count")`` returns the count since the
    last such call and resets it (the ingest barrier); ``utility("gc_enabled")`` says whether
    the cyclic GC is on in the process it runs in; any other utility returns ``None``."""

    def __init__(self) -> None:
        self.count = 0

    def has_work(self) -> bool:
        return False

    def add(self, req_id: str, data: Any) -> None:
        self.count += 1

    def abort(self, req_ids: Sequence[str]) -> None:
        pass

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "count":
            n, self.count = self.count, 0
            return n
        if name == "gc_enabled":
            return gc.isenabled()
        return None

    def step(self) -> list[Any]:
        return []


class EchoEngine:
    """Each request has one output, ``(req_id, data)``: the data it was added with, as is.

    The outputs are the default ``(req_id, payload)`` pairs of the stage's routing, and
    :meth:`is_finished` says every output is its request's last. Used to move arrays
    client -> engine -> client.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[str, Any]] = []

    def has_work(self) -> bool:
        return bool(self.pending)

    def add(self, req_id: str, data: Any) -> None:
        self.pending.append((req_id, data))

    def abort(self, req_ids: Sequence[str]) -> None:
        drop = set(req_ids)
        self.pending = [p for p in self.pending if p[0] not in drop]

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        return None

    def step(self) -> list[tuple[str, Any]]:
        out, self.pending = self.pending, []
        return out

    @staticmethod
    def is_finished(output: tuple[str, Any]) -> bool:
        return True


def raw_server(
    input_address: str, output_address: str, parent_pid: int, zero_copy: bool = False
) -> None:
    """Target of the raw baseline process: one thread, a ROUTER in and a PUSH out.

    Messages (msgpack arrays, decoded with msgspec, one per frame, like the stage's wire):

    * ``["utility", call_id, name, args]`` -> reply ``["utility", call_id, None, None]`` on
      the ROUTER (the echo round trip);
    * ``["add", req_id, data]`` -> counted, nothing else;
    * ``["count", call_id]`` -> reply ``["utility", call_id, n, None]``, ``n`` the adds
      counted since the last ``count``, and reset (the ingest barrier);
    * ``["stream", requests, steps, columnar]`` -> run a :class:`~enginecore.CountdownEngine`
      with *requests* requests of *steps* steps to the end, and PUSH each step's outputs as
      one frame in the stage's event shape: with *columnar* (wire v2), one
      ``["outputs", req_ids, finished, remainings]`` event, else (v1) one
      ``["output", req_id, finished, remaining]`` event per output;
    * ``["quit"]`` -> close and return;
    * ``["gc", call_id]`` -> reply ``["utility", call_id, gc.isenabled(), None]``.

    With *zero_copy*, every message but ``["quit"]`` is sent back as it came, all its frames,
    received and sent with ``copy=False`` (the parent sends a body and the array's buffer).
    """
    ignore_ctrl_c()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    # A blocking recv that gives up now and then to look for the parent: no per-message poll.
    router.setsockopt(zmq.RCVTIMEO, _ORPHAN_CHECK_MS)
    push = ctx.socket(zmq.PUSH)
    router.bind(input_address)
    push.bind(output_address)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder().decode
    count = 0
    try:
        if zero_copy:
            _echo_frames(router, decode, parent_pid)
            return
        while True:
            try:
                ident, frame = router.recv_multipart()
            except zmq.Again:
                if os.getppid() != parent_pid:
                    return
                continue
            msg = decode(frame)
            kind = msg[0]
            if kind == "add":
                count += 1
            elif kind == "utility":
                router.send_multipart([ident, encode(("utility", msg[1], None, None))])
            elif kind == "count":
                router.send_multipart([ident, encode(("utility", msg[1], count, None))])
                count = 0
            elif kind == "stream":
                engine = CountdownEngine()
                for i in range(msg[1]):
                    engine.add(f"r{i}", msg[2])
                columnar = len(msg) > 3 and msg[3]
                while engine.has_work():
                    outs = engine.step()
                    if columnar:
                        lefts = [left for _, left in outs]
                        rids = [rid for rid, _ in outs]
                        push.send(encode([("outputs", rids, [x == 0 for x in lefts], lefts)]))
                    else:
                        push.send(encode([("output", rid, left == 0, left) for rid, left in outs]))
            elif kind == "quit":
                return
            elif kind == "gc":
                router.send_multipart([ident, encode(("utility", msg[1], gc.isenabled(), None))])
    finally:
        router.close(linger=0)
        push.close(linger=1000)
        ctx.term()


def _echo_frames(router: zmq.Socket[bytes], decode: Callable[[Any], Any], parent_pid: int) -> None:
    """The zero-copy echo loop of :func:`raw_server`."""
    while True:
        try:
            parts = router.recv_multipart(copy=False)
        except zmq.Again:
            if os.getppid() != parent_pid:
                return
            continue
        if decode(parts[1].buffer)[0] == "quit":
            return
        router.send_multipart(parts, copy=False)


class RawPeer:
    """The parent's end of a running :func:`raw_server`: a DEALER and a PULL. Single thread.

    *zero_copy* starts the server as a zero-copy echo of multipart frames (see there).

    Both sockets give up a blocked ``recv`` (the DEALER a blocked ``send`` too) after
    ``LIVENESS_MS`` with ``zmq.Again``. :meth:`call` handles that itself; a benchmark that
    uses the sockets directly in its hot loop catches ``zmq.Again`` and finishes the call
    with :meth:`wait`, which raises ``RuntimeError`` if the server process has died (and
    ``TimeoutError`` if a live one does not answer within ``REPLY_TIMEOUT_S``) instead of
    waiting forever.

    ``close()`` (idempotent; also on leaving a ``with`` block) stops the process, kills it if
    it does not stop within 5 s, and removes its socket directory.
    """

    def __init__(self, startup_timeout: float = 30.0, zero_copy: bool = False) -> None:
        self._dir = tempfile.mkdtemp(prefix="ecbench-")
        in_addr = f"ipc://{os.path.join(self._dir, 'in')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'out')}"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.dealer = self._ctx.socket(zmq.DEALER)
        self.pull = self._ctx.socket(zmq.PULL)
        for sock in (self.dealer, self.pull):
            sock.setsockopt(zmq.RCVTIMEO, LIVENESS_MS)
        self.dealer.setsockopt(zmq.SNDTIMEO, LIVENESS_MS)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder().decode
        self._closed = False
        self.process = multiprocessing.get_context("spawn").Process(
            target=raw_server,
            args=(in_addr, out_addr, os.getpid(), zero_copy),
            name="bench-raw-stage",
        )
        try:
            self.process.start()
            self.dealer.connect(in_addr)
            self.pull.connect(out_addr)
            # Handshake: one echo proves the process is up and both ends are connected.
            self.dealer.send(self.encode(("utility", 0, "hello", [])))
            poller = zmq.Poller()
            poller.register(self.dealer, zmq.POLLIN)
            poller.register(self.process.sentinel, zmq.POLLIN)
            if self.dealer not in dict(poller.poll(round(startup_timeout * 1000))):
                raise RuntimeError("the raw baseline process did not start")
            self.dealer.recv()
        except BaseException:
            self.close()
            raise

    def call(self, msg: tuple[Any, ...]) -> Any:
        """Send *msg*, block for the reply on the DEALER, return it decoded. A dead server
        is a ``RuntimeError`` (see :meth:`wait`)."""
        frame = self.encode(msg)
        try:
            self.dealer.send(frame)
        except zmq.Again:
            self.wait(lambda: self.dealer.send(frame))
        try:
            return self.decode(self.dealer.recv())
        except zmq.Again:
            return self.decode(self.wait(self.dealer.recv))

    def wait(self, attempt: Callable[[], T]) -> T:
        """Finish a ``recv``/``send`` on this peer's sockets that raised ``zmq.Again``:
        retry *attempt* while the server process runs; ``RuntimeError`` once it has died,
        ``TimeoutError`` after ``REPLY_TIMEOUT_S``."""
        return wait_for(attempt, [self.process], "the raw baseline process")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process.pid is not None:
            if self.process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    self.dealer.send(self.encode(("quit",)))
            self.process.join(5)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
        self.dealer.close(linger=0)
        self.pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
