"""What a stage address may look like: ``ipc://PATH`` or ``tcp://HOST:PORT``, checked before
libzmq sees it.

libzmq's own checks are not enough to give a user a clear error: it raises a bare
``zmq.ZMQError: Invalid argument`` for ``"nonsense"``, takes a port past 65535 modulo 65536
(``tcp://127.0.0.1:99999`` connects to port 34463, and then only times out), and reads
``tcp://::1:5570`` as an interface name. One checker serves ``serve --bind`` and ``top``
(as usage errors) and every ``connect()`` and :class:`~enginecore.stage.StageObserver`
(as :class:`ValueError`).
"""

from __future__ import annotations

__all__ = ["check_address"]


def check_address(address: str, *, bind: bool) -> str | None:
    """Check *address*, one to *bind* (a port may be ``*`` or 0: any free one) or to connect
    to (a port from 1 to 65535): ``ipc://PATH`` or ``tcp://HOST:PORT``, an IPv6 HOST in
    brackets. Return HOST (brackets stripped), ``None`` for ipc; :class:`ValueError` that
    says what is wrong otherwise."""
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ValueError(f"empty ipc path in {address!r}")
        return None
    if not address.startswith("tcp://"):
        raise ValueError(f"address must start with tcp:// or ipc://, got {address!r}")
    rest = address[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    numeric = port.isascii() and port.isdigit()
    if not sep or not host or not (port == "*" or numeric):
        raise ValueError(f"tcp address must look like tcp://HOST:PORT, got {address!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    if ":" in host and not bracketed:
        raise ValueError(
            f"an IPv6 address goes in brackets: tcp://[{host}]:{port}, got {address!r}"
        )
    lowest = 0 if bind else 1
    if not (numeric and lowest <= int(port) <= 65535) and not (bind and port == "*"):
        ports = "0 to 65535 or *" if bind else "1 to 65535"
        raise ValueError(f"a port is {ports}, got {address!r}")
    if not bind and host == "*":
        raise ValueError(f"'*' binds every interface; connect to a host, got {address!r}")
    return host[1:-1] if bracketed else host
