"""``python -m enginecore serve``: run a headless stage process; ``python -m enginecore
top``: watch running stages; ``python -m enginecore keygen``: make a CURVE key pair.

Usage::

    python -m enginecore serve --engine pkg.module:factory --bind tcp://127.0.0.1:5570
    python -m enginecore serve --engine pkg.module:factory --bind tcp://0.0.0.0:5570 \
        --curve-secret-key keys/stage.key_secret --authorized-clients clients/
    python -m enginecore top tcp://127.0.0.1:5570 [ADDRESS...] [--interval 1] [--once] \
        [--curve-secret-key keys/top.key_secret --curve-server-key keys/stage.key]
    python -m enginecore keygen DIR [--name NAME]

The stage binds its input socket at ``--bind`` and its output socket at ``--output-bind``
(default: a free port on the same host, or ``<path>.out`` for ``ipc://``), prints one line
``enginecore serve: listening on <address> ...`` to stdout (its first line: what the
engine factory prints goes to stderr), and serves one client at a time
(``StageClient.connect(address)``; up to N with ``--max-clients N``) until SIGTERM / SIGINT
or a client's ``shutdown()``.
With ``--curve-secret-key`` and ``--authorized-clients``, both sockets are ZeroMQ CURVE
servers (encrypted) and only the listed client keys get in (``docs/security.md``); SIGHUP
reads the directory again: new connections are checked against its keys, and clients
connected with a key removed lose their sessions. TCP binds
to a non-loopback address only with CURVE, or with ``--insecure`` (no authentication, no
encryption). Exit code: 0 after a clean shutdown, 1 after a fatal error or a failed
start, 2 for bad arguments (nothing started), 4 after a failed IO thread.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import math
import os
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

# enginecore.stage._watchdog.STEP_TIMEOUT, without importing the stage (it needs pyzmq) to
# build the parser; a test checks the two agree.
_STEP_TIMEOUT = 60.0

# enginecore.stage._wire.MIN_MESSAGE_BYTES, for the same reason; a test checks it too.
_MIN_MESSAGE_BYTES = 1024

_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m enginecore",
        description=(
            "Run a headless stage process (serve), watch running stages (top), or make a "
            "CURVE key pair (keygen)."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run a headless stage process",
        description="Run a stage process on its own; attach with StageClient.connect(address).",
    )
    serve.add_argument(
        "--engine",
        required=True,
        type=_factory_spec,
        metavar="MODULE:FACTORY",
        help="engine factory: a dotted module path, a colon, and the factory's name in it "
        "(dotted for an attribute of an attribute), e.g. pkg.module:make_engine",
    )
    serve.add_argument(
        "--kwargs", default="{}", metavar="JSON", help="factory keyword arguments, a JSON object"
    )
    serve.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5570",
        metavar="ADDRESS",
        help="input address, tcp://HOST:PORT (PORT may be *) or ipc://PATH (default: %(default)s)",
    )
    serve.add_argument(
        "--output-bind",
        metavar="ADDRESS",
        help="output address (default: same host, any free port; ipc: PATH.out)",
    )
    serve.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="the stage's CURVE key pair (NAME.key_secret from 'python -m enginecore keygen'): "
        "both sockets are encrypted and authenticated; needs --authorized-clients",
    )
    serve.add_argument(
        "--authorized-clients",
        metavar="DIR",
        help="a directory of client public keys (*.key): only these clients get in (read at "
        "start, and again on SIGHUP: new connections are checked against the keys then listed, "
        "and clients connected with a removed key lose their sessions)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding TCP to a non-loopback address without CURVE: anyone who reaches "
        "the port can drive the engine, and the traffic is plain text",
    )
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="deprecated alias of --insecure (says so on stderr)",
    )
    serve.add_argument(
        "--session-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="a new client may take over once the attached one has been silent this long "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, refuse new requests and let the live ones finish for at most "
        "this long, then abort the rest and stop (a second signal stops at once); default: "
        "stop at once",
    )
    serve.add_argument(
        "--step-timeout",
        type=float,
        default=_STEP_TIMEOUT,
        metavar="SECONDS",
        help="a step that runs longer is reported once: every thread's stack on stderr, and "
        "the client's health() reads 'stalled' until it returns; 0 turns the watchdog off "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--kill-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a step that runs this long is fatal: the stage sends a fatal event and exits 1 "
        "(default: never)",
    )
    serve.add_argument(
        "--keep-requests-on-detach",
        action="store_true",
        help="keep a client's requests running after it detaches (close(), or its session "
        "was taken over); by default they are aborted. Needs --max-clients 1",
    )
    serve.add_argument(
        "--max-clients",
        type=int,
        default=1,
        metavar="N",
        help="serve up to N clients at once (several pools sharing the stage), each with an "
        "output socket of its own; a client that leaves has only its own requests aborted, "
        "and one silent past --session-timeout, whose output connection is lost, or that "
        "falls --client-buffer events behind is detached (default: %(default)s: one "
        "client at a time, the next may take over a silent one)",
    )
    serve.add_argument(
        "--client-buffer",
        type=int,
        default=None,
        metavar="N",
        help="with --max-clients above 1 (a usage error otherwise): a client with more than "
        "N events (one per output) queued for it is detached (its requests aborted, its "
        "queue dropped) instead of holding the engine back for every client (default: "
        "65536)",
    )
    serve.add_argument(
        "--max-message-bytes",
        type=_message_bytes,
        default=None,
        metavar="N",
        help="the largest frame (message part) the input socket takes, in bytes, at least "
        f"{_MIN_MESSAGE_BYTES}: a peer that sends a bigger one is disconnected before the "
        "stage holds it, keyed or not; the stage tells its clients the bound, and the "
        "Python clients refuse a bigger request or call before sending it (default: "
        "unbounded; docs/security.md)",
    )
    serve.add_argument(
        "--log-level",
        type=_log_level,
        default=None,
        metavar="LEVEL",
        help="level of the stage's root logger: DEBUG, INFO, WARNING, ERROR, CRITICAL or a "
        "number (default: WARNING, unless the engine sets one)",
    )
    serve.add_argument(
        "--name",
        default=None,
        metavar="NAME",
        help="the stage's name in its log records (default: the engine factory)",
    )
    serve.add_argument(
        "--load-interval",
        type=_load_interval,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="while the stage steps, attach a load report to its outputs at most this often; "
        "0: never (default: 0.05, and 0.005 with --max-clients above 1, where the clients' "
        "pools route on each other's requests through these reports only)",
    )
    serve.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics over HTTP at http://HOST:PORT/metrics, from a thread "
        "that never waits for the loop (0: a free port); needs enginecore[prometheus] "
        "(default: no endpoint)",
    )
    serve.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address the metrics endpoint binds (default: %(default)s)",
    )
    serve.add_argument(
        "--detached-buffer",
        type=_non_negative_int,
        default=1024,
        metavar="N",
        help="while no client can read, queue at most N events (one per output), drop and "
        "count the rest (default: %(default)s)",
    )
    top = sub.add_parser(
        "top",
        help="a live view of running stages",
        description="A live terminal view of stages: steps/s, outputs/s, running requests, "
        "queue depth, step time p50 and p99, health. Reads each stage as an observer, beside "
        "the client that uses it. Needs the top extra: pip install 'enginecore[top]'. "
        "q, Ctrl-C or SIGTERM quits (exit code 0).",
    )
    top.add_argument(
        "addresses",
        nargs="+",
        metavar="ADDRESS",
        help="a stage's input address, as given to serve --bind (tcp://HOST:PORT, ipc://PATH)",
    )
    top.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between two refreshes (default: %(default)s)",
    )
    top.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="for stages served with CURVE: top's own key pair, a NAME.key_secret made by "
        "keygen whose NAME.key is in the stages' --authorized-clients (docs/security.md)",
    )
    top.add_argument(
        "--curve-server-key",
        metavar="FILE",
        action="append",
        help="the public key (NAME.key) of the stage's --curve-secret-key; once for every "
        "ADDRESS, or once per ADDRESS, in order",
    )
    top.add_argument(
        "--once",
        action="store_true",
        help="print one table and exit (two readings --interval apart, for the rates); exit "
        "code 1 if a stage did not answer",
    )
    keygen = sub.add_parser(
        "keygen",
        help="make a CURVE key pair",
        description="Write a new CURVE key pair: DIR/NAME.key (the public key: give it to the "
        "other side) and DIR/NAME.key_secret (both keys, mode 600: keep it). A stage takes its "
        "NAME.key_secret as serve --curve-secret-key and the clients' NAME.key files in "
        "--authorized-clients; a client loads CurveKeys.load(its NAME.key_secret, the stage's "
        "NAME.key). Never overwrites a key.",
    )
    keygen.add_argument("directory", metavar="DIR", help="where to write (made if missing)")
    keygen.add_argument(
        "--name",
        default="enginecore",
        help="the files' base name, a plain file name: DIR says where (default: %(default)s)",
    )
    # A usage error found after parsing shows the usage of its own command.
    for command in (serve, top, keygen):
        command.set_defaults(command_parser=command)
    return parser


def _factory_spec(text: str) -> str:
    """``--engine``: ``pkg.module:factory``, each dotted part an identifier (a usage error
    otherwise, before anything is imported; a module or name that does not resolve is the
    factory's failure, exit 1)."""
    from .stage._launch import _validate_factory

    try:
        _validate_factory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("engine factory ")) from None
    return text


