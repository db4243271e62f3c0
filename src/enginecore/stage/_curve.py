"""ZeroMQ CURVE for stages over TCP: keys, the stage's ZAP handler, and the client's watch
over its handshake (``docs/security.md``).

- :class:`CurveKeys`: what a client (or a pool's member) needs: its own key pair and the
  stage's public key. :func:`secure_client` applies them to a socket before it connects.
- :class:`ServerCurve`: what a stage needs: its key pair and the client public keys it lets
  in (:func:`load_server_curve` reads ``serve --curve-secret-key FILE
  --authorized-clients DIR``). :func:`secure_server` makes a socket a CURVE server before it
  binds; :func:`start_authenticator` runs the ZAP handler on the stage's context, which
  admits only the listed keys. CURVE without a ZAP handler encrypts but admits anyone who
  knows the server's public key.
- :class:`HandshakeWatch`: reads the client DEALER's socket monitor during the handshake. A
  CURVE handshake that fails is silent at the socket level (libzmq reconnects forever), so
  without it a refused key would read as a timeout; with it, it is an
  :class:`~._errors.AuthenticationError` that says what was likely wrong.
- :func:`keygen`: ``python -m enginecore keygen DIR``.

Keys are Z85 text (40 bytes), as ``zmq.curve_keypair()`` and ``zmq.auth`` write them.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ._errors import AuthenticationError

__all__ = [
    "CurveKeys",
    "HandshakeWatch",
    "KeyWatch",
    "ServerCurve",
    "keygen",
    "load_server_curve",
    "read_authorized",
    "secure_client",
    "secure_server",
    "start_authenticator",
]

logger = logging.getLogger("enginecore.stage")

_Z85_KEY_LEN: Final = 40
# Failed handshakes in a row, the connection closed by the stage without a word, after
# which a client gives up (libzmq retries every ~100-200 ms): a wrong server key.
_SILENT_FAILURES: Final = 2
# The stage logs a refused key at most this often (the rest are counted).
_DENIED_LOG_S: Final = 10.0
# Peers whose key a KeyWatch remembers before it forgets those without a session (each is
# checked again at its next message).
_KNOWN_MAX: Final = 4096
# The ZAP domain of a stage's CURVE server sockets, enforced (ZMQ_ZAP_ENFORCE_DOMAIN): libzmq
# then refuses every CURVE handshake while no ZAP handler answers for it (before the handler
# starts, after it stops, or if it is gone). Without the domain, a CURVE server whose context
# has no handler admits anyone who knows its (public) key. An empty domain must not be
# enforced: libzmq 4.3.5 then skips ZAP altogether and admits every key.
ZAP_DOMAIN: Final = b"enginecore"


def _check_key(value: bytes | str, what: str) -> bytes:
    if isinstance(value, str):
        try:
            value = value.encode("ascii")
        except UnicodeEncodeError:
            raise ValueError(f"{what} is not a valid Z85 CURVE key (not ASCII text)") from None
    if not isinstance(value, bytes):
        raise TypeError(f"{what} must be a Z85 key (bytes), got {type(value).__name__}")
    if len(value) != _Z85_KEY_LEN:
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key, got {len(value)} bytes")
    try:
        z85.decode(value)
    except Exception as exc:  # z85 raises ValueError / KeyError on a bad character
        raise ValueError(f"{what} is not a valid Z85 CURVE key") from exc
    return value


@dataclass(frozen=True)
class CurveKeys:
    """A client's CURVE keys: its own key pair (*public_key*, *secret_key*) and the stage's
    public key (*server_key*), Z85 text, 40 bytes each. Pass it as ``curve=`` to
    :meth:`StageClient.connect <enginecore.stage.StageClient.connect>`,
    :meth:`AsyncStageClient.connect <enginecore.stage.AsyncStageClient.connect>`,
    :meth:`StagePool.connect <enginecore.stage.StagePool.connect>` (and the asyncio pool's),
    or a pool's ``add_replica(address=..., curve=...)``.

    :meth:`load` reads the files that ``python -m enginecore keygen`` writes. The secret
    key is left out of ``repr()``. :class:`ValueError` for a key that is not Z85 of the
    right length, and for a *public_key* that is not the public key of *secret_key* (keys
    of two pairs: the stage would refuse every connection, and the client could only guess
    that the server key was wrong).
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes

    def __post_init__(self) -> None:
        for name in ("public_key", "secret_key", "server_key"):
            object.__setattr__(self, name, _check_key(getattr(self, name), name))
        try:
            derived = zmq.curve_public(self.secret_key)
        except zmq.ZMQError:  # a libzmq without CURVE: connect() says so
            return
        if derived != self.public_key:
            raise ValueError(
                f"public_key is not the public key of secret_key: they are not one key pair "
                f"(secret_key's public key is {derived.decode()}, public_key is "
                f"{self.public_key.decode()}); give the client's own pair, from its "
                f"NAME.key_secret"
            )

    @classmethod
    def load(
        cls, secret_key_file: str | os.PathLike[str], server_public_file: str | os.PathLike[str]
    ) -> CurveKeys:
        """The client's key pair from *secret_key_file* (``NAME.key_secret``, from
        ``keygen``) and the stage's public key from *server_public_file* (the stage's
        ``NAME.key``). :class:`OSError` if a file is missing, :class:`ValueError` if it
        holds no such key."""
        public, secret = zmq.auth.load_certificate(secret_key_file)
        if secret is None:
            raise ValueError(
                f"{os.fspath(secret_key_file)!r} holds no secret key (give the client's "
                f"NAME.key_secret, not its public NAME.key)"
            )
        server, _ = zmq.auth.load_certificate(server_public_file)
        try:
            return cls(public_key=public, secret_key=secret, server_key=server)
        except ValueError as exc:  # a key of the wrong form: say which files held them
            raise ValueError(
                f"{exc} (read from {os.fspath(secret_key_file)!r} and "
                f"{os.fspath(server_public_file)!r})"
            ) from None


def check_server_pair(public: bytes, secret: bytes, where: str) -> tuple[bytes, bytes]:
    """A stage's key pair, as read from *where* (its ``NAME.key_secret``): both keys Z85 of
    the right length, and *public* the public key of *secret*. :class:`ValueError` else: a
    file whose public key is not its secret key's (edited by hand, or two files pasted
    together) would announce a key that no client can handshake with, and each would wait
    out its connect timeout."""
    public = _check_key(public, f"the public key in {where}")
    secret = _check_key(secret, f"the secret key in {where}")
    try:
        derived = zmq.curve_public(secret)
    except zmq.ZMQError:  # a libzmq without CURVE: the bind says so
        return public, secret
    if derived != public:
        raise ValueError(
            f"{where} is not one key pair: its public key {public.decode()} is not the public "
            f"key of its secret key ({derived.decode()}); make a new pair with keygen"
        )
    return public, secret


@dataclass(frozen=True)
class ServerCurve:
    """A stage's CURVE set-up: its key pair and the client public keys it admits."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    authorized: frozenset[bytes]
    authorized_dir: str


def load_server_curve(
    secret_key_file: str | os.PathLike[str], authorized_dir: str | os.PathLike[str]
) -> ServerCurve:
    """``serve --curve-secret-key FILE --authorized-clients DIR``, read and checked:
    :class:`ValueError` (with what is wrong) for a file without a secret key, a missing
    directory, or one without any client public key (``*.key``); a secret key file that
    others may read is logged as a warning."""
    path = Path(secret_key_file)
    if path.is_dir():
        raise ValueError(
            f"{os.fspath(path)!r} is a directory; give the stage's NAME.key_secret file in it"
        )
    if not path.is_file():
        raise ValueError(f"no such secret key file: {os.fspath(path)!r}")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(
            f"{os.fspath(path)!r} holds no secret key (give the stage's NAME.key_secret)"
        )
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "enginecore: the secret key file %s may be read by others (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    public, secret = check_server_pair(public, secret, repr(os.fspath(path)))
    return ServerCurve(
        public_key=public,
        secret_key=secret,
        authorized=read_authorized(authorized_dir),
        authorized_dir=os.fspath(authorized_dir),
    )


def read_authorized(authorized_dir: str | os.PathLike[str]) -> frozenset[bytes]:
    """The client public keys (``*.key``) in *authorized_dir*: :class:`ValueError` for a
    missing directory, one without any key, or a file that holds no valid key. A client's
    secret key found there (a ``*.key`` that holds one, or a ``*.key_secret``) is logged as
    a warning: the stage needs only public keys, and a secret key belongs on its client's
    host alone."""
    directory = Path(authorized_dir)
    if not directory.is_dir():
        raise ValueError(f"no such directory of authorized client keys: {os.fspath(directory)!r}")
    keys: set[bytes] = set()
    # The files zmq.auth.load_certificates reads (glob's *.key: not hidden files), each
    # read here so that an error names its file.
    for name in sorted(glob.glob("*.key", root_dir=directory)):
        path = directory / name
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot read a client public key from {os.fspath(path)!r}: {exc}"
            ) from exc
        keys.add(_check_key(public, f"the client public key in {os.fspath(path)!r}"))
        if secret:
            _warn_secret_in_authorized(path, "an authorized client's key, holds its secret key too")
    for name in sorted(glob.glob("*.key_secret", root_dir=directory)):
        _warn_secret_in_authorized(
            directory / name, "in the directory of authorized client keys, is a secret key file"
        )
    if not keys:
        raise ValueError(
            f"no client public key (*.key) in {os.fspath(directory)!r}: no client could connect"
        )
    return frozenset(keys)


def _warn_secret_in_authorized(path: Path, what: str) -> None:
    logger.warning(
        "enginecore: %s, %s: the stage needs only a client's "
        "public NAME.key; a secret key should never leave its client's host (delete it "
        "here, and make the client a new key pair if others may have read it)",
        path,
        what,
    )


def secure_server(sock: zmq.Socket[Any], curve: ServerCurve) -> None:
    """Make *sock* a CURVE server, before it binds: its handshakes go to the ZAP handler of
    its context (:func:`start_authenticator`), and fail while none answers, so that no
    moment of a stage's life (its teardown) admits keys that are not listed."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)


def secure_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make *sock* a CURVE client of the stage whose key is ``keys.server_key``, before it
    connects."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key)


class _Authorized:
    """The ZAP handler's check (pyzmq's credentials provider): the key is listed. A refused
    key is logged as a warning, at most every :data:`_DENIED_LOG_S` seconds with a count of
    the others."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys  # replaced whole (one reference, read once per handshake)
        self._lock = threading.Lock()
        self._logged_at = -_DENIED_LOG_S
        self._unlogged = 0
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        now = time.monotonic()
        with self._lock:
            self.denied += 1
            if now - self._logged_at < _DENIED_LOG_S:
                self._unlogged += 1
                return False
            others, self._unlogged, self._logged_at = self._unlogged, 0, now
        logger.warning(
            "enginecore: refused a CURVE client whose public key %s is not authorized%s",
            key.decode("ascii", "replace"),
            f" (and {others} more refusals since the last report)" if others else "",
        )
        return False

    def report_unlogged(self) -> None:
        """Log the refusals not reported yet (at the stop: a burst that ended within
        :data:`_DENIED_LOG_S` of its first line was counted, never told)."""
        with self._lock:
            others, self._unlogged = self._unlogged, 0
        if others:
            logger.warning(
                "enginecore: refused %d more CURVE clients whose key is not authorized since "
                "the last report",
                others,
            )


class Authenticator:
    """The stage's ZAP handler: a thread (pyzmq's :class:`ThreadAuthenticator`) on the
    stage's context that admits only *curve*'s authorized keys, on every CURVE server socket
    of that context. :meth:`stop` before ``Context.term()``."""

    def __init__(self, ctx: zmq.Context[Any], curve: ServerCurve) -> None:
        self.check = _Authorized(curve.authorized)
        self.generation = 0
        """How many times :meth:`authorize` changed the keys."""
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("enginecore.stage.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), self.check)

    @property
    def keys(self) -> frozenset[bytes]:
        """The client public keys admitted now."""
        return self.check.keys

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call *listener()* (on the thread that calls :meth:`authorize`, after the keys
        changed) at every change: the input side's :class:`KeyWatch` wakes up to end the
        sessions of the keys removed."""
        self._listeners.append(listener)

    def authorize(self, keys: Iterable[bytes | str]) -> int:
        """Admit *keys* (client public keys, Z85, ``bytes`` or ``str``) from now on, instead
        of the keys admitted so far: handshakes that begin after this call are checked
        against them, and the listeners (:meth:`on_change`) are told, so that the
        connections already made with a key removed are cut (CURVE itself checks a key
        once, at the handshake). Returns the new :attr:`generation`. Thread-safe.
        :class:`ValueError` / :class:`TypeError` for a key that is not Z85 text of 40
        characters, or a single key instead of a collection, before anything changes (the
        input thread reads the keys as Z85 text: it would fail on them)."""
        if isinstance(keys, (bytes, str, bytearray, memoryview)):
            raise TypeError(
                f"authorize takes a collection of client public keys, not one key: got "
                f"{type(keys).__name__}"
            )
        checked = frozenset(_check_key(key, "an authorized client key") for key in keys)
        with self._lock:
            self.check.keys = checked  # first: whoever sees the generation sees them
            self.generation += 1
            generation = self.generation
        for listener in self._listeners:
            listener()
        return generation

    def stop(self) -> None:
        """End the handler thread and close its socket; log the refusals not reported
        yet."""
        self._auth.stop()
        self.check.report_unlogged()


