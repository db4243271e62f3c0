"""Talking to a stage with nothing but zmq and the codec, as a client in another language
would (``docs/wire.md``), and running a stage in this process for tests that need an engine
of their own."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from enginecore._engine import Engine
from enginecore.stage import PROTOCOL_VERSION, CurveKeys, _codec
from enginecore.stage._curve import secure_client
from enginecore.stage._runtime import StageRuntime

Event = list[Any]


class RawClient:
    """A DEALER on the stage's input socket and, once welcomed, a PULL on its output socket.
    Events are decoded into plain lists, as any msgpack library would."""

    def __init__(
        self,
        address: str,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
        self.address = address
        self.curve = curve  # both sockets are CURVE clients with these keys
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 1000)  # a bye sent right before close() leaves
        if curve is not None:
            secure_client(self.dealer, curve)
        self.dealer.connect(address)
        self.pull: zmq.Socket[bytes] | None = None
        self.frames: list[list[zmq.Frame]] = []  # every frame received, as parts
        self._left: collections.deque[Event] = collections.deque()  # see until()
        self.loads: list[Any] = []  # the load reports received, in order (see events())
        self._encoder = _codec.Encoder()
        self._decoder = _codec.Decoder(strict=True)

    def hello(self, timeout: float = 5.0, rcvhwm: int | None = None) -> list[Any]:
        """Send ``hello``; return the reply. On ``welcome``, connect the PULL socket (with
        that receive high-water mark, if *rcvhwm*)."""
        self.send_hello()
        return self.hello_reply(timeout, rcvhwm)

    def send_hello(self) -> None:
        """Send ``hello`` only: the PULL socket waits for :meth:`hello_reply`."""
        self.dealer.send(msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "raw"]))

    def hello_reply(self, timeout: float = 5.0, rcvhwm: int | None = None) -> list[Any]:
        """The reply to :meth:`send_hello`. On ``welcome``, connect the PULL socket."""
        reply = self.reply(timeout)
        if reply[0] == "welcome":
            output = reply[2]
            if output.startswith("tcp://"):
                host = self.address[len("tcp://") :].rpartition(":")[0]
                output = f"tcp://{host}:{output.rpartition(':')[2]}"
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                secure_client(self.pull, self.curve)
            if rcvhwm is not None:
                self.pull.setsockopt(zmq.RCVHWM, rcvhwm)
            self.pull.connect(output)
        return reply

    def reply(self, timeout: float = 5.0) -> list[Any]:
        """The next handshake reply on the input socket (``AssertionError`` if none comes)."""
        assert self.dealer.poll(round(timeout * 1000)), f"no handshake reply in {timeout} s"
        return msgspec.msgpack.decode(self.dealer.recv())  # type: ignore[no-any-return]

    def send(self, *msg: Any) -> None:
        """Send the message ``[*msg]``, arrays and buffers out of band (``_codec``)."""
        parts = self._encoder.encode(_codec.prepare(list(msg)))
        self.dealer.send_multipart(parts, copy=False)

    def send_raw(self, *parts: bytes) -> None:
        """Send *parts* as they are: a body and buffers, possibly invalid."""
        self.dealer.send_multipart(list(parts))

    def events(self, timeout: float = 5.0) -> list[Event]:
        """The events of the next frame on the output socket (``TimeoutError`` if none)."""
        assert self.pull is not None, "not welcomed"
        if not self.pull.poll(round(timeout * 1000)):
            raise TimeoutError(f"no frame on the output socket in {timeout} s")
        parts = self.pull.recv_multipart(copy=False)
        self.frames.append(parts)
        events: list[Event] = self._decoder.decode(parts)
        for ev in events:
            # A load report rides on an outputs event as its fifth element (docs/wire.md):
            # kept apart, as a client keeps it, so that tests compare the events alone.
            if ev[0] == "outputs" and len(ev) > 4:
                self.loads.append(ev.pop(4))
        return events

    def until(self, done: Callable[[Event], bool], timeout: float = 5.0) -> list[Event]:
        """Every event up to and including the first for which *done* is true; the events
        after it in the same frame are kept for the next call."""
        deadline = time.monotonic() + timeout
        seen: list[Event] = []
        while True:
            if not self._left:
                self._left.extend(self.events(max(0.0, deadline - time.monotonic())))
            event = self._left.popleft()
            seen.append(event)
            if done(event):
                return seen

    def call(self, call_id: int, name: str, *args: Any, timeout: float = 5.0) -> list[Event]:
        """Call utility *name*; every event up to and including its answer."""
        self.send("utility", call_id, name, list(args))
        return self.until(lambda ev: ev[0] == "utility" and ev[1] == call_id, timeout)

    def close(self) -> None:
        for sock in (self.pull, self.dealer):
            if sock is not None:
                sock.close()
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def welcomed_once_free(address: str, *, rejected: str, timeout: float = 10.0) -> RawClient:
    """A raw client welcomed in the place another client left with a ``bye``. That ``bye``
    and this ``hello`` come on two connections, with no order between them (docs/wire.md,
    section 1): until the stage has read the ``bye``, a ``hello`` is rejected with a reason
    that contains *rejected* (a one-client stage: the other client is still attached; a
    multi-client stage: one client too many), so try again until the place is free
    (``AssertionError`` on another reply, or past *timeout*)."""
    deadline = time.monotonic() + timeout
    while True:
        client = RawClient(address)
        reply = client.hello()
        if reply[0] == "welcome":
            return client
        client.close()
        assert reply[0] == "reject", reply
        assert rejected in reply[2], reply
        assert time.monotonic() < deadline, f"not welcomed within {timeout} s: {reply}"
        time.sleep(0.05)


def refused_handshake(
    address: str,
    *messages: bytes,
    curve: tuple[bytes, bytes, bytes] | None = None,
    routing_id: bytes | None = None,
    timeout: float = 10.0,
) -> None:
    """Connect a DEALER to *address* (NULL, or a CURVE client with ``(public, secret,
    server_key)``), send *messages* without waiting for anything, and assert that the stage
    refused the handshake within *timeout* seconds and that nothing came back.

    A NULL peer must meet a mechanism mismatch (the stage requires CURVE), a CURVE peer a
    refused key (the stage's ZAP handler). Either may instead see the stage close during the
    handshake (``EVENT_HANDSHAKE_FAILED_NO_DETAIL``): when the stage closes its end before the
    peer has read the stage's reply, libzmq reports only the broken pipe, and a peer can meet
    that on every reconnect (seen on a loaded host). Each means the stage let nothing in."""
    events = (
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            dealer.setsockopt(zmq.ROUTING_ID, routing_id)
        if curve is not None:
            dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = curve
        monitor = dealer.get_monitor_socket(events)
        dealer.connect(address)
        for message in messages:
            dealer.send(message)
        assert monitor.poll(int(timeout * 1000)), f"the stage at {address} never refused"
        event = recv_monitor_message(monitor)
        kind, value = event["event"], event["value"]
        if kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            if curve is None:
                assert kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, event
                assert value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, event
            else:
                assert kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH, event
        assert not dealer.poll(100), "the stage answered a peer it refused"
        dealer.disable_monitor()
    finally:
        ctx.destroy(linger=0)  # closes every socket, also when an assertion failed


class InProcessStage:
    """A :class:`StageRuntime` whose loop runs in a thread of this process, on ipc sockets
    in *directory*, so that a test can give it an engine defined in the test."""

    def __init__(self, engine: Engine, directory: str, **kwargs: Any) -> None:
        self.runtime = StageRuntime(
            engine,
            f"ipc://{directory}/in",
            f"ipc://{directory}/out",
            engine_name="test",
            handle_signals=(),
            **kwargs,
        )
        self.address = self.runtime.input_address
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="test-stage-loop")
        self._thread.start()

    def _run(self) -> None:
        self.exit_code = self.runtime.run()

    def wait(self, timeout: float = 10.0) -> int | None:
        """Wait for the loop to end; its exit code."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stage did not end"
        return self.exit_code

    def stop(self) -> int | None:
        """Shut down without waiting for a client to read the last frames."""
        self.runtime.abandon()
        return self.wait()


@contextlib.contextmanager
def in_process_stage(
    engine: Engine, directory: str, **kwargs: Any
) -> Iterator[tuple[InProcessStage, RawClient]]:
    """A running :class:`InProcessStage` and a welcomed :class:`RawClient`; both are closed
    afterwards."""
    stage = InProcessStage(engine, directory, **kwargs)
    try:
        with RawClient(stage.address) as client:
            assert client.hello()[0] == "welcome"
            yield stage, client
    finally:
        stage.stop()