def _load_interval(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:  # argparse would name this function: "invalid _load_interval value"
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds >= 0, got {text!r}"
        ) from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value or None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:  # argparse would name this function: "invalid _positive_float value"
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return _never_past_timeout_max(value)


def _never_past_timeout_max(seconds: float) -> float:
    """*seconds*, at most ``threading.TIMEOUT_MAX`` (292 years): a thread's wait, a ZMQ poll
    or a sleep of longer raises ``OverflowError``; this long means "never" either way."""
    return min(seconds, threading.TIMEOUT_MAX)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse would name this function: "invalid _non_negative_int value"
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _message_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse would name this function: "invalid _message_bytes value"
        value = None
    if value is None or value < _MIN_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be an int >= {_MIN_MESSAGE_BYTES} (bytes), got {text!r}"
        )
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a port number, 0 to 65535, got {text!r}"
        ) from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535, got {value}")
    return value


def _log_level(text: str) -> int | str:
    # Checked here, without importing the stage (it needs pyzmq); the same names as
    # enginecore.stage._logs.check_log_level, which serve() applies.
    if text.strip().isdigit():
        return int(text)
    if not isinstance(logging.getLevelName(text.strip().upper()), int):
        raise argparse.ArgumentTypeError(
            f"must be DEBUG, INFO, WARNING, ERROR, CRITICAL or a number, got {text!r}"
        )
    return text


