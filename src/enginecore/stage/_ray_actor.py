"""The Ray actor of a stage placed on Ray (``enginecore.stage.ray``), in a module of its own.

Ray pickles the actor's class by reference, so each actor's process imports this module
before it serves: it imports only what the stage's process runs (the runtime, its logging
and CURVE set-up), not the client side (``enginecore.stage.ray``'s placement, the clients,
pools and pipelines), and nothing it does not use. The runtime and the engine factory are
imported in :meth:`_StageActor.start`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Final

from . import _logs
from ._errors import StageStartupError

# How long the handshake with a started actor's stage may take (enginecore.stage.ray's
# default connect_timeout; the actor waits this long for the client's log socket).
CONNECT_TIMEOUT: Final = 10.0


def _import_ray() -> Any:
    import ray  # the actor runs in a Ray worker: Ray is imported already

    return ray


class _StageActor:
    """The actor: one stage, its loop on a thread of the actor's process. Ray runs its
    methods on up to :data:`_ACTOR_CONCURRENCY` threads."""

    def __init__(self) -> None:
        self._runtime: Any = None
        self._done = threading.Event()
        self._code: int | None = None
        self._curve: Any = None  # the stage's ServerCurve, once made
        self._owner: bytes | None = None  # the public key of the client that placed it
        self._logs: _logs.ForwardHandler | None = None
        self._link_keys: tuple[bytes, bytes] | None = None  # a pipeline stage's, once made

    def _server_curve(self, keys: dict[str, Any] | None) -> Any:
        """The stage's CURVE set-up (made once): its key pair (read from
        ``keys["secret_file"]`` on this node, else made here) and the client keys it
        admits; ``None`` without CURVE."""
        if keys is None:
            return None
        if self._curve is None:
            import zmq
            import zmq.auth

            from ._curve import ServerCurve, check_server_pair

            secret_file = keys.get("secret_file")
            if secret_file is None:
                public, secret = zmq.curve_keypair()
            else:
                where = f"on the node of this stage ({_import_ray().util.get_node_ip_address()})"
                if os.path.isdir(secret_file):
                    raise ValueError(
                        f"stage_secret_key: {secret_file!r} is a directory {where}: give the "
                        f"stage's NAME.key_secret file in it"
                    )
                if not os.path.isfile(secret_file):
                    raise ValueError(f"stage_secret_key: no such file {secret_file!r} {where}")
                try:
                    public, loaded = zmq.auth.load_certificate(secret_file)
                except (OSError, ValueError) as exc:
                    raise ValueError(
                        f"stage_secret_key: cannot read a key from {secret_file!r} {where}: {exc}"
                    ) from exc
                if loaded is None:
                    raise ValueError(
                        f"stage_secret_key: {secret_file!r} {where} holds no secret key (give "
                        f"the stage's NAME.key_secret)"
                    )
                public, secret = check_server_pair(
                    public, loaded, f"stage_secret_key {secret_file!r} {where}"
                )
            self._owner = keys["authorized"][0]
            self._curve = ServerCurve(
                public_key=public,
                secret_key=secret,
                authorized=frozenset(keys["authorized"]),
                authorized_dir="(the keys of the client that placed it on Ray)",
            )
        return self._curve

    def open_logs(
        self, stage: str, level: int | None, keys: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Before :meth:`start`, with ``forward_logs``: set up the stage's logging with a
        handler bound on this node's IP (a CURVE server with the stage's keys), and return
        its address and the stage's public key, for the client's ``PULL`` to connect."""
        if self._logs is not None:
            raise RuntimeError("this actor forwards its logs already")
        curve = self._server_curve(keys)
        if curve is not None:
            assert self._owner is not None  # set with the curve
            # The log socket is the placing client's alone: a bound PUSH deals its records
            # out round robin, so any other reader would take records from it, and ZeroMQ
            # cannot close one peer of it at a key rotation. The owner's key never rotates.
            curve = dataclasses.replace(
                curve,
                authorized=frozenset([self._owner]),
                authorized_dir="(the key of the client that placed it on Ray: logs are its own)",
            )
        handler = _logs.ForwardHandler(f"tcp://{_node_host()}:0", stage, bind=True, curve=curve)
        self._logs = handler
        _logs.configure_stage(stage, level, None, forward=handler)
        return {
            "address": handler.address,
            "server_key": None if curve is None else curve.public_key,
        }

    def link_key(self) -> bytes:
        """A pipeline stage's key pair for its links to the next stage (CURVE clients),
        made here once: its public key, for the next stage to admit before this stage
        connects to it (:meth:`start` hands the pair to the factory, with ``link_kwarg``).
        The secret key never leaves this process."""
        if self._link_keys is None:
            import zmq

            self._link_keys = zmq.curve_keypair()
        return self._link_keys[0]

    def start(
        self,
        factory: str,
        kwargs_frame: bytes,
        stage: str,
        options: dict[str, Any],
        keys: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Build the engine and the stage, bound on this node's IP; run its loop on a
        thread; return the addresses, the pid and the stage's public key (``None``
        without CURVE). *keys*: ``{"authorized": [client public keys], "secret_file":
        path or None}``, or ``None`` without CURVE; with ``"link_kwarg": NAME`` too (a
        pipeline stage), the stage's key pair for its links to the next stage
        (:meth:`link_key`) is given to the factory as the kwarg ``NAME`` (``[public,
        secret]``), and its public key returned as ``link_key`` (else ``None``). With
        forwarded logs (:meth:`open_logs` first), waits for the client's log socket before
        the engine is built, so that none of its records are lost. Raises what the factory
        raises."""
        import msgspec

        from ._process import build_engine, engine_name
        from ._runtime import StageRuntime

        if self._runtime is not None:
            raise RuntimeError("this actor runs a stage already")
        if self._logs is None:
            _logs.configure_stage(stage, options.get("log_level"), None)
        elif not self._logs.wait_connected(options.get("connect_timeout", CONNECT_TIMEOUT)):
            raise StageStartupError(
                f"the client did not connect to the log socket {self._logs.address} of this "
                f"stage in time"
            )
        host = _node_host()
        curve = self._server_curve(keys)
        kwargs = msgspec.msgpack.decode(kwargs_frame)
        link_key: bytes | None = None
        link_kwarg = None if keys is None else keys.get("link_kwarg")
        if link_kwarg is not None:
            link_key = self.link_key()
            assert self._link_keys is not None
            kwargs[link_kwarg] = list(self._link_keys)
        engine = build_engine(factory, kwargs)
        runtime = StageRuntime(
            engine,
            f"tcp://{host}:0",
            f"tcp://{host}:0",
            engine_name=engine_name(factory, kwargs),
            step_timeout=options.get("step_timeout"),
            kill_after=options.get("kill_after"),
            handle_signals=(),
            load_interval=options.get("load_interval"),
            name=stage,
            curve=curve,
            max_message_bytes=options.get("max_message_bytes"),
        )
        self._runtime = runtime
        threading.Thread(target=self._run, name="enginecore-stage-loop", daemon=True).start()
        return {
            "input": runtime.input_address,
            "output": runtime.output_address,
            "pid": os.getpid(),
            "node_ip": host,
            "server_key": None if curve is None else curve.public_key,
            "link_key": link_key,
        }

    def _run(self) -> None:
        try:
            self._code = self._runtime.run()
        finally:
            handler = self._logs
            if handler is not None:  # the client reads the stage's last records, then stops
                logging.getLogger().removeHandler(handler)
                handler.close()
            self._done.set()

    def authorize(self, keys: list[str]) -> int:
        """Key rotation: the stage admits the client that placed it and *keys* (public
        keys, Z85 text) from now on, instead of the keys admitted so far
        (:meth:`StageRuntime.authorize <._runtime.StageRuntime.authorize>`: new connections
        are checked against them, and the clients connected with a key removed lose their
        sessions before this returns). The log socket is not touched: it admits the owner
        only (:meth:`open_logs`). Returns how many keys it admits. :class:`ValueError` for
        a key that is not Z85, :class:`RuntimeError` for a stage without CURVE or not
        started."""
        from ._curve import _check_key

        if self._runtime is None or self._owner is None:
            raise RuntimeError(
                "this stage does not use CURVE (placed with insecure=True)"
                if self._runtime is not None
                else "this actor runs no stage"
            )
        admitted = frozenset(
            [self._owner, *(_check_key(k, "an authorized client key") for k in keys)]
        )
        self._runtime.authorize(admitted)  # not the log socket: it admits the owner only
        return len(admitted)

    def wait(self) -> int | None:
        """Block until the stage's loop has ended; its exit code."""
        self._done.wait()
        return self._code

    def stop(self) -> None:
        """Shut the stage down (as SIGTERM does to a launched stage)."""
        if self._runtime is not None:
            self._runtime.loop.request_shutdown()


def _node_host() -> str:
    """This node's IP as Ray knows it, as the host part of a ``tcp://`` address."""
    host: str = _import_ray().util.get_node_ip_address()
    return f"[{host}]" if ":" in host else host  # IPv6
