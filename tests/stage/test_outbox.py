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