def _check_address(parser: argparse.ArgumentParser, address: str, allow_remote: bool) -> bool:
    """Exit with a usage error for a bad address, or a non-loopback one unless
    *allow_remote*; return whether *address* is remote (not loopback, not ipc)."""
    host = _check_syntax(parser, address, bind=True)
    if host is None:
        return False
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in _LOOPBACK_NAMES  # host names are case-insensitive
    if not loopback and not allow_remote:
        parser.error(
            f"refusing to bind {address!r}: not a loopback address, and without CURVE anyone "
            f"who reaches it could drive the engine; give --curve-secret-key FILE and "
            f"--authorized-clients DIR (docs/security.md), or --insecure to do it anyway"
        )
    return not loopback


def _check_syntax(parser: argparse.ArgumentParser, address: str, *, bind: bool) -> str | None:
    """Exit with a usage error unless *address* is ``ipc://PATH`` or ``tcp://HOST:PORT``
    (PORT ``*`` or 0 to bind, 1 to 65535 to connect; an IPv6 HOST in brackets): the check
    every ``connect()`` makes too (:func:`~enginecore.stage._address.check_address`).
    Return HOST (brackets stripped), ``None`` for ipc."""
    from .stage._address import check_address

    try:
        return check_address(address, bind=bind)
    except ValueError as exc:
        parser.error(str(exc))


