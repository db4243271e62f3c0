"""Stages placed on Ray (``pip install 'enginecore[ray]'``; ``docs/ray.md``).

A stage placed on Ray runs its engine loop in a Ray actor's own process: the actor builds
the engine and a :class:`~._runtime.StageRuntime` (the same code a launched or a headless
stage runs), binds both sockets on its node's IP (``ray.util.get_node_ip_address()``), runs
the loop on a thread of its own and answers :meth:`._ray_actor._StageActor.start` once the
stage is ready, with the addresses it bound. The actor's class lives in ``_ray_actor``, so
that its process imports only what a stage runs. ZMQ over TCP stays the data plane
(requests, outputs and utility calls travel as msgpack, never pickled); Ray's actor calls
carry only the control: start, the addresses and public keys, stop, a key rotation
(:func:`authorize_clients`: public keys, as a list of ``str``), and the wait that tells the
actor's end.

Between the client and the actor the sockets use CURVE by default: the client makes a key
pair for the stage, the actor makes the stage's key pair and admits only the client's
public key (its ZAP handler), and the stage's public key comes back from the actor. With
your own keys, the client's pair is yours (``curve=``), the actor reads the stage's from a
file on its node (``stage_secret_key=``) and admits more public keys
(``authorized_clients=``). Secret keys never travel. ``insecure=True`` opts out.

With ``forward_logs``, the actor first binds a log socket on its node
(:meth:`._ray_actor._StageActor.open_logs`), the client connects to it, and the engine is
built once it has: the stage's records reach the client's ``logging``
(``_logs.forward_from``).

The client watches the actor as it watches a launched process: a thread blocks on a pending
``actor.wait.remote()``, which returns the stage's exit code when its loop ends, or raises
when the actor dies (``ray.kill``, a crash, its node lost); either way it makes the
client's *sentinel* (a pipe) readable, and the client's death path runs, so a dead actor is
:class:`~enginecore.stage.EngineDeadError` (a pool's
:class:`~enginecore.stage.ReplicaDeadError`) within a second. Heartbeats over ZMQ still
run: a stage that Ray believes alive but that does not answer (a network partition) is
presumed dead after ``heartbeat_timeout``.

Ray is imported only when a stage is placed on it: importing this module does not import
Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing.connection
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from . import _clientbase, _codec, _logs, _wire
from ._clientbase import Target
from ._curve import CurveKeys, _check_key
from ._errors import EngineDeadError, StageClosedError, StageStartupError, positive_seconds
from ._launch import _validate_factory, factory_kwargs
from ._ray_actor import CONNECT_TIMEOUT, _StageActor
from ._statistics import LOAD_INTERVAL, check_load_interval
from ._watchdog import STEP_TIMEOUT, check_watchdog

if TYPE_CHECKING:
    from ._client import StageClient

__all__ = [
    "RayPlacement",
    "RayStage",
    "authorize_clients",
    "authorize_clients_async",
    "launch_on_ray",
]

logger = logging.getLogger("enginecore.stage")

# Concurrent calls an actor takes: start, wait (blocks for the stage's life), stop.
_ACTOR_CONCURRENCY: Final = 4
# How long a key rotation may take, by default (the actor's answer, for every stage).
_AUTHORIZE_TIMEOUT: Final = 30.0
# How long the handshake with a started actor's stage may take: a peer that cannot be
# reached (a firewall between hosts, a wrong node IP) fails within this, not after minutes.
_MAX_CONNECT_TIMEOUT: Final = 30.0
# How often a client's watch of its actor looks whether Ray is still initialized: a
# ``ray.shutdown()`` in this process ends every actor it owns but completes no pending
# ``ray.get``, so only a look tells the client that its stage went with it.
_WATCH_POLL: Final = 0.25
# How often a start on Ray looks whether it was cancelled (a pool's close) or Ray was shut
# down in this process while it waits for the actor's answer.
_PLACE_POLL: Final = 0.1


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
        raise ImportError("placing stages on Ray needs Ray: pip install 'enginecore[ray]'") from exc
    return ray


# The finest fraction of a resource Ray takes (its RESOURCE_UNIT_SCALING, 10000 in Ray 2.60):
# a smaller amount other than 0 is Ray's ValueError at the actor's creation.
_RESOURCE_UNIT: Final = 0.0001


def _check_amount(value: object, what: str) -> None:
    """A resource amount of a :class:`RayPlacement`: a finite number >= 0, and 0 or at
    least :data:`_RESOURCE_UNIT` (:class:`TypeError` for a non-number, a ``bool`` too;
    :class:`ValueError` else)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number >= 0, got {value!r}")
    if not 0 <= value < math.inf:
        raise ValueError(f"{what} must be a number >= 0, got {value!r}")
    if 0 < value < _RESOURCE_UNIT:
        raise ValueError(f"{what} must be 0 or at least {_RESOURCE_UNIT}, got {value!r}")


_SHUT_DOWN: Final = "Ray was shut down in this process (ray.shutdown()); its actor went with it"
# Set once a stage of this process saw Ray shut down under it: from then on a start (a
# pool's or a pipeline's restart, a new launch) never lets Ray start a cluster of its own
# (ray.init()'s default) while Ray is not initialized again. Cleared when a new Ray
# session is up (_new_session): a later clean ray.shutdown() is Ray's default again.
_shut_down_under_stages = False
_hooked = False
# The Ray sessions of this process that enginecore has seen, counted (_new_session): a
# stage keeps the one it was placed in (RayStage.session), so that a stage of an ended
# session neither takes a later session's ray.shutdown() for one under it nor calls Ray
# in a later session. _session_node: the last one's node, weakly (Ray makes one a session).
_sessions = 0
_session_node: weakref.ref[Any] | None = None
_session_lock = threading.Lock()  # Ray runs its hook outside its own lock


def _shut_down(session: int | None = None) -> None:
    """A stage of this process saw Ray shut down under it: refuse placements until a new
    Ray session is up. Set only while Ray is still not initialized, looked at under Ray's
    :func:`_shutdown_lock` (which ``ray.init()`` holds): a watch that saw the shutdown but
    sets the flag only after a new ``ray.init()`` would keep the refusal for good. Nor
    where *session* (the stage's, :data:`_sessions`; ``None``: the last one) is not the
    last session seen: the stage's session ended before a later one began, and the
    shutdown seen now is that later session's, with none of its stages under it."""
    global _shut_down_under_stages
    ray = _import_ray()
    with _shutdown_lock(ray):
        if ray.is_initialized() or (session is not None and session != _sessions):
            return
        _shut_down_under_stages = True
        _hook(ray)


def _hook(ray: Any) -> None:
    """Have Ray call :func:`_new_session` after each ``ray.init()``, once (its
    ``ray._private.worker._post_init_hooks``, a private name of Ray's, Ray 2.60; where it
    is missing, a new session is seen at enginecore's next call to Ray instead:
    :func:`_calling_ray`)."""
    global _hooked
    if _hooked:
        return
    hooks = getattr(
        getattr(getattr(ray, "_private", None), "worker", None), "_post_init_hooks", None
    )
    if isinstance(hooks, list):
        hooks.append(_new_session)
        _hooked = True


def _new_session() -> None:
    """Ray is initialized (a ``ray.init()`` hook of Ray's, or seen by
    :func:`_calling_ray`): placements are no longer refused, and a session whose node is
    not the last one seen is counted (:data:`_sessions`)."""
    global _shut_down_under_stages, _sessions, _session_node
    _shut_down_under_stages = False
    ray = _import_ray()
    # Ray's node of this session (ray._private.worker.global_worker.node, private, Ray
    # 2.60: a new one at each ray.init()); where it is missing, sessions are not told apart.
    worker = getattr(getattr(getattr(ray, "_private", None), "worker", None), "global_worker", None)
    node = getattr(worker, "node", None)
    with _session_lock:
        _hook(ray)
        if node is None or (_session_node is not None and node is _session_node()):
            return
        with contextlib.suppress(TypeError):  # no weak reference to it: not told apart
            _session_node = weakref.ref(node)
            _sessions += 1


