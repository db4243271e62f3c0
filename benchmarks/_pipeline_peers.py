"""Peers of ``bench_stage_pipeline``: the raw pyzmq hop chain, and a relay for clients.

**The raw hop chain** (:class:`ZmqChain`) is what a hop between two processes costs with
nothing but pyzmq and msgspec: *n* processes, each **one thread** that blocks in ``recv``
on a ``PULL`` bound to an ipc socket, decodes the message (msgspec msgpack), encodes it
again and sends it on its ``PUSH`` to the next process, the last one to the parent's
``PULL``. The parent sends on a ``PUSH`` to the first one. A message through a chain of
*n* crosses *n* + 1 process boundaries; a chain of 3 against a chain of 1 adds two hops,
each one process's wake-up in ``recv``, a decode, an encode and a send. Started with
multiprocessing *spawn*, sockets in a private temporary directory, like a stage.

**OneShotRelay** (factory ``benchmarks._pipeline_peers:one_shot_relay``) is
:class:`~enginecore.stage.testing.RelayEngine` for a plain :class:`StageClient`: every
``add`` is a whole request (its input closed at once), so each input becomes one output
that finishes its request, after the same per-step sleep. It is the relay stage of the
"routing through the parent" baseline, where each payload is its own request.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import tempfile
from typing import Any, Final

import msgspec
import zmq

from enginecore.stage.testing import RelayEngine

from ._cli import ignore_ctrl_c
from ._stage import LIVENESS_MS, wait_for

__all__ = ["ONE_SHOT_RELAY", "OneShotRelay", "ZmqChain", "hop_server", "one_shot_relay"]

ONE_SHOT_RELAY: Final = "benchmarks._pipeline_peers:one_shot_relay"

_ORPHAN_CHECK_MS: Final = 1000  # a hop whose parent is gone notices within this long


class OneShotRelay(RelayEngine):
    """A :class:`RelayEngine` whose every ``add`` is a whole request: one output, finished."""

    def add(self, req_id: str, data: Any) -> None:
        super().add(req_id, data)
        self.close_input(req_id)


def one_shot_relay(step_s: float = 0.0) -> OneShotRelay:
    """Factory: a :class:`OneShotRelay`."""
    return OneShotRelay(step_s)


def hop_server(in_address: str, out_address: str, parent_pid: int) -> None:
    """Target of one hop of the raw chain: ``recv``, decode, encode, ``send`` on, one
    thread. ``["quit"]`` is passed on, then the hop returns."""
    ignore_ctrl_c()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, _ORPHAN_CHECK_MS)  # a blocking recv that looks up now and then
    push = ctx.socket(zmq.PUSH)
    pull.bind(in_address)
    push.connect(out_address)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder().decode
    try:
        while True:
            try:
                frame = pull.recv()
            except zmq.Again:
                if os.getppid() != parent_pid:
                    return
                continue
            msg = decode(frame)
            push.send(encode(msg))
            if msg[0] == "quit":
                return
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()


class ZmqChain:
    """The parent's end of a chain of *n* :func:`hop_server` processes. Single thread.

    :meth:`trip` sends one message through the chain and blocks for it; if a hop process
    has died, it raises ``RuntimeError`` instead of waiting forever (the parent's sockets
    give up a blocked ``recv`` or ``send`` every ``LIVENESS_MS`` to look). ``close()``
    (idempotent; also on leaving a ``with`` block) stops the hops, kills any that does not
    stop within 5 s, and removes the socket directory."""

    def __init__(self, n: int, startup_timeout: float = 30.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="ecbench-chain-")
        ins = [f"ipc://{os.path.join(self._dir, f'hop{k}')}" for k in range(n)]
        back = f"ipc://{os.path.join(self._dir, 'back')}"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.push = self._ctx.socket(zmq.PUSH)
        self.pull = self._ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVTIMEO, LIVENESS_MS)
        self.push.setsockopt(zmq.SNDTIMEO, LIVENESS_MS)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder().decode
        self._closed = False
        spawn = multiprocessing.get_context("spawn")
        outs = [*ins[1:], back]
        self.processes = [
            spawn.Process(target=hop_server, args=(i, o, os.getpid()), name=f"bench-zmq-hop-{k}")
            for k, (i, o) in enumerate(zip(ins, outs, strict=True))
        ]
        try:
            self.pull.bind(back)
            for proc in self.processes:
                proc.start()
            self.push.connect(ins[0])
            # Handshake: one message through the chain proves every hop is up and connected.
            self.push.send(self.encode(("hello", 0)))
            if not self.pull.poll(round(startup_timeout * 1000)):
                raise RuntimeError("the raw hop chain did not start")
            self.pull.recv()
        except BaseException:
            self.close()
            raise

    def trip(self, msg: tuple[Any, ...]) -> Any:
        """Send *msg* through the chain; block for it at the end; return it decoded. A dead
        hop is a ``RuntimeError`` (see :func:`~benchmarks._stage.wait_for`)."""
        frame = self.encode(msg)
        try:
            self.push.send(frame)
        except zmq.Again:
            wait_for(lambda: self.push.send(frame), self.processes, "a hop of the raw chain")
        try:
            return self.decode(self.pull.recv())
        except zmq.Again:
            return self.decode(wait_for(self.pull.recv, self.processes, "a hop of the raw chain"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        started = [p for p in self.processes if p.pid is not None]
        whole = bool(started) and all(p.is_alive() for p in started)
        if whole:
            with contextlib.suppress(zmq.ZMQError):
                self.push.send(self.encode(("quit",)), zmq.NOBLOCK)
                self.pull.poll(5000)  # the quit came through: every hop has returned
        for proc in started:
            # A broken chain cannot pass the quit on: its live hops are killed at once.
            proc.join(5 if whole else 0)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ZmqChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