_WILDCARDS = frozenset({"*", "0.0.0.0", "::"})


def _same_endpoint(a: str, b: str) -> bool:
    """Whether binding *a* and *b* (both checked by :func:`_check_syntax`) would take the
    same endpoint, however spelled: one ipc path (``/tmp/./s``), or one TCP port on the same
    host (``localhost`` and ``127.0.0.1``, a host and the wildcard). Port ``*`` or 0 never
    clashes. Names other than the loopback ones are compared as text (no DNS lookup)."""
    if a.startswith("ipc://") and b.startswith("ipc://"):
        return os.path.realpath(a[len("ipc://") :]) == os.path.realpath(b[len("ipc://") :])
    if not (a.startswith("tcp://") and b.startswith("tcp://")):
        return False
    host_a, _, port_a = a[len("tcp://") :].rpartition(":")
    host_b, _, port_b = b[len("tcp://") :].rpartition(":")
    if port_a in ("*", "0") or port_b in ("*", "0") or int(port_a) != int(port_b):
        return False
    ip_a, ip_b = _bind_host(host_a), _bind_host(host_b)
    if ip_a == ip_b:
        return True
    if ip_a in _WILDCARDS or ip_b in _WILDCARDS:  # the wildcard of the other's family
        return (":" in ip_a) == (":" in ip_b) or "*" in (ip_a, ip_b)
    return False


