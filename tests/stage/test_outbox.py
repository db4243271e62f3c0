"""The stage's output side (``_outbox.Outbox``) on a real socket pair, for what the stage
tests cannot pin down from outside: what its output thread keeps alive."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import zmq

from enginecore.stage import _codec
from enginecore.stage._outbox import Outbox

from .conftest import wait_until


def test_the_output_thread_keeps_nothing_it_sent_alive_while_it_waits() -> None:
    # The last batch the output thread sent must not live on while it waits for the next:
    # its payloads (a pipeline stage's arrays, and the shared memory under them) would
    # stay alive until the next event, which after a death may never come.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind("inproc://out")
    pull.connect("inproc://out")
    outbox = Outbox(push, abort_request=lambda rid: None, on_failure=lambda: None, may_wait=bool)
    outbox.start()
    try:
        payload = np.arange(1 << 16, dtype=np.float64)  # big enough for a zero-copy frame
        ref = weakref.ref(payload)
        outbox.post([("outputs", ["r"], [False], [_codec.prepare(payload, "output")])])
        del payload
        assert pull.poll(5000)
        parts: Any = pull.recv_multipart()
        assert len(parts) == 2
        assert len(parts[1]) == (1 << 16) * 8
        # pyzmq lets go of a zero-copy frame's buffer on its own thread, after libzmq did.
        assert wait_until(lambda: gc.collect() >= 0 and ref() is None, 5)
    finally:
        outbox.close(5.0)
        pull.close(linger=0)
        ctx.term()


def test_the_terminal_event_counts_even_if_the_output_thread_never_takes_it() -> None:
    # While no client can read, the output thread waits for a peer to take the frame it
    # holds, until the stage ends with Context.term(): it never takes the shutdown event
    # queued behind. The stage's exit code reads terminal: a serve stopped by SIGTERM with
    # a detached client's requests still running exited 1 instead of 0.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind("inproc://out")  # and no PULL: nobody reads
    outbox = Outbox(push, abort_request=lambda rid: None, on_failure=lambda: None, may_wait=bool)
    outbox.start()
    try:
        outbox.post([("outputs", ["r"], [False], [1])])
        # The output thread has taken the frame and found no peer for it (it sets stuck
        # under the lock, then waits in poll for one).
        assert wait_until(lambda: outbox.stuck, 5)
        outbox.post(("shutdown",))
        assert outbox.terminal == "shutdown"
        outbox.close(0.0)
        assert outbox.running  # still waiting for a peer
    finally:
        ctx.term()  # ends the wait (ETERM); the output thread closes the socket
        outbox.join(5.0)
    assert not outbox.running
    assert outbox.terminal == "shutdown"
    assert not outbox.failed