def _shutdown_lock(ray: Any) -> contextlib.AbstractContextManager[Any]:
    """The lock that ``ray.init()`` (its connect) and ``ray.shutdown()`` hold in Ray 2.60:
    ``ray._private.worker._connect_or_shutdown_lock``, an ``RLock``. It is private: where a
    Ray version lacks it, no lock stands in (a ``nullcontext``), and :func:`_calling_ray`
    falls back to a look that a ``ray.shutdown()`` in another thread can still race with
    (Ray's auto-init may then start a local cluster: the race docs/ray.md named before)."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    lock = getattr(worker, "_connect_or_shutdown_lock", None)
    if lock is None or not callable(getattr(lock, "__enter__", None)):
        return contextlib.nullcontext()
    return lock  # type: ignore[no-any-return]


@contextlib.contextmanager
def _calling_ray(
    ray: Any,
    gone: Callable[[], BaseException],
    *,
    placement: bool = False,
    session: int | None = None,
) -> Iterator[None]:
    """Around every call enginecore makes to Ray (an actor's creation, an actor call's
    ``.remote()``, ``ref.future()``, ``ray.kill``): raise ``gone()`` without a call if Ray
    is not initialized in this process, and hold Ray's own :func:`_shutdown_lock` from that
    look to the call's end. Ray's calls are wrapped by its auto-init (``ray.kill``, actor
    creation and actor calls run ``ray.init()`` first when Ray is not initialized): a
    ``ray.shutdown()`` in another thread between a bare look and the call started a new
    local cluster, and one during the call met a Ray half torn down (its own errors). With
    the lock, a shutdown comes wholly before the look or wholly after the call, so the call
    never starts a cluster. Keep the calls inside short: a ``ray.shutdown()`` waits for
    them (enginecore waits for Ray's answers outside, as futures).

    *placement*: the creation of a stage's actor, which lets Ray's default
    (``ray.init()``'s) start or find a cluster where this process never saw Ray shut down
    under its stages (docs/ray.md).

    *session*: a call for a stage placed in that session (:attr:`RayStage.session`): once
    a later session was seen, ``gone()`` too (its actor went with its session), and the
    refusal is not set (:func:`_shut_down`)."""
    with _shutdown_lock(ray):
        if ray.is_initialized():
            _new_session()
            if session is not None and session != _sessions:
                raise gone()
        elif not (placement and not _shut_down_under_stages):
            _shut_down(session)
            raise gone()
        yield


def _ray_up(ray: Any) -> bool:
    """Whether Ray is initialized in this process, once any ``ray.shutdown()`` under way in
    another thread has ended (it holds :func:`_shutdown_lock`): after a failed answer, tells
    Ray's own error (kept) from the death of the actor with its owner at a shutdown."""
    with _shutdown_lock(ray):
        return bool(ray.is_initialized())


def _kill_actor(ray: Any, actor: Any, session: int | None = None) -> None:
    """``ray.kill(actor)``, unless Ray is no longer initialized in this process (a
    ``ray.shutdown()``: the actors it owned are gone with it, and ``ray.kill`` would start a
    new local cluster of its own), or *session*, the actor's, has ended since."""
    with contextlib.suppress(Exception), _calling_ray(ray, _NotCalled, session=session):
        ray.kill(actor, no_restart=True)


class _NotCalled(Exception):
    """Ray was not called: it was shut down in this process (:func:`_calling_ray`)."""


def _not_placed(stage: str) -> StageStartupError:
    """A start's error once Ray was shut down in this process while its stage was being
    placed: its actor went with it (from then on, starts are refused until ``ray.init()``:
    :func:`_shut_down`)."""
    return StageStartupError(
        f"stage {stage!r} was not placed: Ray was shut down in this process "
        f"(ray.shutdown()) while it was being placed, and its actor went with it; "
        f"call ray.init() to place stages again"
    )


# Where Ray's autoscaler monitor publishes the cluster's status (``ray status`` reads it),
# and the key that says autoscaler v2 runs (Ray 2.60's names).
_AUTOSCALING_STATUS: Final = "__autoscaling_status"
_AUTOSCALER_V2_KEY: Final = "__autoscaler_v2_enabled"
_AUTOSCALER_NAMESPACE: Final = "__autoscaler"


def _fixed_cluster(status: bytes | None, v2: bytes | None) -> bool:
    """Whether the cluster is one that does not scale, read from the status that Ray's
    autoscaler monitor (v1) publishes, *status*, and autoscaler v2's key *v2*: only when
    the monitor runs with Ray's readonly provider (a cluster made by hand, ``ray start`` or
    ``ray.init()``: every node a type of its own, named ``node_<node id>``). Anything else
    (an autoscaler's node types, autoscaler v2, no status yet, one this code cannot read)
    is a cluster that may grow."""
    if v2 == b"1" or not status:
        return False
    try:
        import json

        mapping = json.loads(status)["autoscaler_report"]["node_type_mapping"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(mapping, dict)
        and bool(mapping)
        and all(kind == f"node_{node}" for node, kind in mapping.items())
    )


def _unplaceable(ray: Any, placement: RayPlacement) -> str | None:
    """Why no node of the cluster can ever take *placement*, or ``None`` (it may be
    placed, now or later, or this cannot be told). Conservative: a placement group that is
    removed (or unknown to the cluster) is named; else a request that no live node's total
    resources cover, only in a cluster that does not scale (:func:`_fixed_cluster`). A
    placement group's bundle is not checked here (Ray checks that the request fits it). Any
    error of Ray's while looking is "cannot be told"."""
    try:
        group = placement.placement_group
        if group is not None:
            table = ray.util.placement_group_table(group)
            if not table or table.get("state") == "REMOVED":
                return (
                    f"its placement group {group.id.hex()} was removed (or is unknown to this "
                    f"Ray cluster): make a new group for it"
                )
            return None
        wanted = {
            "CPU": placement.num_cpus,
            "GPU": placement.num_gpus,
            **(placement.resources or {}),
        }
        wanted = {name: amount for name, amount in wanted.items() if amount > 0}
        totals = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
        if any(all(t.get(name, 0) >= amount for name, amount in wanted.items()) for t in totals):
            return None
        from ray.experimental.internal_kv import _internal_kv_get

        v2 = _internal_kv_get(_AUTOSCALER_V2_KEY, namespace=_AUTOSCALER_NAMESPACE)
        if not _fixed_cluster(_internal_kv_get(_AUTOSCALING_STATUS), v2):
            return None
    except Exception:  # cannot be told: the startup_timeout tells
        return None
    short = sorted(
        name
        for name, amount in wanted.items()
        if max((t.get(name, 0) for t in totals), default=0) < amount
    )
    most = {name: max((t.get(name, 0) for t in totals), default=0) for name in short}
    what = ", ".join(f"{name}: {wanted[name]:g} (most on a node: {most[name]:g})" for name in short)
    return (
        f"no node of this Ray cluster can ever offer {what or 'all of ' + repr(wanted)}, and "
        f"the cluster does not scale (no autoscaler adds nodes)"
    )


@dataclass(frozen=True)
class RayPlacement:
    """Where and with what a stage's actor runs: Ray's actor options.

    *num_cpus*, *num_gpus* and *resources* (custom resources, e.g. ``{"node:10.0.0.5":
    0.01}`` or your own labels; not ``"CPU"`` or ``"GPU"``) are reserved for the actor:
    each amount 0 or at least 0.0001 (Ray's unit). With *placement_group* (a
    ``ray.util.placement_group.PlacementGroup``), the actor goes into that group's bundle
    *bundle_index* (``-1``: any bundle); its resources then come from the bundle.
    *runtime_env* is passed to Ray as is. A placement that no live node's total resources
    cover, in a cluster that does not scale, or in a removed placement group, fails at
    once (:class:`~enginecore.stage.StageStartupError`, docs/ray.md's rule); one that
    waits for resources keeps the actor pending, and the launch fails after its
    ``startup_timeout``."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] | None = None
    placement_group: Any = None
    bundle_index: int = -1
    runtime_env: Mapping[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Checked here, when the placement is made: Ray's own errors come only at the
        # launch, and some are bare (an AssertionError for a placement_group that is not one).
        _check_amount(self.num_cpus, "num_cpus")
        _check_amount(self.num_gpus, "num_gpus")
        if self.resources is not None:
            if not isinstance(self.resources, Mapping):
                raise TypeError(
                    f"resources must be a mapping of resource name to amount, got "
                    f"{type(self.resources).__name__}"
                )
            for name, amount in self.resources.items():
                if not isinstance(name, str):
                    raise TypeError(f"a resource name must be a str, got {name!r}")
                if name in ("CPU", "GPU"):  # Ray refuses them there, at the launch
                    raise ValueError(
                        f"resources[{name!r}]: give num_{name.lower()}s= instead (Ray takes "
                        f"CPUs and GPUs only there)"
                    )
                _check_amount(amount, f"resources[{name!r}]")
        if self.runtime_env is not None and not isinstance(self.runtime_env, Mapping):
            raise TypeError(f"runtime_env must be a mapping, got {type(self.runtime_env).__name__}")
        if isinstance(self.bundle_index, bool) or not isinstance(self.bundle_index, int):
            raise TypeError(f"bundle_index must be an int >= -1, got {self.bundle_index!r}")
        if self.bundle_index < -1:
            raise ValueError(f"bundle_index must be an int >= -1, got {self.bundle_index!r}")
        if self.placement_group is not None:
            # A PlacementGroup exists only once Ray is imported: no import here.
            module = sys.modules.get("ray.util.placement_group")
            group_type = getattr(module, "PlacementGroup", None)
            if group_type is None or not isinstance(self.placement_group, group_type):
                raise TypeError(
                    f"placement_group must be a ray.util.placement_group.PlacementGroup, got "
                    f"{type(self.placement_group).__name__}"
                )
        if self.bundle_index != -1 and self.placement_group is None:
            raise ValueError("bundle_index needs a placement_group")

    def actor_options(self) -> dict[str, Any]:
        """The options for ``ActorClass.options(...)``: never detached, never restarted
        by Ray (the pool restarts replicas)."""
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "max_concurrency": _ACTOR_CONCURRENCY,
            "max_restarts": 0,
        }
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.runtime_env is not None:
            options["runtime_env"] = dict(self.runtime_env)
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.bundle_index,
            )
        return options


_actor_class: Any = None
_actor_class_lock = threading.Lock()


def _remote_actor_class(ray: Any) -> Any:
    global _actor_class
    with _actor_class_lock:
        if _actor_class is None:
            _actor_class = ray.remote(_StageActor)
        return _actor_class


def check_actor_options(placements: Iterable[RayPlacement]) -> None:
    """Ray's own checks of each placement's actor options, the ones a
    :class:`RayPlacement` cannot make without importing Ray (an accelerator's: ``TPU`` in
    the chip counts Ray supports, ``neuron_cores`` in whole numbers, ...), made by
    ``ActorClass.options()``, which places nothing and needs no cluster. A pool or
    pipeline checks all of its placements so before it places any: a bad one then fails
    the launch at once, not when the launch reaches it after placing the others.
    Ray's :class:`ValueError` (or :class:`TypeError`), with the placement named."""
    checked: list[RayPlacement] = []
    for placement in placements:
        if any(placement is seen for seen in checked):
            continue
        checked.append(placement)
        try:
            _remote_actor_class(_import_ray()).options(**placement.actor_options())
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{placement!r}: {exc}") from None


class _ActorProcess:
    """What a client reads of a launched stage's ``process``: its sentinel (a pipe that
    turns readable when the actor's stage has ended or the actor died) and pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel, self._w = os.pipe()

    def mark_exited(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._w)


# Ray's text of a remote error colours its header for a terminal.
_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` (Ray's are long)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class RayStage:
    """A stage placed on Ray, as a client owns it: the actor, its addresses and keys. It
    stands where a launched stage's process handle stands (``_launch.Launched``): the
    client waits on :attr:`process`'s sentinel, reaps an exit code, signals it (SIGTERM:
    ``actor.stop``; SIGKILL: ``ray.kill``) and releases it (``ray.kill``: no actor is left
    once the client is closed)."""

    def __init__(
        self,
        actor: Any,
        info: Mapping[str, Any],
        stage: str,
        client_keys: tuple[bytes, bytes] | None,
        logs: _logs.LogSource | None = None,
        authorized_clients: tuple[bytes, ...] = (),
    ) -> None:
        # First, before anything is opened: the actor's wait, whose answer (a future Ray
        # completes from its own thread) the watch below waits on; a ray.get may block for
        # good once Ray is shut down, and a Ray call after the shutdown would start a
        # cluster of its own (_calling_ray).
        ray = _import_ray()
        with _calling_ray(ray, lambda: _not_placed(stage)):
            self._watch_ref = actor.wait.remote()
            self._answer: concurrent.futures.Future[Any] = self._watch_ref.future()
            # The Ray session it was placed in (_sessions): its actor goes with it.
            self.session = _sessions
        self.actor = actor
        self.stage = stage
        self.logs = logs  # its forwarded records, if forwarded
        # The keys it admits besides its owner's: those it was placed with, then each
        # rotation's (catch_up_keys; authorize_clients keeps them on the pool's replica).
        self.authorized_clients = authorized_clients
        # A pipeline stage's: the public keys of the previous stage's links, which it admits
        # besides authorized_clients (grant_links); a key rotation keeps them.
        self.link_keys: tuple[bytes, ...] = ()
        self.input_address: str = info["input"]
        self.output_address: str = info["output"]
        self.node_ip: str = info["node_ip"]
        self.process = _ActorProcess(int(info["pid"]))
        # A pipeline stage's public key for its links to the next stage (RayPlan.link_kwarg).
        self.link_key: bytes | None = info.get("link_key")
        self.curve: CurveKeys | None = None
        if client_keys is not None:
            self.curve = CurveKeys(client_keys[0], client_keys[1], info["server_key"])
        self.lock = threading.Lock()
        self._exit_code: int | None = None
        self._exited = threading.Event()
        self._released = False
        self.death: str | None = None  # why the actor ended, if it died
        threading.Thread(target=self._watch, name="enginecore-ray-watch", daemon=True).start()

    def _watch(self) -> None:
        ray = _import_ray()
        answer = self._answer
        while not self._exited.is_set():
            # A later session seen: this one was shut down (Ray completes none of its
            # actor's calls, and a look now would take a later shutdown for its own).
            if not ray.is_initialized() or self.session != _sessions:
                _shut_down(self.session)
                self._ended(None, _SHUT_DOWN)
                return
            # Not answer.result(timeout): a remote error is also an instance of its cause's
            # class, a TimeoutError's too, which would read as "not yet".
            if not concurrent.futures.wait([answer], timeout=_WATCH_POLL).done:
                continue
            try:
                code = answer.result()
            except BaseException as exc:  # RayActorError and kin: the actor died
                if not _ray_up(ray) or self.session != _sessions:
                    _shut_down(self.session)
                    self._ended(None, _SHUT_DOWN)
                else:
                    self._ended(None, f"its Ray actor died ({_first_line(exc)})")
                return
            self._ended(code, None)
            return

    def _ended(self, code: int | None, death: str | None) -> None:
        with self.lock:
            if self._exited.is_set():
                return
            self._exit_code = code
            self.death = death
            self._exited.set()
            self.process.mark_exited()

    def wait_exit(self, timeout: float | None) -> bool:
        """Block until the stage has ended or the actor died, at most *timeout* s."""
        return self._exited.wait(timeout)

    def reap(self) -> int | None:
        """The stage's exit code once it has ended (``-9`` once killed); ``None`` while it
        runs, or when the actor died without one."""
        return self._exit_code if self._exited.is_set() else None

    def send_signal(self, sig: signal.Signals) -> None:
        """SIGKILL: ``ray.kill`` the actor (it counts as exited at once); else ask the
        stage to shut down (``actor.stop``)."""
        ray = _import_ray()
        if sig == signal.SIGKILL:
            _kill_actor(ray, self.actor, self.session)
            self._ended(-int(signal.SIGKILL), "killed with ray.kill")
        elif not self._exited.is_set():
            with (
                contextlib.suppress(Exception),
                _calling_ray(ray, _NotCalled, session=self.session),
            ):
                self.actor.stop.remote()

    def release(self) -> None:
        """After the stage has ended: ``ray.kill`` the actor (its process goes) and close
        the sentinel. Idempotent."""
        with self.lock:
            if self._released:
                return
            self._released = True
        _kill_actor(_import_ray(), self.actor, self.session)
        self._ended(self._exit_code, self.death)
        if self.logs is not None:
            self.logs.release()
        with contextlib.suppress(OSError):
            os.close(self.process.sentinel)

    def kill_and_clean(self) -> None:
        """``ray.kill`` the actor and release everything."""
        self.send_signal(signal.SIGKILL)
        self.release()


@dataclass(frozen=True)
class RayPlan:
    """How to place one stage on Ray and open its client: :func:`launch_on_ray`'s
    arguments, checked. A replica pool keeps one per Ray replica (``member_plan``)."""

    factory: str
    kwargs_frame: bytes
    stage: str
    placement: RayPlacement
    insecure: bool
    startup_timeout: float
    connect_timeout: float
    heartbeat: tuple[float, float]
    options: dict[str, Any]
    curve: CurveKeys | None = None
    stage_secret_key: str | None = None
    authorized_clients: tuple[bytes, ...] = ()
    forward_logs: bool = False
    # A pipeline stage's: the kwarg that the actor hands the key pair it makes for the
    # stage's links to the next stage (RayStage.link_key is its public half); None: none.
    link_kwarg: str | None = None

    @classmethod
    def make(
        cls,
        factory: str,
        kwargs: dict[str, Any] | None,
        *,
        placement: RayPlacement | None = None,
        insecure: bool = False,
        curve: CurveKeys | None = None,
        stage_secret_key: str | os.PathLike[str] | None = None,
        authorized_clients: Sequence[bytes] = (),
        startup_timeout: float = 60.0,
        connect_timeout: float = CONNECT_TIMEOUT,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        name: str | None = None,
        step_timeout: float | None = STEP_TIMEOUT,
        kill_after: float | None = None,
        log_level: int | str | None = None,
        forward_logs: bool = False,
        load_interval: float | None = LOAD_INTERVAL,
        max_message_bytes: int | None = None,
        link_kwarg: str | None = None,
    ) -> RayPlan:
        """Check everything before anything is placed. *link_kwarg* (a pipeline's): the
        actor makes a key pair for the stage's links and hands it to the factory as that
        kwarg (needs CURVE)."""
        _validate_factory(factory)
        check_watchdog(step_timeout, kill_after)
        level = _logs.check_log_level(log_level)
        load_interval = check_load_interval(load_interval)
        _wire.check_max_message_bytes(max_message_bytes)
        heartbeat = _clientbase.check_heartbeat(heartbeat_interval, heartbeat_timeout)
        if placement is None:
            placement = RayPlacement()
        if not isinstance(placement, RayPlacement):
            raise TypeError(f"placement must be a RayPlacement, got {type(placement).__name__}")
        check_actor_options([placement])
        if positive_seconds(connect_timeout, "connect_timeout") > _MAX_CONNECT_TIMEOUT:
            raise ValueError(f"connect_timeout must be in (0, {_MAX_CONNECT_TIMEOUT}] seconds")
        positive_seconds(startup_timeout, "startup_timeout")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not isinstance(forward_logs, bool):
            raise TypeError(f"forward_logs must be a bool, got {type(forward_logs).__name__}")
        if not isinstance(insecure, bool):  # "no" would be true: CURVE off
            raise TypeError(f"insecure must be a bool, got {type(insecure).__name__}")
        secret_file, authorized = _check_keys(insecure, curve, stage_secret_key, authorized_clients)
        if link_kwarg is not None and insecure:
            raise ValueError("link keys are CURVE keys: insecure=True makes none")
        kwargs = factory_kwargs(kwargs)
        _wire.check_encodable(kwargs, "factory kwargs")
        if not all(type(k) is str for k in kwargs):
            raise TypeError("factory kwargs must have str keys")
        return cls(
            factory=factory,
            kwargs_frame=_codec.encode_plain(kwargs, "factory kwargs"),
            stage=name or factory,
            placement=placement,
            insecure=bool(insecure),
            startup_timeout=float(startup_timeout),
            connect_timeout=float(connect_timeout),
            heartbeat=heartbeat,
            options={
                "step_timeout": step_timeout,
                "kill_after": kill_after,
                "log_level": level,
                "load_interval": load_interval,
                "max_message_bytes": max_message_bytes,
                "connect_timeout": float(connect_timeout),
            },
            curve=curve,
            stage_secret_key=secret_file,
            authorized_clients=authorized,
            forward_logs=forward_logs,
            link_kwarg=link_kwarg,
        )

    def start(
        self,
        grant: Callable[[bytes], None] | None = None,
        cancel: multiprocessing.connection.Connection | None = None,
    ) -> RayStage:
        """Place the actor and start its stage; blocks until it is ready, at most
        *startup_timeout* seconds (placement included). :class:`StageStartupError` if it
        does not come up; no actor is left behind then. With :attr:`link_kwarg`, the
        actor's link key is made first and ``grant(public key)`` called with it before
        the stage starts (a pipeline: the next stage admits it before this one
        connects). Once *cancel* (the read end of a pipe: a pool's, written when it
        closes or removes the replica) is readable, the wait stops within 0.1 s: the
        actor is killed and :class:`~enginecore.stage.StageClosedError` raised."""
        deadline = time.monotonic() + self.startup_timeout
        ray, actor, client_keys, keys = self._place()
        logs: _logs.LogSource | None = None
        try:
            if self.link_kwarg is not None and grant is not None:
                call = self._submit(ray, actor.link_key)
                grant(self._get(ray, call, deadline, cancel))
            if self.forward_logs:
                call = self._submit(
                    ray, actor.open_logs, self.stage, self.options["log_level"], keys
                )
                logs = self._forward_logs(self._get(ray, call, deadline, cancel), client_keys)
            call = self._submit(
                ray, actor.start, self.factory, self.kwargs_frame, self.stage, self.options, keys
            )
            info = self._check_server_key(self._get(ray, call, deadline, cancel))
            return RayStage(actor, info, self.stage, client_keys, logs, self.authorized_clients)
        except BaseException:
            self._abandon(ray, actor, logs)
            raise

    async def start_async(
        self, grant: Callable[[bytes], Awaitable[None]] | None = None
    ) -> RayStage:
        """:meth:`start`, awaited: the actor's answers are awaited as Ray's futures, so no
        thread is held while the actor starts (many placed at once all progress together).
        On failure or cancellation, no actor is left behind. *grant* is awaited."""
        deadline = time.monotonic() + self.startup_timeout
        ray, actor, client_keys, keys = self._place()
        logs: _logs.LogSource | None = None
        try:
            if self.link_kwarg is not None and grant is not None:
                call = self._submit(ray, actor.link_key)
                await grant(await self._get_async(ray, call, deadline))
            if self.forward_logs:
                call = self._submit(
                    ray, actor.open_logs, self.stage, self.options["log_level"], keys
                )
                logs = self._forward_logs(await self._get_async(ray, call, deadline), client_keys)
            call = self._submit(
                ray, actor.start, self.factory, self.kwargs_frame, self.stage, self.options, keys
            )
            info = self._check_server_key(await self._get_async(ray, call, deadline))
            return RayStage(actor, info, self.stage, client_keys, logs, self.authorized_clients)
        except BaseException:
            self._abandon(ray, actor, logs)
            raise

    def _place(self) -> tuple[Any, Any, tuple[bytes, bytes] | None, dict[str, Any] | None]:
        """Create the actor (Ray places it and starts its process meanwhile), then the
        keys: ``(ray, actor, this client's key pair or None, the keys for the actor)``.
        The key pair is made while Ray places the actor, off the launch's path."""
        ray = _import_ray()
        refused = StageStartupError(
            f"stage {self.factory!r} was not placed: Ray was shut down in this process "
            f"(ray.shutdown()) under stages placed on it; call ray.init() to place "
            f"stages again (enginecore does not start a Ray cluster of its own then)"
        )
        options = self.placement.actor_options()
        if ray.is_initialized() and (why := _unplaceable(ray, self.placement)) is not None:
            raise StageStartupError(f"stage {self.factory!r} cannot be placed on Ray: {why}")
        with _calling_ray(ray, lambda: refused, placement=True):
            actor = _remote_actor_class(ray).options(**options).remote()
        if self.insecure:
            return ray, actor, None, None
        try:
            if self.curve is not None:
                client_keys = (self.curve.public_key, self.curve.secret_key)
            else:
                import zmq

                client_keys = zmq.curve_keypair()
        except BaseException:
            self._abandon(ray, actor, None)
            raise
        keys = {
            "authorized": [client_keys[0], *self.authorized_clients],
            "secret_file": self.stage_secret_key,
        }
        if self.link_kwarg is not None:
            keys["link_kwarg"] = self.link_kwarg
        return ray, actor, client_keys, keys

    def _forward_logs(self, found: Any, client_keys: tuple[bytes, bytes] | None) -> Any:
        """Connect to the log socket the actor bound (``open_logs``'s answer *found*)."""
        found = self._check_server_key(found)
        log_keys = None
        if client_keys is not None:
            log_keys = CurveKeys(client_keys[0], client_keys[1], found["server_key"])
        return _logs.forward_from(found["address"], self.stage, log_keys)

    @staticmethod
    def _abandon(ray: Any, actor: Any, logs: _logs.LogSource | None) -> None:
        """A failed start: kill the actor, release the log socket."""
        _kill_actor(ray, actor)
        if logs is not None:
            logs.release()

    def _check_ray(self, ray: Any) -> None:
        """:class:`StageStartupError` if Ray was shut down in this process while this stage
        was being placed: its actor went with it, and Ray completes none of its calls. From
        then on, starts are refused until ``ray.init()`` (:func:`_shut_down`)."""
        if not ray.is_initialized():
            _shut_down()
            raise _not_placed(self.factory)

    def _submit(self, ray: Any, method: Any, *args: Any) -> tuple[Any, Any]:
        """``method.remote(*args)`` (a call to the actor) and its answer as a future that
        Ray completes from its own thread: ``(ref, future)`` (the ref is kept while the
        answer is waited for). Unless Ray was shut down (:func:`_calling_ray`)."""
        with _calling_ray(ray, lambda: _not_placed(self.factory)):
            ref = method.remote(*args)
            return ref, ref.future()

    def _get(
        self,
        ray: Any,
        call: tuple[Any, Any],
        deadline: float,
        cancel: multiprocessing.connection.Connection | None = None,
    ) -> Any:
        """The answer of *call* (:meth:`_submit`'s) before *deadline*, its failures as
        :class:`StageStartupError`; :class:`StageClosedError` once *cancel* is readable.
        Waits on the answer's future in slices of :data:`_PLACE_POLL` (no wait of Ray's can
        also wait for a pipe), and looks between them whether Ray was shut down in this
        process (:meth:`_check_ray`: Ray completes the future never then). No call to Ray:
        a ``ray.wait`` under way at a shutdown raised ``SystemExit`` (Ray 2.60)."""
        answer = call[1]
        while True:
            self._check_ray(ray)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out()
            if concurrent.futures.wait([answer], timeout=min(left, _PLACE_POLL)).done:
                return self._answer(ray, answer)
            if cancel is not None and cancel.poll():
                raise StageClosedError(
                    f"the start of stage {self.factory!r} on Ray was cancelled; its "
                    f"actor was killed"
                )

    async def _get_async(self, ray: Any, call: tuple[Any, Any], deadline: float) -> Any:
        """:meth:`_get`, awaited; it too looks every :data:`_PLACE_POLL` whether Ray was
        shut down (the future is never completed then)."""
        answer = asyncio.wrap_future(call[1])
        try:
            while True:
                self._check_ray(ray)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out()
                done, _ = await asyncio.wait({answer}, timeout=min(left, _PLACE_POLL))
                if done:
                    return self._answer(ray, answer)
        finally:
            if not answer.done():
                answer.cancel()

    def _answer(
        self, ray: Any, answer: concurrent.futures.Future[Any] | asyncio.Future[Any]
    ) -> Any:
        """The result of *answer*, a done future of :meth:`_submit`'s call; its Ray failure
        as :class:`StageStartupError` (:meth:`_check_ray`'s error if Ray was shut down)."""
        try:
            return answer.result()
        except ray.exceptions.RayError as exc:
            if not _ray_up(ray):  # the actor went with a ray.shutdown()
                self._check_ray(ray)
            raise self._failed(ray, exc) from None

    def _timed_out(self) -> StageStartupError:
        return StageStartupError(
            f"stage {self.factory!r} on Ray was not ready within "
            f"{self.startup_timeout} s (placement included: is the placement "
            f"{self.placement!r} satisfiable?); its actor was killed"
        )

    def _failed(self, ray: Any, exc: BaseException) -> StageStartupError:
        if isinstance(exc, ray.exceptions.RayTaskError):
            # The actor's own exception first, then the actor's traceback, as a launched
            # stage's reads (Ray's text of it, without its terminal colours).
            cause = getattr(exc, "cause", None)
            why = f"{type(cause).__name__}: {cause}" if isinstance(cause, Exception) else None
            traceback = _ANSI.sub("", str(exc)).strip()
            return StageStartupError(
                f"stage {self.factory!r} failed to start in its Ray actor: "
                f"{why or _first_line(exc)}\n\nActor traceback:\n{traceback}",
                child_traceback=traceback,
            )
        return StageStartupError(
            f"the Ray actor of stage {self.factory!r} died during startup: {exc}"
        )

    def _check_server_key(self, info: Any) -> Any:
        """*info* from the actor, unless the stage's public key is not the one
        ``curve.server_key`` names (:class:`StageStartupError`)."""
        if self.curve is not None and info["server_key"] != self.curve.server_key:
            raise StageStartupError(
                f"the key in stage_secret_key {self.stage_secret_key!r} (public key "
                f"{info['server_key'].decode()}) is not the stage's key that curve names "
                f"({self.curve.server_key.decode()}); its actor was killed"
            )
        return info

    def target(
        self, stage: RayStage, ping_s: float | None = None, ordered_events: bool = False
    ) -> Target:
        """What the client opens on *stage*: its address, the handshake timeout, the
        stage handle (a launched stage's place), heartbeats that presume it dead after
        their timeout, and the CURVE keys."""
        interval, timeout = self.heartbeat
        return Target(
            stage.input_address,
            self.connect_timeout,
            stage,  # type: ignore[arg-type]  # stands where a Launched stands
            (interval if ping_s is None else ping_s, timeout),
            ordered_events,
            stage.curve,
        )


def _check_keys(
    insecure: bool,
    curve: CurveKeys | None,
    stage_secret_key: str | os.PathLike[str] | None,
    authorized_clients: Sequence[bytes],
) -> tuple[str | None, tuple[bytes, ...]]:
    """The bring-your-own keys of a Ray stage, checked: the secret key file's path and the
    other clients' public keys."""
    if isinstance(authorized_clients, (str, bytes)):
        raise TypeError("authorized_clients must be a sequence of public keys, not one key")
    if not isinstance(authorized_clients, Iterable):
        raise TypeError(
            f"authorized_clients must be a sequence of public keys, got "
            f"{type(authorized_clients).__name__}"
        )
    if stage_secret_key is not None and not isinstance(stage_secret_key, (str, os.PathLike)):
        raise TypeError(
            f"stage_secret_key must be a path (str or os.PathLike), got "
            f"{type(stage_secret_key).__name__}"
        )
    authorized = tuple(_check_key(k, "a key of authorized_clients") for k in authorized_clients)
    if insecure:
        if curve is not None or stage_secret_key is not None or authorized:
            raise ValueError(
                "insecure=True uses no CURVE: it takes no curve, stage_secret_key or "
                "authorized_clients"
            )
        return None, ()
    if curve is not None and not isinstance(curve, CurveKeys):
        raise TypeError(f"curve must be CurveKeys, got {type(curve).__name__}")
    if curve is not None and stage_secret_key is None:
        raise ValueError(
            "curve= names the stage's public key (server_key): give stage_secret_key=, the "
            "stage's NAME.key_secret as a path on the nodes where it may be placed"
        )
    secret_file = None if stage_secret_key is None else os.fspath(stage_secret_key)
    return secret_file, authorized


def launch_on_ray(
    factory: str,
    /,
    kwargs: dict[str, Any] | None = None,
    *,
    placement: RayPlacement | None = None,
    insecure: bool = False,
    curve: CurveKeys | None = None,
    stage_secret_key: str | os.PathLike[str] | None = None,
    authorized_clients: Sequence[bytes] = (),
    startup_timeout: float = 60.0,
    connect_timeout: float = CONNECT_TIMEOUT,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 5.0,
    ordered_events: bool = False,
    name: str | None = None,
    step_timeout: float | None = STEP_TIMEOUT,
    kill_after: float | None = None,
    log_level: int | str | None = None,
    forward_logs: bool = False,
    load_interval: float | None = LOAD_INTERVAL,
    max_message_bytes: int | None = None,
) -> StageClient:
    """Start a stage running ``factory(**kwargs)`` in a Ray actor placed with *placement*
    (:class:`RayPlacement`; default: one CPU anywhere) and return its
    :class:`~enginecore.stage.StageClient`, which owns the actor: ``close()`` /
    ``shutdown()`` stop the stage and kill the actor. ``StageClient.launch_on_ray`` is the
    same; ``AsyncStageClient.launch_on_ray`` its asyncio twin.

    Uses the Ray cluster this process is connected to (``ray.init()``; Ray's own default
    starts or finds one, except after a ``ray.shutdown()`` under stages placed from this
    process: :class:`~enginecore.stage.StageStartupError` until a new ``ray.init()``). A
    placement no node can ever take (a cluster that does not scale) or in a removed
    placement group is a :class:`~enginecore.stage.StageStartupError` at once. The stage
    binds TCP on the actor's node IP; the client connects with CURVE unless *insecure*: by
    default with keys made for this stage (public keys exchanged through the actor); with
    your own keys, *curve* (this client's :class:`~enginecore.stage.CurveKeys`, whose
    ``server_key`` is the stage's) and *stage_secret_key* (the stage's ``NAME.key_secret``,
    a path on the nodes where it may be placed: read by the actor, never sent);
    *authorized_clients* lists the public keys of other clients the stage admits too (an
    observer such as ``enginecore top``). The stage options are :meth:`StageClient.launch
    <enginecore.stage.StageClient.launch>`'s; with *forward_logs*, the stage's records are
    re-emitted in this process (over a TCP socket of their own, with the same CURVE keys).
    Blocks until the stage is ready, at most *startup_timeout* seconds for the actor
    (placement included) and *connect_timeout* (at most 30 s) for the handshake over TCP;
    :class:`~enginecore.stage.StageStartupError` otherwise, with no actor left behind.

    The client pings the stage every *heartbeat_interval* seconds and presumes it dead
    after *heartbeat_timeout* without a frame; the actor's death (``ray.kill``, a crash) is
    :class:`~enginecore.stage.EngineDeadError` within a second (``docs/ray.md``)."""
    _clientbase.check_flag(ordered_events, "ordered_events")
    plan = RayPlan.make(
        factory,
        kwargs,
        placement=placement,
        insecure=insecure,
        curve=curve,
        stage_secret_key=stage_secret_key,
        authorized_clients=authorized_clients,
        startup_timeout=startup_timeout,
        connect_timeout=connect_timeout,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        name=name,
        step_timeout=step_timeout,
        kill_after=kill_after,
        log_level=log_level,
        forward_logs=forward_logs,
        load_interval=load_interval,
        max_message_bytes=max_message_bytes,
    )
    from ._client import StageClient

    client: StageClient = open_on_ray(plan, StageClient._open, ordered_events=ordered_events)
    return client


def open_on_ray(
    plan: RayPlan,
    opener: Any,
    ping_s: float | None = None,
    *,
    ordered_events: bool = False,
    grant: Callable[[bytes], None] | None = None,
    cancel: multiprocessing.connection.Connection | None = None,
) -> Any:
    """Start *plan*'s stage and open a client on it with ``opener(target)``; if the open
    fails, kill the actor and raise :class:`~enginecore.stage.StageStartupError`. *grant*
    and *cancel*: :meth:`RayPlan.start`'s."""
    stage = plan.start(grant, cancel)
    try:
        return opener(plan.target(stage, ping_s, ordered_events))
    except BaseException as exc:
        stage.kill_and_clean()
        _clientbase.raise_startup_error(plan.factory, exc)


async def open_on_ray_async(
    plan: RayPlan,
    opener: Any,
    *,
    ordered_events: bool = False,
    grant: Callable[[bytes], Awaitable[None]] | None = None,
) -> Any:
    """:func:`open_on_ray` for an asyncio client: the placement is awaited
    (:meth:`RayPlan.start_async`, no thread held) and ``await opener(target)`` opens the
    client; on failure or cancellation, no actor is left behind. *grant*:
    :meth:`RayPlan.start_async`'s."""
    stage = await plan.start_async(grant)
    try:
        return await opener(plan.target(stage, None, ordered_events))
    except BaseException as exc:
        stage.kill_and_clean()
        _clientbase.raise_startup_error(plan.factory, exc)


def _rotation(
    target: Any, keys: Sequence[bytes | str], timeout: float
) -> tuple[list[RayStage], list[str]]:
    """What :func:`authorize_clients` acts on: the Ray stages of *target* (a client placed
    on Ray, or a pool's replicas placed on Ray that run now), and *keys* checked, as Z85
    text. A pool's Ray replicas keep the new keys, for their restarts (and for a start
    under way now: :func:`catch_up_keys`). *timeout* is checked too."""
    positive_seconds(timeout, "timeout")
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a sequence of public keys, not one key")
    if not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a sequence of public keys, got {type(keys).__name__}")
    checked = [_check_key(k, "an authorized client key").decode("ascii") for k in keys]
    # Ray shut down in this process under its stages: they went with it (a pool's are
    # skipped, a client's is EngineDeadError), and Ray is not called (_calling_ray).
    initialized = _import_ray().is_initialized()
    stages: list[RayStage] = []
    if hasattr(target, "replicas"):  # a pool
        if getattr(target, "closed", False) is True:
            raise StageClosedError("this stage pool is closed")
        replicas: list[Any] = []
        for replica in target.replicas:
            if "ray" not in replica.spec:
                continue
            if replica.spec.get("insecure"):
                raise ValueError(f"replica {replica.name} was placed with insecure=True: no CURVE")
            replicas.append(replica)
        if not replicas:
            raise TypeError(
                f"authorize_clients takes a client or a pool of stages placed on Ray: this "
                f"{type(target).__name__} has no replica placed on Ray (a launched replica "
                f"uses ipc, without CURVE)"
            )
        # The new keys first, then the stages that run: a restart that was placed with the
        # old keys and serves after this line brings itself up to date (catch_up_keys), and
        # one that serves before it is among the stages below.
        for replica in replicas:
            replica._authorized_clients = tuple(k.encode("ascii") for k in checked)
        for replica in replicas:
            stage = getattr(replica._client, "_launched", None)
            if (
                initialized
                and isinstance(stage, RayStage)
                and stage.reap() is None
                and stage.death is None
            ):
                stages.append(stage)
    else:
        stage = getattr(target, "_launched", None)
        if not isinstance(stage, RayStage):
            raise TypeError(
                f"authorize_clients takes a client or a pool of stages placed on Ray, got "
                f"{type(target).__name__} (a serve stage reloads its keys on SIGHUP)"
            )
        if stage.curve is None:
            raise ValueError("this stage was placed with insecure=True: it uses no CURVE")
        # A stage that is gone has no keys to rotate: say so, as the client's calls do,
        # rather than Ray's error for a dead actor (or, after ray.shutdown(), a new cluster).
        if getattr(target, "_sockets_closed", False):
            raise StageClosedError("this stage client is closed (its stage on Ray is stopped)")
        if not initialized:
            _shut_down(stage.session)
            raise EngineDeadError(f"stage {stage.stage!r}: {_SHUT_DOWN}")
        if stage.wait_exit(0):
            code = stage.reap()
            why = stage.death or (f"exit code {code}" if code is not None else "it ended")
            raise EngineDeadError(f"stage {stage.stage!r} on Ray has ended: {why}")
        stages.append(stage)
    return stages, checked


def authorize_clients(
    target: Any, keys: Sequence[bytes | str], *, timeout: float = _AUTHORIZE_TIMEOUT
) -> int:
    """Key rotation for stages placed on Ray, without a restart: from now on, the stage of
    *target* (a :class:`~enginecore.stage.StageClient` or
    :class:`~enginecore.stage.AsyncStageClient` placed on Ray) or each Ray replica of
    *target* (a :class:`~enginecore.stage.StagePool` or
    :class:`~enginecore.stage.AsyncStagePool`) admits the client that placed it and the
    public keys *keys* (Z85, 40 characters, as ``bytes`` or ``str``), instead of the
    ``authorized_clients`` admitted so far. A pool's Ray replicas started later (a restart)
    admit them too, and one whose restart is being placed now gets them before it serves
    (:func:`catch_up_keys`; it is not counted in the result).

    Each actor calls :meth:`StageRuntime.authorize
    <enginecore.stage._runtime.StageRuntime.authorize>` in the stage's process: new
    connections are checked against the new keys, and a client connected with a key that
    is no longer listed loses its session (its requests aborted; our clients raise
    :class:`~enginecore.stage.SessionLostError`) before this returns. The keys travel
    through Ray as a list of ``str``; no secret does. Returns how many stages were
    changed. :class:`ValueError` for a key that is not Z85 or a stage placed with
    ``insecure=True``, :class:`TypeError` for a target not placed on Ray,
    :class:`~enginecore.stage.StageClosedError` for a closed client or pool and
    :class:`~enginecore.stage.EngineDeadError` for a client whose stage has ended (its
    actor dead, or Ray shut down in this process: Ray is not called then; a pool's replicas
    that are not running are skipped), and Ray's error (``GetTimeoutError`` past
    *timeout*, ``RayActorError`` for an actor that died meanwhile) if an actor did not
    answer. A ``ray.shutdown()`` while it is under way ends it with
    :class:`~enginecore.stage.EngineDeadError` within 0.1 s. Blocks: from asyncio,
    ``await`` :func:`authorize_clients_async`."""
    stages, checked = _rotation(target, keys, timeout)
    if stages:
        ray = _import_ray()
        calls = _authorizing(ray, [(stage, _with_links(stage, checked)) for stage in stages])
        _get_or_dead(ray, calls, timeout, _late_rotation(len(stages), timeout))
    for stage in stages:
        stage.authorized_clients = tuple(k.encode("ascii") for k in checked)
    return len(stages)


async def authorize_clients_async(
    target: Any, keys: Sequence[bytes | str], *, timeout: float = _AUTHORIZE_TIMEOUT
) -> int:
    """:func:`authorize_clients`, awaited: the actors' answers are awaited as Ray's
    futures, and no thread is held; ``TimeoutError`` past *timeout*."""
    stages, checked = _rotation(target, keys, timeout)
    if stages:
        ray = _import_ray()
        calls = _authorizing(ray, [(stage, _with_links(stage, checked)) for stage in stages])
        await _answers(ray, calls, timeout, _late_rotation(len(stages), timeout))
    for stage in stages:
        stage.authorized_clients = tuple(k.encode("ascii") for k in checked)
    return len(stages)


def _late_rotation(count: int, timeout: float) -> str:
    return f"a key rotation of {count} stages on Ray took longer than {timeout:g} s"


def _authorizing(ray: Any, rotations: Sequence[tuple[RayStage, list[str]]]) -> list[Any]:
    """Each ``(stage, keys)``: the actor's ``authorize(keys)`` call (*keys* as Z85 text),
    under way, as ``(ref, future)`` (the ref is kept while its answer is waited for);
    :class:`EngineDeadError` without a call once Ray was shut down in this process
    (:func:`_calling_ray`)."""
    name = f"stage {rotations[0][0].stage!r}: " if len(rotations) == 1 else ""
    calls = []
    with _calling_ray(ray, lambda: EngineDeadError(f"{name}{_SHUT_DOWN}")):
        for stage, keys in rotations:
            ref = stage.actor.authorize.remote(keys)
            calls.append((ref, ref.future()))
    return calls


def _dead_if_shut_down(ray: Any) -> None:
    """After an actor call failed: :class:`EngineDeadError` if Ray was shut down in this
    process (the actor died with its owner: Ray's ``ActorDiedError``, not an error of the
    stage's); else nothing, and the caller raises Ray's error."""
    if not _ray_up(ray):
        _shut_down()
        raise EngineDeadError(_SHUT_DOWN) from None


def _get_or_dead(ray: Any, calls: list[Any], timeout: float, late: str) -> list[Any]:
    """The answers of the actor calls *calls* (:func:`_authorizing`'s), waited for on their
    futures in slices of :data:`_PLACE_POLL`: Ray's error if a call failed,
    ``GetTimeoutError(late)`` past *timeout*, and :class:`EngineDeadError` within
    :data:`_PLACE_POLL` once Ray is shut down in this process (Ray then completes none of
    them, and a ``ray.get`` under way may not return before its timeout). No call to Ray
    while it waits: :func:`_answers`, blocking."""
    futures = [future for _, future in calls]
    deadline = time.monotonic() + timeout
    while True:
        if not ray.is_initialized():
            _shut_down()
            raise EngineDeadError(_SHUT_DOWN)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(late)
        done, pending = concurrent.futures.wait(
            futures, timeout=min(left, _PLACE_POLL), return_when=concurrent.futures.FIRST_EXCEPTION
        )
        failed = [future for future in done if future.exception() is not None]
        if failed:
            _dead_if_shut_down(ray)
            failed[0].result()  # raises Ray's error
        if not pending:
            return [future.result() for future in futures]


async def _answers(ray: Any, calls: list[Any], timeout: float, late: str) -> list[Any]:
    """The answers of the actor calls *calls* (:func:`_authorizing`'s), awaited as Ray's
    futures (no thread held): Ray's error if a call failed, ``TimeoutError(late)`` past
    *timeout*, and :class:`EngineDeadError` within :data:`_PLACE_POLL` once Ray is shut
    down in this process (Ray then completes none of them)."""
    gathered = asyncio.gather(*(asyncio.wrap_future(future) for _, future in calls))
    deadline = time.monotonic() + timeout
    try:
        while True:
            if not ray.is_initialized():
                _shut_down()
                raise EngineDeadError(_SHUT_DOWN)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(late)
            done, _ = await asyncio.wait({gathered}, timeout=min(left, _PLACE_POLL))
            if done:
                if gathered.exception() is not None:
                    _dead_if_shut_down(ray)
                return gathered.result()
    finally:
        if not gathered.done():
            gathered.cancel()
            # Taken, so that asyncio does not log it as never retrieved.
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())


def _keys_behind(replica: Any, launched: tuple[bytes, ...]) -> tuple[bytes, ...] | None:
    """The keys of the pool's last rotation, if *replica*'s stage, which admits *launched*,
    has not had them; else ``None``."""
    current: tuple[bytes, ...] | None = replica._authorized_clients
    return None if current is None or current == launched else current


def catch_up_keys(replica: Any, member: Any, timeout: float = _AUTHORIZE_TIMEOUT) -> None:
    """A pool's Ray replica *replica* has just started serving through *member*: if a key
    rotation (:func:`authorize_clients`) came while its stage was being placed with the
    keys before it, give the stage the rotation's keys now, until none is newer than the
    ones it has. The rotation sets the replicas' keys before it looks for their stages, so
    every stage gets them, from the rotation or from here. A stage that does not take them
    (dead, past *timeout*, or Ray shut down) is killed, so that no stage admits a removed
    key: the pool sees the death and restarts it (with the current keys) as its policy
    says."""
    stage = getattr(member, "_launched", None)
    if not isinstance(stage, RayStage):
        return
    ray = _import_ray()
    try:
        while (keys := _keys_behind(replica, stage.authorized_clients)) is not None:
            calls = _authorizing(ray, [(stage, _as_text(stage, keys))])
            _get_or_dead(ray, calls, timeout, _late_keys(replica, timeout))
            stage.authorized_clients = keys
    except Exception:
        _kill_behind(replica, stage)


async def catch_up_keys_async(
    replica: Any, member: Any, timeout: float = _AUTHORIZE_TIMEOUT
) -> None:
    """:func:`catch_up_keys`, awaited (no thread held)."""
    stage = getattr(member, "_launched", None)
    if not isinstance(stage, RayStage):
        return
    ray = _import_ray()
    try:
        while (keys := _keys_behind(replica, stage.authorized_clients)) is not None:
            calls = _authorizing(ray, [(stage, _as_text(stage, keys))])
            await _answers(ray, calls, timeout, _late_keys(replica, timeout))
            stage.authorized_clients = keys
    except Exception:
        _kill_behind(replica, stage)


def _late_keys(replica: Any, timeout: float) -> str:
    return f"replica {replica.name} took longer than {timeout:g} s to take the keys"


def _as_text(stage: RayStage, keys: tuple[bytes, ...]) -> list[str]:
    """What *stage* is to admit for a rotation to *keys*: :func:`_with_links`, as text."""
    return _with_links(stage, [k.decode("ascii") for k in keys])


def _with_links(stage: RayStage, keys: list[str]) -> list[str]:
    """What *stage* is to admit for a rotation to *keys* (Z85 text): those, and the link
    keys of the pipeline stage before it (:func:`grant_links`), which a rotation keeps."""
    return [*keys, *(k.decode("ascii") for k in stage.link_keys if k.decode("ascii") not in keys)]


def _link_target(target: Any) -> RayStage:
    stage = getattr(target, "_launched", None)
    if not isinstance(stage, RayStage):
        raise TypeError(f"grant_links takes a client placed on Ray, got {type(target).__name__}")
    return stage


def grant_links(target: Any, keys: Sequence[bytes], *, timeout: float = _AUTHORIZE_TIMEOUT) -> None:
    """A pipeline's: the stage of *target* (a client placed on Ray) admits *keys*, the
    public keys of the links of the pipeline stage before it, from now on, instead of the
    link keys it admitted so far, and keeps admitting its ``authorized_clients``: a key
    rotation (:func:`authorize_clients`) keeps the link keys, and this keeps the rotation's
    keys. Its errors are :func:`authorize_clients`'s."""
    stage = _link_target(target)
    stage.link_keys = tuple(keys)  # before the call: a rotation racing with it keeps them
    ray = _import_ray()
    calls = _authorizing(ray, [(stage, _as_text(stage, stage.authorized_clients))])
    _get_or_dead(ray, calls, timeout, _late_links(stage, timeout))


async def grant_links_async(
    target: Any, keys: Sequence[bytes], *, timeout: float = _AUTHORIZE_TIMEOUT
) -> None:
    """:func:`grant_links`, awaited (no thread held)."""
    stage = _link_target(target)
    stage.link_keys = tuple(keys)
    ray = _import_ray()
    calls = _authorizing(ray, [(stage, _as_text(stage, stage.authorized_clients))])
    await _answers(ray, calls, timeout, _late_links(stage, timeout))


def _late_links(stage: RayStage, timeout: float) -> str:
    return f"stage {stage.stage!r} took longer than {timeout:g} s to take its link keys"


def _kill_behind(replica: Any, stage: RayStage) -> None:
    """*replica*'s stage did not take a rotation's keys: kill it, saying why."""
    logger.warning(
        "replica %s could not take the keys of a rotation; killing it",
        replica.name,
        exc_info=True,
    )
    stage.kill_and_clean()


def plan_from_spec(spec: Mapping[str, Any], replica_name: str) -> RayPlan:
    """A pool replica's spec ``{"ray": RayPlacement, "factory": ..., "kwargs": ...,
    **options}`` as a :class:`RayPlan`; its stage is named ``"<name or factory>/<replica
    name>"``."""
    spec = dict(spec)
    placement = spec.pop("ray")
    factory = spec.pop("factory")
    kwargs = spec.pop("kwargs", None)
    base = spec.pop("name", None) or factory
    return RayPlan.make(factory, kwargs, placement=placement, name=f"{base}/{replica_name}", **spec)


def ray_specs(
    factory: str,
    kwargs: dict[str, Any] | None,
    replicas: int,
    placement: RayPlacement | Sequence[RayPlacement] | None,
    options: dict[str, Any],
) -> list[dict[str, Any]]:
    """The replica specs of ``launch_on_ray(...)``: one placement for every replica, or
    one per replica (e.g. the bundles of a placement group, in order). Checks the options
    once, before anything is placed: :class:`TypeError` for a count that is not an
    ``int``, :class:`ValueError` for fewer than one, as ``launch()``'s."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, got {type(replicas).__name__}")
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if placement is None or isinstance(placement, RayPlacement):
        placements = [placement or RayPlacement()] * replicas
    else:
        if isinstance(placement, (str, bytes)) or not all(
            isinstance(p, RayPlacement) for p in placement
        ):
            raise TypeError("placement must be a RayPlacement or a sequence of them")
        placements = list(placement)
        if len(placements) != replicas:
            raise ValueError(
                f"placement lists {len(placements)} placements for {replicas} replicas"
            )
    RayPlan.make(factory, kwargs, placement=placements[0], **options)  # checks, places nothing
    check_actor_options(placements[1:])  # (make() checked the first)
    return [{"ray": p, "factory": factory, "kwargs": kwargs, **options} for p in placements]