def _bind_host(host: str) -> str:
    """*host* (brackets stripped) as libzmq binds it: the loopback names (libzmq resolves
    ``localhost`` to IPv4) as addresses, IP addresses in their canonical form."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return "127.0.0.1"
    if host == "ip6-localhost":
        return "::1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _working_directory_on_path() -> None:
    """Put the working directory first on ``sys.path`` unless it is there, so that
    ``--engine mymodel:make`` imports ``mymodel.py`` beside the user from the ``enginecore``
    script (whose own directory is ``sys.path[0]``) as it does from ``python -m
    enginecore`` (which puts the working directory there)."""
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def _default_output(bind: str) -> str:
    if bind.startswith("ipc://"):
        return bind + ".out"
    host = bind[len("tcp://") :].rpartition(":")[0]
    return f"tcp://{host}:*"


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        from .stage import PROTOCOL_VERSION, check_encodable
        from .stage._fanout import CLIENT_BUFFER
        from .stage._logs import check_log_level
        from .stage._process import MetricsBindError, NotAnEngineError, serve
        from .stage._runtime import StageBindError, check_client_paths
        from .stage._statistics import LOAD_INTERVAL, SHARED_LOAD_INTERVAL
        from .stage._watchdog import check_watchdog

        if args.metrics_port is not None:
            from .stage import prometheus  # noqa: F401
    except ImportError as exc:
        print(f"python -m enginecore serve: {exc}", file=sys.stderr)
        return 2
    if args.name is not None and not args.name.strip():
        # The log records would fall back to the factory, the statistics (top, the metrics'
        # stage label) would carry the empty name.
        parser.error("--name must not be empty (leave it out for the engine factory)")
    if args.metrics_port is not None and not args.metrics_host.strip():
        parser.error("--metrics-host must not be empty")
    try:
        kwargs: Any = json.loads(args.kwargs)
    except json.JSONDecodeError as exc:
        parser.error(f"--kwargs is not valid JSON: {exc}")
    if not isinstance(kwargs, dict):
        parser.error("--kwargs must be a JSON object")
    if (args.curve_secret_key is None) != (args.authorized_clients is None):
        parser.error("--curve-secret-key and --authorized-clients go together")
    curve = None
    if args.curve_secret_key is not None:
        from .stage._curve import load_server_curve

        try:
            curve = load_server_curve(args.curve_secret_key, args.authorized_clients)
        except (OSError, ValueError) as exc:
            parser.error(f"CURVE: {exc}")
    if args.allow_remote:
        print(
            "enginecore serve: --allow-remote is deprecated: use --insecure (the same)",
            file=sys.stderr,
            flush=True,
        )
        args.insecure = True
    remote_ok = curve is not None or args.insecure
    remote = _check_address(parser, args.bind, remote_ok)
    output = args.output_bind or _default_output(args.bind)
    if _same_endpoint(output, args.bind):
        # tcp: the second bind fails once the engine is built; ipc: the output socket
        # takes the path over, and no client reaches the input socket.
        parser.error(f"--output-bind must differ from --bind, got {output!r} for both")
    remote = _check_address(parser, output, remote_ok) or remote
    if args.metrics_port:  # 0: a free port
        host = args.metrics_host.strip().strip("[]")
        metrics = (
            f"tcp://[{host}]:{args.metrics_port}"
            if ":" in host
            else f"tcp://{host}:{args.metrics_port}"
        )
        for option, address in (("--bind", args.bind), ("--output-bind", output)):
            if _same_endpoint(metrics, address):
                # The endpoint is bound first: the stage's bind failed once the engine was built.
                parser.error(
                    f"--metrics-port {args.metrics_port} is the port of {option} {address!r}"
                )
    if remote and curve is None:
        print(
            "enginecore serve: WARNING: --insecure: listening beyond loopback without CURVE; "
            "anyone who reaches the ports can drive the engine, and the traffic is plain text",
            file=sys.stderr,
            flush=True,
        )
    try:
        check_encodable(kwargs, "--kwargs")
    except TypeError as exc:  # valid JSON past the codec: an int past 64 bits, too deep
        parser.error(str(exc))
    step_timeout = args.step_timeout or None  # 0: no watchdog
    try:
        check_watchdog(step_timeout, args.kill_after)
    except ValueError as exc:
        parser.error(
            str(exc).replace("step_timeout", "--step-timeout").replace("kill_after", "--kill-after")
        )
    if args.max_clients < 1:
        parser.error(f"--max-clients must be >= 1, got {args.max_clients}")
    if args.max_clients > 1 and args.keep_requests_on_detach:
        parser.error("--keep-requests-on-detach needs --max-clients 1")
    if args.client_buffer is not None and args.client_buffer < 1:
        parser.error(f"--client-buffer must be >= 1, got {args.client_buffer}")
    if args.client_buffer is not None and args.max_clients == 1:
        # It would do nothing: a one-client stage has no client to detach for falling behind.
        parser.error("--client-buffer needs --max-clients above 1")
    try:
        check_client_paths(output, args.max_clients)
    except ValueError as exc:
        parser.error(f"--max-clients {args.max_clients}: {exc}")
    if args.drain_timeout is not None and not 0 <= args.drain_timeout < math.inf:
        parser.error(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    drain_timeout = (
        None if args.drain_timeout is None else _never_past_timeout_max(args.drain_timeout)
    )
    if step_timeout is not None:
        step_timeout = _never_past_timeout_max(step_timeout)
    kill_after = None if args.kill_after is None else _never_past_timeout_max(args.kill_after)

    _working_directory_on_path()
    metrics_url: list[str] = []

    def ready(input_address: str, output_address: str) -> None:
        metrics = f", metrics {metrics_url[0]}" if metrics_url else ""
        secured = f", curve {curve.public_key.decode()}" if curve is not None else ""
        print(
            f"enginecore serve: listening on {input_address} "
            f"(output {output_address}, engine {args.engine}, protocol {PROTOCOL_VERSION}"
            f"{secured}{metrics})",
            flush=True,
        )

    def metrics_ready(url: str) -> None:
        # Bound before the engine is built (which may take long): say so at once, on stderr
        # (stdout's first line stays the ready line).
        metrics_url.append(url)
        print(f"enginecore serve: metrics on {url}", file=sys.stderr, flush=True)

    try:
        return serve(
            args.engine,
            kwargs,
            args.bind,
            output,
            session_timeout=args.session_timeout,
            detached_buffer=args.detached_buffer,
            keep_requests_on_detach=args.keep_requests_on_detach,
            max_clients=args.max_clients,
            client_buffer=CLIENT_BUFFER if args.client_buffer is None else args.client_buffer,
            max_message_bytes=args.max_message_bytes,
            drain_timeout=drain_timeout,
            step_timeout=step_timeout,
            kill_after=kill_after,
            name=args.name,
            log_level=check_log_level(args.log_level, "--log-level"),
            load_interval=getattr(
                args,
                "load_interval",
                SHARED_LOAD_INTERVAL if args.max_clients > 1 else LOAD_INTERVAL,
            ),
            metrics=None
            if args.metrics_port is None
            else (args.metrics_host.strip().strip("[]"), args.metrics_port),
            ready=ready,
            metrics_ready=metrics_ready,
            curve=curve,
        )
    except MetricsBindError as exc:
        print(f"python -m enginecore serve: --metrics-port: {exc}", file=sys.stderr)
        return 2
    except (StageBindError, NotAnEngineError) as exc:
        print(f"python -m enginecore serve: the stage failed to start: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        print(
            "python -m enginecore serve: stdout was closed before the ready line could be "
            "printed; stopped",
            file=sys.stderr,
        )
        return 1
    except Exception:
        print("python -m enginecore serve: the stage failed to start:", file=sys.stderr)
        traceback.print_exc()
        return 1


def _top_curve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Any] | None:
    """``top``'s CURVE keys, one per address (``None``: without CURVE), read and checked
    before anything connects: a usage error (exit code 2) for a missing or wrong file."""
    secret, servers = args.curve_secret_key, args.curve_server_key
    if secret is None and not servers:
        return None
    if secret is None or not servers:
        parser.error("--curve-secret-key and --curve-server-key go together")
    if len(servers) not in (1, len(args.addresses)):
        parser.error(
            f"--curve-server-key: give it once, or once per ADDRESS ({len(args.addresses)}), "
            f"not {len(servers)} times"
        )
    try:
        from .stage._curve import CurveKeys
    except ImportError as exc:  # pyzmq is missing: top cannot run either
        parser.error(str(exc))
    keys = []
    for server in servers:
        try:
            keys.append(CurveKeys.load(secret, server))
        except (OSError, ValueError) as exc:
            parser.error(f"--curve-secret-key / --curve-server-key: {exc}")
    return keys * len(args.addresses) if len(keys) == 1 else keys


def _keygen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        from .stage._curve import check_key_name, keygen
    except ImportError as exc:
        print(f"python -m enginecore keygen: {exc}", file=sys.stderr)
        return 2
    try:
        check_key_name(args.name)
    except ValueError as exc:  # a path, not a name: a usage error, before anything is made
        parser.error(str(exc))
    try:
        public, secret = keygen(args.directory, args.name)
    except (OSError, ValueError) as exc:
        print(f"python -m enginecore keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it; mode 600)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m enginecore`` (and of the ``enginecore`` script); returns
    the exit code. A Ctrl-C that lands outside a command's own handling (while ``serve``
    imports its modules, before its signal handlers are in) ends it with one line and the
    shell's code for SIGINT, 130, instead of a traceback. A stdout closed before the output
    was written (``top --once | head -1``, ``keygen DIR >&-``) is one line and exit 1."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("python -m enginecore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python would try to flush stdout again at exit, and print another error.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(
            "python -m enginecore: stdout was closed before the output was written", file=sys.stderr
        )
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command_parser: argparse.ArgumentParser = args.command_parser
    if args.command == "serve":
        return _serve(command_parser, args)
    if args.command == "top":
        from ._top import main as top

        for address in args.addresses:
            _check_syntax(command_parser, address, bind=False)
        curve = _top_curve(command_parser, args)
        return top(args.addresses, interval=args.interval, once=args.once, curve=curve)
    if args.command == "keygen":
        return _keygen(command_parser, args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse checks


if __name__ == "__main__":
    sys.exit(main())