def start_authenticator(ctx: zmq.Context[Any], curve: ServerCurve) -> Authenticator:
    """Start the ZAP handler on *ctx*, before any CURVE server socket binds."""
    return Authenticator(ctx, curve)


class KeyWatch:
    """The input side's view of which key each peer connected with, on a CURVE stage, so
    that a key removed by :meth:`Authenticator.authorize` also cuts the connections already
    made with it (``docs/security.md``, "Keys").

    libzmq sets the ``User-Id`` property of every frame a CURVE server receives to what the
    ZAP handler returned for the connection: pyzmq's handler returns the client's public
    key (Z85). :meth:`admit` reads it for a peer's first message, and again for
    its first message after any new connection to the input socket (:meth:`connected`:
    a routing id that a peer chose, or one freed by a peer that left, may now name another
    connection); :attr:`allowed` then maps the routing id to the key while it stays
    authorized, so the input side's check per message is one lookup of the routing id
    (``ident in allowed``). A stage without CURVE has no :class:`KeyWatch` and pays
    nothing.

    At each change of the keys the authenticator writes to :attr:`wake_fd` (the input side
    polls it); whichever thread holds the input side then calls :meth:`sweep`, which
    returns the peers whose key (the last one :meth:`admit` read for their routing id) was
    removed, for the session to end their sessions. :meth:`wait_swept` lets
    :meth:`StageRuntime.authorize <enginecore.stage._runtime.StageRuntime.authorize>`
    return only once that is done.

    *monitor*: the input socket's monitor, for ``EVENT_HANDSHAKE_SUCCEEDED`` (the input
    side polls it and calls :meth:`connected`; the input thread closes it). *keep()* names
    the routing ids whose key must stay known when the peers are trimmed (past
    :data:`_KNOWN_MAX`: those with a session, so that a sweep finds them).
    """

    def __init__(
        self,
        auth: Authenticator,
        keep: Callable[[], Iterable[bytes]],
        monitor: zmq.Socket[bytes],
    ) -> None:
        self._auth = auth
        self._keep = keep
        self.monitor = monitor
        self.allowed: dict[bytes, str] = {}
        """Routing id -> the Z85 public key, for the peers whose key :meth:`admit` read
        since the last new connection and found authorized (changed in place only: the
        input side holds a reference)."""
        self._known: dict[bytes, str] = {}  # routing id -> the last key admit() read for it
        self.swept = auth.generation
        """The last generation of keys :meth:`sweep` applied."""
        self.cut = 0
        """How many sessions the sweeps ended, all told (peers of a removed key that had
        one); read under the condition, as :attr:`swept` is."""
        self._cond = threading.Condition()
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        auth.on_change(self._wake)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a sweep is due anyway) or closed
            os.write(self._wake_w, b"k")

    @property
    def stale(self) -> bool:
        """Whether the keys changed since the last :meth:`sweep` (an unlocked read)."""
        return self._auth.generation != self.swept

    def connected(self) -> None:
        """Read the input socket's monitor: after a new connection, every peer's key is
        read again at its next message (:attr:`allowed` is emptied)."""
        new = False
        while True:
            try:
                self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            new = True
        if new:
            self.allowed.clear()

    def admit(self, ident: bytes, frame: Any) -> str | None:
        """A message from *ident*, which is not in :attr:`allowed`: ``None`` if the key it
        connected with (its *frame*'s ``User-Id``) is authorized now (it is then
        remembered), else that key (``""`` if the frame names none)."""
        try:
            key = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):  # no such property: not a CURVE connection
            return ""
        if not isinstance(key, str):
            return ""
        known = self._known
        if len(known) >= _KNOWN_MAX and ident not in known:
            kept = {i: known[i] for i in self._keep() if i in known}
            known.clear()
            known.update(kept)
            self.allowed.clear()
        known[ident] = key
        if key.encode("ascii", "replace") not in self._auth.keys:
            return key
        self.allowed[ident] = key
        return None

    def sweep(self, revoke: Callable[[bytes, str], bool]) -> None:
        """Apply the current keys: ``revoke(routing id, key)`` for each peer whose key was
        removed (forgotten here), which says whether that peer had a session (counted in
        :attr:`cut`); then the generation is :attr:`swept`. Empties the wake-up pipe."""
        with contextlib.suppress(OSError):
            os.read(self.wake_fd, 4096)
        generation = self._auth.generation
        keys = {k.decode("ascii") for k in self._auth.keys}
        known = self._known
        revoked = [(ident, key) for ident, key in known.items() if key not in keys]
        for ident, _ in revoked:
            del known[ident]
            self.allowed.pop(ident, None)
        # Before the generation counts as swept: whoever waits for it (authorize(), the
        # SIGHUP reload's log) sees these sessions ended, and counted.
        cut = sum(1 for ident, key in revoked if revoke(ident, key))
        with self._cond:
            self.cut += cut
            self.swept = generation
            self._cond.notify_all()

    def wait_swept(self, generation: int, timeout: float, alive: Callable[[], bool]) -> int | None:
        """Wait until :meth:`sweep` has applied *generation* (or a later one), at most
        *timeout* seconds, and while *alive()*: :attr:`cut` then, or ``None`` if it has
        not."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.swept < generation:
                left = deadline - time.monotonic()
                if left <= 0 or not alive():
                    return None
                self._cond.wait(min(left, 0.1))
            return self.cut

    def cut_now(self) -> int:
        """:attr:`cut`, read under the condition."""
        with self._cond:
            return self.cut

    def close(self) -> None:
        """Close the wake-up pipe (once nobody polls it)."""
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


# The monitor events a client reads during the handshake.
HANDSHAKE_EVENTS: Final = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_PROTOCOL_ERRORS: Final = {
    int(getattr(zmq, name)): name[len("PROTOCOL_ERROR_") :]
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}


class HandshakeWatch:
    """What the client's DEALER monitor said during the handshake, and the error it means.

    :meth:`feed` each event (a dict from ``zmq.utils.monitor``); :attr:`failure` is then the
    :class:`~._errors.AuthenticationError` to raise at once, if any; :meth:`timed_out` is
    what to raise when no reply came in time."""

    def __init__(self, address: str, keys: CurveKeys | None) -> None:
        self._address = address
        self._keys = keys
        self._silent = 0  # handshakes in a row that the stage ended without a word
        self.connected = False
        self.succeeded = False
        self.failure: AuthenticationError | None = None

    def feed(self, event: Mapping[str, Any]) -> None:
        kind, value = int(event["event"]), int(event["value"])
        if kind == zmq.EVENT_CONNECTED:
            self.connected = True
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded = True
            self._silent = 0
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.failure = self._refused(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.failure = self._protocol(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._silent += 1
            if self._silent >= _SILENT_FAILURES:
                self.failure = self._silent_close()

    def timed_out(self, timeout: float) -> Exception:
        """What a handshake without a reply in *timeout* seconds raises."""
        if self.failure is not None:
            return self.failure
        if self._silent:
            return self._silent_close()
        if self.connected and not self.succeeded and self._keys is not None:
            # No refusal came: the stage did not answer (stopped, overloaded; the kernel
            # completes a TCP connect for a process that never reads it). Not a key error.
            return TimeoutError(
                f"connected to the stage at {self._address}, but the CURVE handshake did not "
                f"complete in {timeout} s: the stage does not answer (a key it refused, or a "
                f"wrong server key, would have been an AuthenticationError)"
            )
        return TimeoutError(f"no handshake reply from the stage at {self._address} in {timeout} s")

    def _refused(self, status: int) -> AuthenticationError:
        if self._keys is None:  # pragma: no cover - a NULL client meets ZAP only on a NULL stage
            return AuthenticationError(
                f"the stage at {self._address} refused this client (ZAP status {status})"
            )
        return AuthenticationError(
            f"the stage at {self._address} refused this client's key (ZAP status {status}): "
            f"its public key {self._keys.public_key.decode()} is not among the stage's "
            f"authorized clients (serve --authorized-clients DIR; a stage placed on Ray: "
            f"authorized_clients= or authorize_clients(), docs/ray.md)"
        )

    def _protocol(self, code: int) -> AuthenticationError:
        name = _PROTOCOL_ERRORS.get(code, hex(code))
        if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self._keys is None:
                why = (
                    "the stage requires CURVE: connect with curve=CurveKeys.load(...) "
                    "(docs/security.md)"
                )
            else:
                why = (
                    "this client uses CURVE but the stage does not (serve was started "
                    "without --curve-secret-key)"
                )
            return AuthenticationError(f"handshake with the stage at {self._address} failed: {why}")
        return AuthenticationError(
            f"the security handshake with the stage at {self._address} failed ({name})"
        )

    def _silent_close(self) -> AuthenticationError:
        if self._keys is None:
            why = (
                "it likely requires CURVE: connect with curve=CurveKeys.load(...) "
                "(docs/security.md)"
            )
        else:
            why = (
                f"the server public key {self._keys.server_key.decode()} is likely wrong (not "
                f"the key of the stage's --curve-secret-key), or the stage does not use CURVE"
            )
        return AuthenticationError(
            f"the stage at {self._address} closed the connection during the handshake: {why}"
        )


def check_key_name(name: str) -> None:
    """:class:`ValueError` unless *name* is a plain file name for :func:`keygen`'s files: not
    empty, no directory in it (the directory is given apart), not hidden (``.``, ``..``)."""
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name.startswith("."):
        raise ValueError(
            f"--name must be a plain file name (DIR says where the files go), got {name!r}"
        )


def _create_new(path: str, data: bytes, mode: int) -> None:
    """Write *data* into a new file at *path*, with *mode* whatever the umask:
    :class:`FileExistsError` if anything is there, a symbolic link too (``O_EXCL``: never
    written through a link someone planted, never a race between a check and the write)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode & 0o600)  # never readable by others, not even briefly
    except FileExistsError:
        raise FileExistsError(f"{path} exists; not overwriting a key") from None
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def _certificate(kind: str, public: bytes, secret: bytes | None = None) -> bytes:
    """A key file in the format of ``zmq.auth`` (czmq's ZPL certificates)."""
    lines = [
        f"#   ****  Generated on {datetime.datetime.now()} by enginecore keygen  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "#   Give it to the other side; check that it arrived unchanged."
        if secret is None
        else "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode("ascii")}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return ("\n".join(lines) + "\n").encode("ascii")


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """Write a new CURVE key pair into *directory* (made, mode 700, if missing):
    ``NAME.key`` (the public key, to share, mode 644) and ``NAME.key_secret`` (both keys,
    mode 600, to keep), whatever the umask. :class:`FileExistsError` rather than overwrite
    a key or write through a symbolic link found at either path. Returns the two paths."""
    check_key_name(name)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{os.fspath(directory)} exists and is not a directory")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public = os.path.join(directory, f"{name}.key")
    secret = os.path.join(directory, f"{name}.key_secret")
    for path in (public, secret):
        if os.path.lexists(path):  # a dangling link too: it is not ours to write through
            raise FileExistsError(f"{path} exists; not overwriting a key")
    public_key, secret_key = zmq.curve_keypair()
    _create_new(secret, _certificate("**Secret**", public_key, secret_key), 0o600)
    try:
        _create_new(public, _certificate("Public", public_key), 0o644)
    except BaseException:
        with contextlib.suppress(OSError):  # a key pair is written whole or not at all
            os.unlink(secret)
        raise
    return public, secret
