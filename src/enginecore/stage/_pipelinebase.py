"""What the two pipelines share: :class:`PipelineStage`, the stage list's checks, and
:class:`PipelineBase`, the operations that never wait.

:class:`~._pipeline.Pipeline` (blocking) and :class:`~._apipeline.AsyncPipeline` (asyncio)
are one coordinator (:mod:`._pipeline_core`) behind two IO layers, as the two clients are
one :class:`~._session.ClientSession`: the stage list, the kwargs each stage is launched
with, the event handling, abort, health and names live here once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar

from . import _session, _shm, _wire
from ._clientbase import ClientBase
from ._edge import link_id, slot_token
from ._errors import (
    EngineDeadError,
    PipelineRequestError,
    StageClosedError,
    StageStartupError,
)
from ._launch import _validate_factory, at_exit, check_startup_timeout
from ._logs import check_log_level
from ._pipeline_core import PipelineCore, PipelineDeliveries
from ._pool_core import ReplicaState, RestartPolicy
from ._session import ClientSession, End, Parts, StageHealth, StreamCore, abort_ids
from ._watchdog import check_watchdog
from ._wire import Aborted, Credit, ErrorReport, Outputs, Replayed, check_encodable

if TYPE_CHECKING:
    from ._launch import TcpListen
    from .ray import RayPlacement, RayPlan

__all__ = [
    "PIPE_FACTORY",
    "LaunchLinks",
    "PipelineBase",
    "PipelineStage",
    "Retry",
    "check_drain",
    "check_startup_timeout",
    "check_timeout",
    "launch_options",
    "launch_plan",
    "named_startup_error",
    "new_shm_prefix",
    "pipe_kwargs",
    "retry_counts",
    "stage_specs",
]

logger = logging.getLogger("enginecore.stage")

DEFAULT_WINDOW: Final = 4096
"""A pipeline stage's default window to the next stage, in payloads."""

DEFAULT_WINDOW_BYTES: Final = 64 * 2**20
"""A pipeline stage's default window to the next stage, in bytes (64 MiB)."""

SHM_SWEEP_S: Final = 0.5
"""After a stage's death, when the parent unlinks the segments around it a second time."""

PIPE_FACTORY: Final = "enginecore.stage._pipe_stage:pipe_stage"
"""The factory every pipeline stage is launched with: it builds the user's engine and
wraps it (:mod:`._pipe_stage`)."""

_MAX_INT: Final = 2**63
"""The bound (exclusive) of a stage's int parameters: they travel to its process as
MessagePack integers."""

DEFAULT_REPLAY_BYTES: Final = 64 * 2**20
"""A :class:`Retry` edge's default bound on one request's replay log, in bytes (64 MiB)."""

S = TypeVar("S", bound=StreamCore)
C = TypeVar("C", bound=ClientBase[Any, Any])


@dataclass(frozen=True)
class Retry:
    """The failure policy of a pipeline's edge that retries: ``PipelineStage(...,
    on_next_error=Retry(n))``. When the next stage fails a request with a request-scoped
    error (its engine refused or failed it, its edge failed, its input could not be read),
    this stage sends it the request's inputs again, up to *times* times; the error after
    the last retry ends the request, naming the next stage (``"... (retried n times)"``).

    A retry happens only while nothing of the failed stage or a later one has reached the
    caller for the request (else the request fails at once: its outputs are not sent
    twice). This stage keeps a log of what it sent on for each request, until the request
    is over in the pipeline: a request whose logged payloads exceed *max_bytes* (an int
    >= 1, below 2**63, as ``window_bytes``; estimated:
    arrays' and bytes' sizes, strings' lengths) is not retryable, and fails as with
    ``"fail"``, saying why. A stage's death is not retried: it fails every request, as
    with ``"fail"``.
    """

    times: int
    max_bytes: int = DEFAULT_REPLAY_BYTES

    def __post_init__(self) -> None:
        for what in ("times", "max_bytes"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Retry {what} must be an int >= 1, got {value!r}")
            if value < 1:
                raise ValueError(f"Retry {what} must be an int >= 1, got {value!r}")
        if self.max_bytes >= _MAX_INT:  # it goes to the stage process, as window_bytes does
            raise ValueError(
                f"Retry max_bytes must be an int >= 1 (and below 2**63), got {self.max_bytes!r}"
            )


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a :class:`Pipeline`, as :meth:`Pipeline.launch` starts it.

    *factory* is the engine factory's import string (``"pkg.module:callable"``, as for
    :meth:`StageClient.launch`), called with *kwargs* in the stage process. *name* names the
    stage in errors, statistics and logs (default: the factory string, with ``[k]`` added
    when two stages share one). *edge* is the import string of the edge function to the next
    stage, ``edge(payload) -> (to_next, to_caller)``, called in this stage's process for each
    of its outputs; either side may be :data:`~enginecore.stage.NOTHING`. Without one, every
    output goes to the next stage. The last stage has no edge: its outputs go to the caller.

    *window* and *window_bytes* bound the edge to the next stage: the most payloads, and
    bytes of them, this stage has sent on that the next stage has not taken yet (``None``:
    no bound). While either is reached, this stage starts no step, so a slow stage holds
    its producer back instead of letting its input pile up; a step already started may
    overshoot by what it produces. *step_timeout*, *log_level* and *forward_logs* are
    :meth:`StageClient.launch`'s (and :meth:`AsyncStageClient.launch`'s).

    *shm_threshold*: a numpy array of at least this many bytes (and at least 1 KiB: a
    smaller one travels inside the message) that this stage sends the
    next one goes through shared memory (``/dev/shm``, Linux) instead of ZeroMQ, and the
    next stage gets a read-only array on that memory, no copy (``None``: never). The stage
    keeps at most *shm_pool_bytes* of reusable slots (an array that finds none free goes on
    ZeroMQ, counted as ``shm_fallbacks``). *shm_lease* (seconds) is how long a payload's
    lease lasts without renewal: the next stage renews it while it holds the array, and
    refuses a payload whose lease expired before it read it (an error for that request,
    ``SharedMemoryLeaseExpired``).

    *on_next_error* is the edge's failure policy, for a request the next stage fails with
    a request-scoped error: ``"fail"`` (the request ends with that error) or
    :class:`Retry` ``(n)`` (this stage sends the next one the request's inputs again, up
    to *n* times). The last stage has no next stage: only ``"fail"``.

    *replicas* (an ``int`` >= 1; default 1): the stage runs as that many processes, a
    **replica pool**. Each request goes through one replica of each stage, picked by the
    coordinator when the request is admitted (the one with the fewest requests in the
    pipeline routed there; ties in turn); data still goes stage to stage, over one link
    from each replica to each replica of the next stage, each with its own window. A
    replica's death ends only the requests routed through it, with an error naming the
    stage and the replica; the others go on, and new requests avoid it
    (``docs/pipelines.md``, "Replica pools as stages"). On an edge into or out of a pool,
    each link has its own shared-memory slots, *shm_pool_bytes* shared among a replica's
    links.

    *restart* (``True``, or a :class:`~enginecore.stage.RestartPolicy`; default
    ``False``): a process of this stage that died (a replica, or the stage's one process)
    is started again, with the same factory and options, after the policy's backoff
    (0.5 s, doubling with each death within 60 s, up to 30 s); after *max_failures* deaths
    within the window it is marked failed and stays out. Its requests end as without
    restart; new ones are routed to it once it is up again (``docs/pipelines.md``,
    "Restart"). A process placed on Ray starts again on Ray, with the same placement.
    *placement* (a :class:`~enginecore.stage.ray.RayPlacement`, or a sequence of them, one
    per replica; default ``None``: a local process): the stage (each of its replicas) runs
    in a Ray actor placed so, which binds
    TCP on its node with CURVE, as :func:`~enginecore.stage.ray.launch_on_ray` places a
    stage; the link into it from the stage before is a CURVE client that it admits, with
    the coordinator, and nothing else. No shared memory on a link into or out of it
    (*shm_threshold* does not apply there). A local stage after a stage on Ray listens on
    TCP with CURVE too, on this host's address as Ray sees it, so that the stage on Ray
    reaches it from any host; a local stage after a local one keeps ipc.
    ``docs/pipelines.md``, "Stages on other hosts".
    """

    factory: str
    kwargs: Mapping[str, Any] | None = None
    name: str | None = None
    edge: str | None = None
    step_timeout: float | None = 60.0
    log_level: int | str | None = None
    forward_logs: bool = False
    window: int | None = DEFAULT_WINDOW
    window_bytes: int | None = DEFAULT_WINDOW_BYTES
    shm_threshold: int | None = _shm.DEFAULT_THRESHOLD
    shm_pool_bytes: int = _shm.DEFAULT_POOL_BYTES
    shm_lease: float = _shm.DEFAULT_LEASE
    on_next_error: Literal["fail"] | Retry = "fail"
    replicas: int = 1
    restart: RestartPolicy | bool = False
    placement: RayPlacement | Sequence[RayPlacement] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str):
            raise TypeError(f"factory must be an import string, got {self.factory!r}")
        if self.kwargs is not None and not isinstance(self.kwargs, Mapping):
            raise TypeError(
                f"kwargs must be a mapping of the factory's keyword arguments or None, "
                f"got {self.kwargs!r}"
            )
        # As StageClient.launch checks them, with its errors: before any process of the
        # pipeline starts (the child would find them only after the later stages started).
        _validate_factory(self.factory)
        if self.kwargs is not None:
            check_encodable(dict(self.kwargs), "factory kwargs")
            if not all(type(k) is str for k in self.kwargs):
                raise TypeError("factory kwargs must have str keys")
        if self.placement is not None:
            from .ray import RayPlacement  # imports no Ray

            placement = self.placement
            if not isinstance(placement, RayPlacement):
                if not isinstance(placement, (list, tuple)) or not all(
                    isinstance(p, RayPlacement) for p in placement
                ):
                    raise TypeError(
                        f"placement must be a RayPlacement, a sequence of them (one per "
                        f"replica) or None, got {placement!r}"
                    )
                if len(placement) != self.replicas:
                    raise ValueError(
                        f"placement lists {len(placement)} placements for {self.replicas} replicas"
                    )
                object.__setattr__(self, "placement", tuple(placement))  # frozen, hashable
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if isinstance(self.shm_pool_bytes, bool) or not isinstance(self.shm_pool_bytes, int):
            raise TypeError(f"shm_pool_bytes must be an int >= 1, got {self.shm_pool_bytes!r}")
        if not 1 <= self.shm_pool_bytes < _MAX_INT:
            raise ValueError(
                f"shm_pool_bytes must be an int >= 1 (and below 2**63), got {self.shm_pool_bytes!r}"
            )
        if isinstance(self.shm_lease, bool) or not isinstance(self.shm_lease, (int, float)):
            raise TypeError(f"shm_lease must be seconds > 0, got {self.shm_lease!r}")
        if not 0 < self.shm_lease < 1e6:
            raise ValueError(f"shm_lease must be seconds > 0 (below 1e6), got {self.shm_lease!r}")
        for what in ("window", "window_bytes", "shm_threshold"):
            value = getattr(self, what)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):  # the wrong type
                raise TypeError(f"{what} must be an int >= 1 or None, got {value!r}")
            if not 1 <= value < _MAX_INT:
                raise ValueError(
                    f"{what} must be an int >= 1 or None (and below 2**63), got {value!r}"
                )
        # The stage options its process checks, checked here too: before any process of
        # the pipeline starts (the stages start last to first).
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        check_watchdog(self.step_timeout, None)
        check_log_level(self.log_level)
        if not isinstance(self.forward_logs, bool):  # "no" would be true
            raise TypeError(f"forward_logs must be a bool, got {type(self.forward_logs).__name__}")
        if not isinstance(self.restart, (bool, RestartPolicy)):
            raise TypeError(f"restart must be a bool or a RestartPolicy, got {self.restart!r}")
        policy = self.on_next_error
        if not isinstance(policy, Retry):
            if not isinstance(policy, str):
                raise TypeError(f"on_next_error must be 'fail' or Retry(n), got {policy!r}")
            if policy != "fail":
                raise ValueError(f"on_next_error must be 'fail' or Retry(n), got {policy!r}")
        if self.edge is not None and not isinstance(self.edge, str):
            raise TypeError(
                f"edge must be an import string 'pkg.module:fn' (it runs in the stage's "
                f"process), got {self.edge!r}"
            )


def stage_specs(stages: Sequence[PipelineStage | str]) -> list[PipelineStage]:
    """*stages* as :class:`PipelineStage` objects, each with its unique name."""
    if isinstance(stages, (str, PipelineStage)) or not stages:
        raise ValueError("a pipeline needs a sequence of one or more stages")
    specs = [s if isinstance(s, PipelineStage) else PipelineStage(s) for s in stages]
    for spec in specs[-1:]:
        if spec.edge is not None:
            raise ValueError(
                f"the last stage ({spec.name or spec.factory!r}) has no next stage, so no "
                f"edge: its outputs go to the caller"
            )
        if spec.on_next_error != "fail":
            raise ValueError(
                f"the last stage ({spec.name or spec.factory!r}) has no next stage, so no "
                f"on_next_error: {spec.on_next_error!r}"
            )
    names: list[str] = []
    keys: dict[str, str] = {}  # health()'s and stats()'s keys: a pool's are name[r]
    for k, spec in enumerate(specs):
        name = spec.name
        if name is None:
            name = spec.factory
            if sum(s.factory == spec.factory and s.name is None for s in specs) > 1:
                name = f"{spec.factory}[{k}]"
        elif not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        elif not name:
            raise ValueError("a stage's name must not be empty (None: the factory string)")
        if name in names:
            raise ValueError(f"two stages are named {name!r}")
        names.append(name)
        count = spec.replicas
        for key in [name] if count == 1 else [f"{name}[{r}]" for r in range(count)]:
            if key in keys:
                raise ValueError(
                    f"stage {name!r} and stage {keys[key]!r} would share the key {key!r} in "
                    f"health(), stats() and restarts (a pool's processes are name[r]): "
                    f"rename one"
                )
            keys[key] = name
    placed = [p for s in specs for r in range(s.replicas) if (p := placement_of(s, r))]
    if placed:  # every placement, before any stage is placed
        from .ray import check_actor_options

        check_actor_options(placed)
    return [dataclasses.replace(s, name=n) for s, n in zip(specs, names, strict=True)]


def retry_counts(specs: Sequence[PipelineStage]) -> list[int]:
    """Per stage, how many times a request it fails is replayed to it (its previous
    stage's :class:`Retry`; ``0``: ``"fail"``, and the first stage)."""
    counts = [0]
    for spec in specs[:-1]:
        policy = spec.on_next_error
        counts.append(policy.times if isinstance(policy, Retry) else 0)
    return counts


def credit_batch(window: int | None, default: int) -> int:
    """The credit a stage gives back to the previous one in one ``credit`` event after a
    step: a quarter of that stage's *window* (items or bytes; ``None``, no bound: a
    quarter of the *default*), at least 1 (:mod:`._pipe_stage`, "credits")."""
    return max(1, (default if window is None else window) // 4)


def restart_policy(spec: PipelineStage) -> RestartPolicy | None:
    """The stage's :class:`RestartPolicy` (``restart=True``: the default one), or ``None``."""
    if isinstance(spec.restart, RestartPolicy):
        return spec.restart
    return RestartPolicy() if spec.restart else None


def linked(a: PipelineStage, b: PipelineStage) -> bool:
    """Whether the edge from stage *a* to the next stage *b* has a pool of shared-memory
    slots per link, named after both processes (:func:`._shm.link_prefix`): an edge into or
    out of a replica pool, or of a stage that restarts (a restarted process's names carry
    its generation, :func:`._edge.slot_token`)."""
    return a.replicas > 1 or b.replicas > 1 or bool(a.restart) or bool(b.restart)


def link_slots(
    shm_prefix: str, index: int, consumer: int, consumer_gen: int, producer: int, producer_gen: int
) -> str:
    """The slot prefix of the link from replica *producer* (started *producer_gen* times
    before) of stage *index* to replica *consumer* of the next stage (likewise)."""
    return _shm.link_prefix(
        shm_prefix, index, slot_token(consumer, consumer_gen), slot_token(producer, producer_gen)
    )


def pipe_kwargs(
    spec: PipelineStage,
    downstream: str | list[str] | None,
    *,
    shm_prefix: str | None = None,
    index: int = 0,
    upstream: PipelineStage | None = None,
    replica: int = 0,
    routed: bool = False,
    downstream_spec: PipelineStage | None = None,
    generation: int = 0,
    next_generations: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The kwargs of :data:`PIPE_FACTORY` for replica *replica* of the stage *spec*,
    number *index*, whose next stage (*downstream_spec*) listens at *downstream* (``None``:
    the last stage; a list: the addresses of its replicas, a pool) and whose previous stage
    is *upstream* (``None``: the first). *shm_prefix*: the pipeline's shared-memory prefix
    (:func:`._shm.pipeline_prefix`; ``None``: no shared memory on this host); an edge into
    or out of a replica pool, or of a stage that restarts, has a pool of slots per link
    (:func:`linked`). *routed*: the pipeline has replica pools or stages that restart.
    *generation*: how many times this process was started before (a restart); per replica
    of the next stage, *next_generations* (default: none restarted). No shared memory on a
    link with an end placed on Ray (``placement``): its two ends may be on two hosts."""
    if spec.placement is not None or (
        downstream_spec is not None and downstream_spec.placement is not None
    ):
        shm_out = None
    else:
        shm_out = shm_prefix
    if upstream is not None and (upstream.placement is not None or spec.placement is not None):
        shm_in = None
    else:
        shm_in = shm_prefix
    kwargs: dict[str, Any] = {
        "factory": spec.factory,
        "stage": spec.name,
        "kwargs": dict(spec.kwargs or {}),
    }
    if spec.edge is not None:
        kwargs["edge"] = spec.edge
    if routed:
        kwargs["routed"] = True
        kwargs["replica"] = replica
    if downstream_spec is not None:
        pooled_out = linked(spec, downstream_spec)
    else:
        pooled_out = spec.replicas > 1 or (isinstance(downstream, list) and len(downstream) > 1)
    pooled_in = upstream is not None and linked(upstream, spec)
    if downstream is not None:
        if isinstance(downstream, list) and len(downstream) == 1:
            downstream = downstream[0]
        kwargs["downstream"] = downstream
        kwargs["window"] = spec.window
        kwargs["window_bytes"] = spec.window_bytes
        kwargs["link_id"] = link_id(
            index, generation, replica=replica if spec.replicas > 1 or spec.restart else None
        )
        if isinstance(spec.on_next_error, Retry):
            kwargs["replay_bytes"] = spec.on_next_error.max_bytes
        if routed and downstream_spec is not None and downstream_spec.restart:
            kwargs["next_restarts"] = True  # hold what goes to a dead process for its successor
            # The generation of each process its links go to: the routes name each request's.
            nlinks = 1 if isinstance(downstream, str) else len(downstream)
            kwargs["next_generations"] = list(next_generations or [0] * nlinks)
        if shm_out is not None and spec.shm_threshold is not None:
            if pooled_out:
                nlinks = 1 if isinstance(downstream, str) else len(downstream)
                gens = list(next_generations or [0] * nlinks)
                kwargs["shm_links"] = [
                    link_slots(shm_out, index, c, gens[c], replica, generation)
                    for c in range(nlinks)
                ]
            kwargs["shm_prefix"] = _shm.stage_prefix(shm_out, index)
            kwargs["shm_threshold"] = spec.shm_threshold
            kwargs["shm_pool_bytes"] = spec.shm_pool_bytes
            kwargs["shm_lease"] = float(spec.shm_lease)
    if upstream is not None:  # credit goes back in batches: a quarter window
        kwargs["credit_items"] = credit_batch(upstream.window, DEFAULT_WINDOW)
        kwargs["credit_bytes"] = credit_batch(upstream.window_bytes, DEFAULT_WINDOW_BYTES)
    if shm_in is not None and upstream is not None and upstream.shm_threshold is not None:
        kwargs["shm_upstream"] = _shm.stage_prefix(shm_in, index - 1)
        if pooled_in:  # this replica's slots on each link into it (_shm.link_prefix)
            kwargs["shm_upstream"] += f"{slot_token(replica, generation)}-"
            kwargs["shm_upstream_pooled"] = True
    return kwargs


def new_shm_prefix() -> str | None:
    """A new pipeline's shared-memory prefix, or ``None`` where there is no ``/dev/shm``."""
    return _shm.pipeline_prefix() if _shm.available() else None


def launch_plan(
    specs: Sequence[PipelineStage],
) -> list[tuple[int, int]]:
    """The order a pipeline starts its processes in: ``(stage, replica)``, the last stage
    first (each learns where the next one's replicas listen)."""
    return [(k, r) for k in reversed(range(len(specs))) for r in range(specs[k].replicas)]


def replica_name(spec: PipelineStage, replica: int) -> str:
    """The name of replica *replica* of the stage *spec*: its name, with ``[replica]``
    added in a pool."""
    name = spec.name or spec.factory
    return f"{name}[{replica}]" if spec.replicas > 1 else name


def named_startup_error(
    spec: PipelineStage, replica: int, exc: StageStartupError
) -> StageStartupError:
    """*exc*, the failed start of replica *replica* of the stage *spec*, with a message that
    names the pipeline's stage and its factory instead of :data:`PIPE_FACTORY` (the wrapper
    every stage process runs, which says nothing to the user)."""
    name = replica_name(spec, replica)
    what = f"pipeline stage {name!r}"
    if name != spec.factory:
        what = f"{what} (factory {spec.factory!r})"
    message = str(exc)
    named = message.replace(f"engine factory {PIPE_FACTORY!r}", what)
    named = named.replace(f"stage {PIPE_FACTORY!r}", what)
    if named == message:
        named = f"{what}: {message}"
    return StageStartupError(named, child_traceback=exc.child_traceback, exit_code=exc.exit_code)


def launch_options(
    specs: Sequence[PipelineStage], k: int, replica: int = 0, admitted: Sequence[bytes] = ()
) -> dict[str, Any]:
    """The *options* of a client's ``_launch`` for replica *replica* of the local stage
    *k* of *specs*: the stage's options, and ``listen`` (a :class:`~._launch.TcpListen`)
    for a stage that listens on TCP (:func:`listens_on_tcp`), which admits the
    coordinator's own key and *admitted* (the link keys of the stage before it, at a
    restart) from its start."""
    spec = specs[k]
    options: dict[str, Any] = {
        "name": replica_name(spec, replica),
        "step_timeout": spec.step_timeout,
        "log_level": spec.log_level,
        "forward_logs": spec.forward_logs,
    }
    if listens_on_tcp(specs, k):
        options["listen"] = tcp_listen(admitted)
    return options


def listens_on_tcp(specs: Sequence[PipelineStage], k: int) -> bool:
    """Whether stage *k* of *specs* listens on TCP with CURVE (its links in are CURVE
    clients, with link keys it admits): a stage placed on Ray, and a local stage whose
    previous stage is placed on Ray (which may run on another host). A local stage after a
    local one listens on ipc."""
    return specs[k].placement is not None or (k > 0 and specs[k - 1].placement is not None)


def tcp_listen(admitted: Sequence[bytes] = ()) -> TcpListen:
    """A :class:`~._launch.TcpListen` for a local stage that listens on TCP: this host's
    address as Ray sees it (``ray.util.get_node_ip_address()``, where a Ray stage reaches
    it), a server key pair and the coordinator's client key pair made here, the
    coordinator's key and *admitted* admitted."""
    import zmq

    from ._curve import CurveKeys, ServerCurve
    from ._launch import TcpListen
    from .ray import _import_ray

    host: str = _import_ray().util.get_node_ip_address()
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    server = ServerCurve(
        public_key=server_public,
        secret_key=server_secret,
        authorized=frozenset([public, *admitted]),
        authorized_dir="(the keys the pipeline's coordinator admits)",
    )
    return TcpListen(host, server, CurveKeys(public, secret, server_public))


StartPlan = tuple[dict[str, Any], "RayPlan | None", "bytes | None"]
"""How to start one process of a pipeline's stage: its :data:`PIPE_FACTORY` kwargs; its
:class:`~enginecore.stage.ray.RayPlan` if it is placed on Ray (else ``None``: a local
process, launched with :func:`launch_options`); and the public link key made here for a
local process whose next stage is on Ray, which that stage must admit before the process
starts (else ``None``; a stage on Ray's comes from its actor, through ``RayPlan.start``'s
*grant*, also for a local next stage, which then listens on TCP)."""


def start_plan(
    specs: Sequence[PipelineStage],
    k: int,
    r: int,
    next_clients: Sequence[Any],
    *,
    shm_prefix: str | None,
    routed: bool,
    startup_timeout: float,
    generation: int = 0,
    next_generations: Sequence[int] | None = None,
) -> StartPlan:
    """:data:`StartPlan` of replica *r* of stage *k* of *specs* (started *generation*
    times before), whose next stage's processes have the clients *next_clients* (their
    addresses, and their CURVE server keys for a next stage on Ray): at launch and at a
    restart alike. A link into a stage that listens on TCP (:func:`listens_on_tcp`) is a
    CURVE client, with link keys."""
    spec = specs[k]
    next_spec = specs[k + 1] if k + 1 < len(specs) else None
    downstream = [c.address for c in next_clients] if next_spec is not None else None
    kwargs = pipe_kwargs(
        spec,
        downstream,
        shm_prefix=shm_prefix,
        index=k,
        upstream=specs[k - 1] if k else None,
        replica=r,
        routed=routed,
        downstream_spec=next_spec,
        generation=generation,
        next_generations=next_generations,
    )
    curve_out = next_spec is not None and listens_on_tcp(specs, k + 1)
    if curve_out:
        kwargs["downstream_keys"] = [_server_key(c) for c in next_clients]
    if spec.placement is None:
        if curve_out:
            import zmq

            public, secret = zmq.curve_keypair()
            kwargs["link_keys"] = [public, secret]
            return kwargs, None, public
        return kwargs, None, None
    from .ray import RayPlan

    plan = RayPlan.make(
        PIPE_FACTORY,
        kwargs,
        placement=placement_of(spec, r),
        startup_timeout=startup_timeout,
        name=replica_name(spec, r),
        step_timeout=spec.step_timeout,
        log_level=spec.log_level,
        forward_logs=spec.forward_logs,
        link_kwarg="link_keys" if curve_out else None,
    )
    return kwargs, plan, None


class LaunchLinks:
    """How a pipeline's launch connects its stages, what :meth:`Pipeline.launch
    <._pipeline.Pipeline.launch>` and :meth:`AsyncPipeline.launch
    <._apipeline.AsyncPipeline.launch>` share: in :attr:`plan`'s order
    (:func:`launch_plan`), each process's :data:`StartPlan` (:meth:`process`), the keys
    to admit before it starts (:meth:`grant`), and what it tells the stage before it
    (:meth:`started`).

    A link into a stage that listens on TCP with CURVE (placed on Ray, or local after a
    stage on Ray: :func:`listens_on_tcp`) is a CURVE client: the stage before it has a key
    pair for its links, made here for a local stage (handed to its child process with its
    kwargs, on this host) or in the actor for a stage on Ray (``_StageActor.link_key``:
    only its public key comes back). The next stage was started first, admitting only the
    coordinator; before a process of the stage before it starts (and connects), the next
    stage's replicas are told to admit its link key too, with every link key of that stage
    so far (on Ray: :func:`~enginecore.stage.ray.authorize_clients`, the key rotation; a
    local stage: :meth:`Launched.authorize <._launch.Launched.authorize>`, over its death
    pipe), and answer once they do. It must be admitted first: libzmq (4.3.5) does not
    connect again a CURVE client whose key the ZAP handler refused. Every public link key
    is kept in :attr:`link_keys`, by ``(stage, replica)``, for the grants of a restart."""

    def __init__(self, specs: Sequence[PipelineStage], startup_timeout: float) -> None:
        self.specs = specs
        self.startup_timeout = startup_timeout
        self.prefix = new_shm_prefix()
        self.routed = any(spec.replicas > 1 or spec.restart for spec in specs)
        self.plan = launch_plan(specs)
        self.link_keys: dict[tuple[int, int], bytes] = {}
        self._next: list[Any] = []  # the clients of the stage started before (the next one)
        self._current: list[Any] = []  # the clients of the stage being started
        self._at = (0, 0)  # the process being started

    def process(self, k: int, r: int) -> StartPlan:
        """Replica *r* of stage *k*'s :data:`StartPlan`; a local key in it is to be
        :meth:`grant`-ed before the process starts."""
        self._at = (k, r)
        return start_plan(
            self.specs,
            k,
            r,
            self._next,
            shm_prefix=self.prefix,
            routed=self.routed,
            startup_timeout=self.startup_timeout,
        )

    def grant(self, key: bytes) -> list[tuple[Any, list[bytes]]]:
        """The process being started links with the public key *key*: the next stage's
        clients, each with the link keys it is to admit (besides the coordinator) before
        that process starts."""
        k, r = self._at
        self.link_keys[k, r] = key
        keys = [key for (j, _), key in self.link_keys.items() if j == k]
        return [(c, keys) for c in self._next]

    def started(self, k: int, r: int, client: Any) -> None:
        """Replica *r* of stage *k* started, with *client*."""
        self._current.append(client)
        if r == self.specs[k].replicas - 1:  # the stage before this one links to all of them
            self._next, self._current = self._current, []

    def unlink(self) -> None:
        """After a failed launch: no shared-memory segment of the pipeline is left."""
        if self.prefix is not None:
            _shm.unlink_prefix(self.prefix)


def placement_of(spec: PipelineStage, replica: int) -> RayPlacement | None:
    """Where replica *replica* of the stage *spec* is placed on Ray (``None``: a local
    process): its ``placement``, or that replica's of a sequence."""
    from .ray import RayPlacement  # imports no Ray

    placement = spec.placement
    if placement is None or isinstance(placement, RayPlacement):
        return placement
    return placement[replica]


def _server_key(client: Any) -> bytes:
    """The CURVE public key of the stage that listens on TCP that *client* owns: placed on
    Ray (a pipeline places its stages with CURVE, never ``insecure``), or a local one
    (:func:`listens_on_tcp`)."""
    curve = client._launched.curve  # RayStage.curve, Launched.curve: the client's keys
    assert curve is not None
    return bytes(curve.server_key)


def order_clients(specs: Sequence[PipelineStage], clients: Sequence[C]) -> list[C]:
    """*clients*, started in :func:`launch_plan`'s order (the last stage first, each
    stage's replicas in order), stage by stage in order."""
    ordered: list[C] = []
    start = len(clients)
    for spec in specs:
        ordered += clients[start - spec.replicas : start]
        start -= spec.replicas
    return ordered


def check_timeout(timeout: float) -> None:
    """:class:`TypeError` / :class:`ValueError` for a shutdown's *timeout* that is not a
    finite number of seconds >= 0, before anything stops, with a client's message: given
    to each stage's client, whose errors the shutdown suppresses (so that every stage is
    stopped), it would have left stages running, unseen (``None`` and ``inf`` did)."""
    _session.check_shutdown_timeout(timeout)


def check_drain(drain: float | None) -> None:
    """:class:`TypeError` / :class:`ValueError` for a drain that is not ``None`` or a finite
    number of seconds >= 0, with a client's message (an infinite one, refused by each
    stage's client, left every stage running)."""
    _session.shutdown_frame(drain)


class PipelineBase(Generic[S, C]):
    """The coordinator's state and the operations that never wait, for both pipelines.
    *clients* are the stages' clients, in order, each launched with :data:`PIPE_FACTORY`
    and the ordered event stream on; *lock* guards the core and the streams (a real lock
    for the blocking pipeline, a null one on the event loop)."""

    def __init__(
        self,
        clients: Sequence[C],
        names: Sequence[str],
        max_in_flight: int | None,
        max_bytes: int | None,
        lock: contextlib.AbstractContextManager[Any],
        shm_prefix: str | None = None,
        retry: Sequence[int] | None = None,
        replicas: Sequence[int] | None = None,
        specs: Sequence[PipelineStage] | None = None,
        startup_timeout: float = 60.0,
        link_keys: Mapping[tuple[int, int], bytes] | None = None,
    ) -> None:
        self._lock = lock
        # The public link keys of the processes whose next stage listens on TCP
        # (listens_on_tcp), by (stage, replica): what that stage admits
        # (LaunchLinks.link_keys; a restart replaces one).
        self._link_keys = dict(link_keys or {})
        self._shm_prefix = shm_prefix
        counts = [1] * len(names) if replicas is None else list(replicas)
        if specs is None:
            specs = [
                PipelineStage(n, name=n, replicas=c) for n, c in zip(names, counts, strict=True)
            ]
        self._specs = list(specs)
        self._startup_timeout = startup_timeout
        self._sweeps: list[threading.Timer] = []  # second unlinks after deaths, pending
        policies = [restart_policy(spec) for spec in self._specs]
        self._core: PipelineCore[S] = PipelineCore(
            names, max_in_flight, max_bytes, retry, counts, policies
        )
        # The stages that keep replay logs: those before a stage that is retried.
        self._loggers = [k - 1 for k, n in enumerate(self._core.retry) if n]
        self._clients = list(clients)  # every process, stage by stage, replica by replica
        if len(self._clients) != sum(counts):
            raise ValueError(f"{len(self._clients)} clients for {counts} replicas")
        self._replicas: list[list[C]] = []  # per stage, its replicas' clients
        start = 0
        for k, count in enumerate(counts):
            self._replicas.append(self._clients[start : start + count])
            start += count
            for r, client in enumerate(self._replicas[k]):
                # Whether it answers and chases tagged aborts (its welcome says so).
                features = getattr(client, "features", ())
                self._core.tagged(k, r, "tags" in features)
                self._core.generational(k, r, "gens" in features)
        # The stages of more than one process, with their replicas' clients (the lists
        # are _replicas', which a restart updates in place): routing avoids exited ones.
        self._pools = [(k, clients) for k, clients in enumerate(self._replicas) if len(clients) > 1]
        self._names = tuple(names)
        self._keys = [
            name if count == 1 else f"{name}[{r}]"
            for name, count in zip(self._names, counts, strict=True)
            for r in range(count)
        ]
        for key, client in zip(self._keys, self._clients, strict=True):
            client._session.label = f"pipeline stage {key!r}"  # its warnings say which
            client._pipeline_key = key  # client(): its request and event calls raise
        self._pooled = self._core.pooled
        self._closed = False
        # shutdown() went through to its end (_close_core): later aborts are refused, and
        # the blocking pipeline's next shutdown() returns at once.
        self._shutdown_done = False
        # What shutdown() returns: each process's exit code, by its key (_keys), as its
        # client's shutdown() gave it (None: unknown, or the stop failed).
        self._exit_codes: dict[str, int | None] = {}
        # A shutdown(drain=...) under way: its stages are drained one after the other, and
        # the one draining is alive though its client, closing, reads "dead" (health()).
        self._draining = False
        # A restart's link barrier under way: per restarted process (stage, replica), the
        # processes of the stage before it sent a ``link`` to it (_install, _started).
        self._linking: dict[tuple[int, int], list[int]] = {}
        # A restart waiting to link its new process in (_linkable): per process (stage,
        # replica), what wakes the wait; called once the core says it may, and at shutdown.
        self._link_waits: dict[tuple[int, int], Callable[[], None]] = {}

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages' names, in order."""
        return self._names

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` (or ``close()``, leaving the ``with`` block) has begun,
        as a client's and a pool's ``closed``. Never blocks."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """Requests in the pipeline now (each holds its place in the budget until it is
        over in every stage)."""
        with self._lock:
            return self._core.in_flight

    @property
    def replicas(self) -> tuple[int, ...]:
        """How many processes each stage runs, in order (1, or a replica pool's size)."""
        return self._core.replicas

    def _stage_index(self, stage: str) -> int:
        try:
            return self._names.index(stage)
        except ValueError:
            stages = list(self._names)
            raise KeyError(f"no stage named {stage!r}; the stages are {stages}") from None

    def client(self, stage: str, replica: int = 0) -> C:
        """The pipeline's own client of the stage named *stage* (for what the pipeline does
        not wrap): of its replica *replica*, in a replica pool. :class:`KeyError` for an
        unknown name, :class:`IndexError` for a replica it does not have.

        Its utilities, ``stats()``, ``health()``, ``load()``, properties and
        ``shutdown()`` / ``close()`` work as on any client (a stage stopped through it is,
        for the pipeline, a stage that died). Its request and event calls (``add``,
        ``add_many``, ``abort``, ``get_event``, ``get_events``, ``events``) raise
        :class:`RuntimeError` at once: the pipeline reads every event of the stage and
        tracks each request through every stage, so they could only bypass it and hang.
        Use the pipeline's ``add``, ``add_many`` and ``abort``, and its streams."""
        replicas = self._replicas[self._stage_index(stage)]
        if isinstance(replica, bool) or not isinstance(replica, int):
            raise TypeError(f"replica must be an int, got {replica!r}")
        if not 0 <= replica < len(replicas):
            last = f"0..{len(replicas) - 1}" if len(replicas) > 1 else "0"
            raise IndexError(
                f"stage {stage!r} has no replica {replica} (it has {len(replicas)}: {last})"
            )
        return replicas[replica]

    def _utility_clients(self, stage: str, replica: int | None) -> tuple[list[C], bool]:
        """The clients a ``call_utility`` of *stage* goes to, and whether it answers a list
        (a replica pool's, without *replica*: one answer per replica).
        :class:`~enginecore.stage.StageClosedError` once :meth:`shutdown` has begun (a
        drain under way included), as a closing client's ``call_utility()`` raises: the
        pipeline's, not a stage client's."""
        if self._closed:
            raise StageClosedError("the pipeline was shut down")
        if replica is not None:
            return [self.client(stage, replica)], False
        replicas = self._replicas[self._stage_index(stage)]
        return list(replicas), len(replicas) > 1

    def health(self) -> dict[str, StageHealth]:
        """Each stage's health, by name (a replica pool's replicas as ``name[r]``): its
        client's, or :attr:`StageHealth.RESTARTING` for a process that died and is being
        started again, or waits for its restart's backoff (its stage restarts). During
        ``shutdown(drain=...)``, a process still draining reads ``OK`` (its client, closing,
        would say ``DEAD``); one that has stopped, or died, reads ``DEAD``. Never blocks.

        A process's client sees it die before the pipeline's coordinator hears of it (the
        client's event sink hands the end over next, on the thread that read it): a client
        that reads ``DEAD`` while the coordinator thinks its process live has its events
        handed over here first, so the health read is the coordinator's (``RESTARTING`` for
        a process to be started again, and then ``add`` knows it too), never a passing
        ``DEAD``."""
        core = self._core
        if self._hands_over_deaths():
            with self._lock:
                unheard = (
                    [
                        (k, r, client)
                        for k, clients in enumerate(self._replicas)
                        for r, (client, alive) in enumerate(
                            zip(clients, core.alive(k), strict=True)
                        )
                        if alive
                    ]
                    if core.failure is None and not self._closed
                    else []
                )
            for k, r, client in unheard:
                if client.health() is StageHealth.DEAD:
                    self._take_events(k, r, client)
        with self._lock:  # which processes are coming back (the clients' health: unlocked)
            pending = core.failure is None and not self._closed
            draining = self._draining
            each = [
                (client, pending and core.coming(k, r), alive)
                for k, clients in enumerate(self._replicas)
                for r, (client, alive) in enumerate(zip(clients, core.alive(k), strict=True))
            ]
        # The process draining now: the last whose client closed (the drain closes them
        # in order, each once the one before it has stopped), while alive.
        now = -1
        if draining:
            closed = [i for i, (client, _, _) in enumerate(each) if client.closed]
            if closed:
                client, _, alive = each[closed[-1]]
                if alive and client.exit_code is None:
                    now = closed[-1]
        health: dict[str, StageHealth] = {}
        for i, (key, (client, coming, _)) in enumerate(zip(self._keys, each, strict=True)):
            if coming:
                health[key] = StageHealth.RESTARTING
            elif i == now:
                health[key] = StageHealth.OK  # its own health() is "dead" while it closes
            else:
                health[key] = client.health()
        return health

    @property
    def restarts(self) -> dict[str, int]:
        """How many times each stage process was started again (a stage with ``restart``),
        by name, as :meth:`health`'s keys: every try counts, a start that failed too."""
        core = self._core
        with self._lock:
            counts = [core.restarts(k, r) for k, n in enumerate(core.replicas) for r in range(n)]
        return dict(zip(self._keys, counts, strict=True))

    @property
    def bytes_in(self) -> int:
        """The bytes of the requests in the pipeline now: the size of the frames that
        brought them to the first stage (a burst's shared evenly among its requests)."""
        with self._lock:
            return self._core.bytes_in

    def _frame(self, items: list[tuple[str, Any]], many: bool) -> tuple[list[str], Parts, int]:
        """The frame that adds *items* to the first stage, its ids and its size, checked
        against the budget: :class:`TypeError` for a bad pair, id or payload,
        :class:`ValueError` for a repeated id or an add bigger than the whole budget."""
        if many:
            ids, parts = ClientSession.adds_frame(items)
        else:
            ((rid, data),) = items
            ids, parts = [rid], ClientSession.add_frame(rid, data)
        nbytes = sum([len(p) if p.__class__ is bytes else memoryview(p).nbytes for p in parts])
        self._core.check_size(len(ids), nbytes)
        return ids, parts, nbytes

    def _check_open(self) -> bool:
        """Before an add: :class:`~enginecore.stage.StageClosedError` once :meth:`shutdown`
        has begun (a drain under way included: the stages' clients are closing), unless the
        pipeline failed first (its failure is raised, by the core's check). Returns
        ``False``, for use in a loop's condition."""
        if self._closed and self._core.failure is None:
            raise StageClosedError("the pipeline was shut down")
        return False

    def _open_and_send(
        self,
        ids: list[str],
        streams: Sequence[S],
        parts: Parts,
        nbytes: int,
        many: bool,
        items: list[tuple[str, Any]] | None = None,
    ) -> tuple[BaseException | None, PipelineDeliveries[S]] | None:
        """Admit *ids* and send the frame of :meth:`_frame` to the first stage, with the
        lock held (after :meth:`PipelineCore.admissible`): an abort of one of them, which
        takes the same lock, is then sent after the add, never before it. If the send fails,
        the requests leave the pipeline again, and the error is returned with the
        deliveries to carry out outside the lock (:meth:`_failed_send`). A first stage
        whose client the user shuts down (``pipe.client(stage).shutdown(drain=...)``, the
        pipeline still open: its own shutdown sets ``_closed`` under this lock) refuses
        them as a later stage that drains does: each stream ends with that stage's
        :class:`~enginecore.stage.PipelineRequestError` (no error is returned then)."""
        core = self._core
        core.open_many(ids, streams, nbytes, self._exited() if self._pools else ())
        sent: list[str] = []
        try:
            if self._pooled:
                self._send_routed(ids, parts, many, items, sent)
            elif many:
                self._clients[0]._send_requests(ids, parts, False)
            else:
                self._clients[0]._send_request(ids[0], parts, False)
        except BaseException as exc:
            d: PipelineDeliveries[S] = PipelineDeliveries()
            now = time.monotonic()
            refused = isinstance(exc, StageClosedError) and not self._closed
            message = _wire.DRAINING if refused else f"the add failed: {exc!r}"
            if sent:
                # A burst split over the first stage's replicas, whose part to one replica
                # went before the send to another failed: all or nothing, so that part ends
                # as the rest does, and is aborted where it runs (its id and place kept
                # until every stage has applied the abort, as for a refused request).
                core.withdraw(sent, message, now, d, exc)
                gone = set(sent)
                unsent = [rid for rid in ids if rid not in gone]
            else:
                unsent = ids
            core.forget(unsent, d)
            if refused:
                # The stage's own words for a refused add while it drains.
                for rid, stream in zip(ids, streams, strict=True):
                    if stream._end is None:  # (a withdrawn one has ended already)
                        error = PipelineRequestError(rid, core.stages[0], message)
                        error.__cause__ = exc
                        stream._end_with(End(error), now)  # new: no one waits on it yet
                return None, d
            return exc, d
        return None

    def _exited(self) -> list[tuple[int, int]]:
        """The processes of pool stages whose exit their client has seen, but whose death
        it has not reported yet (it first reads their last frames, for up to the exit's
        grace): new requests are not routed to them (:meth:`PipelineCore.open`), as a
        :class:`~enginecore.stage.StagePool` takes an exited replica out of its routing at
        once."""
        return [
            (k, r)
            for k, clients in self._pools
            for r, client in enumerate(clients)
            if client._session.exited
        ]

    def _send_routed(
        self,
        ids: list[str],
        parts: Parts,
        many: bool,
        items: list[tuple[str, Any]] | None,
        sent: list[str],
    ) -> None:
        """Replica pools: each request to its route's replica of the first stage, right
        after a ``route`` message with the rest of its route (``docs/wire.md`` section 8).
        A burst split over replicas goes as one ``adds`` frame per replica; *sent* gets the
        ids of each frame that went, so that a failed send later can withdraw them."""
        core = self._core
        groups: dict[int, list[int]] = {}
        routes: list[tuple[int, ...]] = []
        for i, rid in enumerate(ids):
            route = core.route(rid)
            assert route is not None
            routes.append(route)
            groups.setdefault(route[0], []).append(i)
        for r, picked in groups.items():
            client = self._replicas[0][r]
            g_ids = [ids[i] for i in picked]
            rests = [core.wire_route(routes[i], 1) for i in picked]
            client._send(ClientSession.route_frame(g_ids, rests))
            if len(groups) == 1:
                g_parts = parts
            else:
                assert items is not None
                _, g_parts = ClientSession.adds_frame([items[i] for i in picked])
            if many:
                client._send_requests(g_ids, g_parts, False)
            else:
                client._send_request(g_ids[0], g_parts, False)
            sent += g_ids

    def _failed_send(self, failed: tuple[BaseException | None, PipelineDeliveries[S]]) -> None:
        """Outside the lock: carry out what :meth:`_open_and_send` returned, and raise its
        error (if any: the streams may have ended with theirs)."""
        exc, d = failed
        self._deliver(d)
        if exc is not None:
            raise exc

    def _check_shut_down(self) -> None:
        """Before ``stats()``: :class:`~enginecore.stage.StageClosedError` once
        :meth:`shutdown` has stopped every stage, as a closed client's and a closed pool's
        ``stats()`` raise (during a drain, each stage's entry is its client's answer)."""
        if self._shutdown_done:
            raise StageClosedError("the pipeline was shut down")

    def _abort(self, req_ids: Sequence[str]) -> None:
        ids = abort_ids(req_ids)
        if self._shutdown_done:  # as a closed client's: nothing could take it
            raise StageClosedError("the pipeline was shut down")
        d: PipelineDeliveries[S] = PipelineDeliveries()
        with self._lock:
            self._core.abort(ids, d)
        self._deliver(d)

    def _deliver(self, d: PipelineDeliveries[S]) -> None:
        """Carry out what the core decided, outside the lock: wake streams, send aborts to
        the first stage, wake adds that wait for room."""
        raise NotImplementedError

    def _stop_waves(self, drain: bool) -> list[tuple[int | None, list[tuple[str, C]]]]:
        """What a shutdown stops together, in order: ``(stage, [(name, client), ...])``.
        Without *drain*, every process at once (stage ``None``): nothing is owed to a
        request, and one after the other a pipeline of N stages took N stops. With it,
        stage by stage, first to last (each stage drains what the one before sent it),
        the replicas of a stage at once (they share the drain's deadline)."""
        named = list(zip(self._keys, self._clients, strict=True))
        if not drain:
            return [(None, named)]
        waves: list[tuple[int | None, list[tuple[str, C]]]] = []
        start = 0
        for k, clients in enumerate(self._replicas):
            waves.append((k, named[start : start + len(clients)]))
            start += len(clients)
        return waves

    def _shutdown_result(self) -> dict[str, int | None]:
        """``shutdown()``'s result: every process's exit code, by its key, in order."""
        return {key: self._exit_codes.get(key) for key in self._keys}

    def _stage_stopped(self, k: int) -> None:
        """During ``shutdown(drain=...)``: every process of stage *k* has drained and
        stopped (or its client gave up on it and killed it), after every stage before it.
        Its last events are the core's already (each client hands its events over as it
        reads them, its end included); the core then counts it as having applied every
        abort, sends what would go to the first stage to stage ``k + 1`` from now on, and
        sends there again the aborts that stage *k* never applied
        (:meth:`PipelineCore.stopped`)."""
        for r in range(len(self._replicas[k])):
            self._take_events(k, r)  # (nothing left, as a rule: its reader took them)
        d: PipelineDeliveries[S] = PipelineDeliveries()
        with self._lock:
            self._core.stopped(k, time.monotonic(), d)
        self._deliver(d)

    def _close_core(self) -> None:
        """Every stage is stopped: streams still open end with
        :class:`~enginecore.stage.StageClosedError`, and no shared-memory segment of the
        pipeline is left (a stage unlinks its own at exit; this covers a killed one)."""
        self._draining = False  # every stage has stopped
        sweeps, self._sweeps = self._sweeps, []
        for timer in sweeps:  # no thread left behind: the unlink below covers theirs
            timer.cancel()
            timer.join(1.0)
        if self._shm_prefix is not None:
            _shm.unlink_prefix(self._shm_prefix)
        d: PipelineDeliveries[S] = PipelineDeliveries()
        with self._lock:
            self._core.close(StageClosedError("the pipeline was shut down"), time.monotonic(), d)
        self._deliver(d)
        # Only now: a shutdown interrupted before here (Ctrl-C while a stage drains) left
        # stages running, and the next call stops them (each step is idempotent).
        self._shutdown_done = True

    def _send_aborts(self, d: PipelineDeliveries[S]) -> None:
        """To a dead stage's neighbours, that it is gone (first: the stage after it drops
        its late data before it applies the aborts); to the first stage (the abort chases
        the data from there), and to a stage after a dead one; a replay to the stage before
        one that failed a request, and the releases of done requests to the stages that keep
        replay logs. A stage that is gone has its failure end every request anyway."""
        replicas = self._replicas
        for k, r, side, dead, dead_r in d.gone:
            with contextlib.suppress(Exception):
                replicas[k][r]._send(self._gone_frame(side, dead, dead_r))
        if not self._pooled:
            # Sent as they are (the coordinator, not the client, awaits their answers): also
            # to a stage whose client closes, which a drain leaves applying aborts. (Once a
            # drain has stopped the first stages, the core sends "the first stage's" aborts
            # to the first one still running, as stage_aborts: PipelineCore.stopped.)
            if d.aborts:
                with contextlib.suppress(Exception):
                    self._clients[0]._send(ClientSession.abort_frame(d.aborts))
            for k, req_ids in d.stage_aborts:
                with contextlib.suppress(Exception):
                    self._clients[k]._send(ClientSession.abort_frame(req_ids))
            for k, rid, attempt in d.replays:  # a gone stage: its failure ends the request
                with contextlib.suppress(Exception):
                    self._clients[k]._send(ClientSession.replay_frame(rid, attempt))
            if d.releases:
                for k in self._loggers:
                    with contextlib.suppress(Exception):
                        self._clients[k]._send(ClientSession.release_frame(d.releases))
            return
        # Replica pools: each to the replica on the request's route, an abort with the rest
        # of the route, which it chases along.
        routes = d.routes
        if d.aborts:
            self._send_routed_aborts(0, d.aborts, routes)
        for k, req_ids in d.stage_aborts:
            self._send_routed_aborts(k, req_ids, routes, d.tags)
        for k, rid, attempt in d.replays:  # (of a live request: no dead process on its route)
            route = routes.get(rid)
            with contextlib.suppress(Exception):
                client = replicas[k][route[k] if route else 0]
                client._send(ClientSession.replay_frame(rid, attempt))
        if d.releases:
            for k in self._loggers:
                by: dict[int, list[str]] = {}
                for rid in d.releases:
                    route = routes.get(rid)
                    by.setdefault(route[k] if route else 0, []).append(rid)
                for r, ids in by.items():  # (done while live: no dead process on its route)
                    with contextlib.suppress(Exception):
                        replicas[k][r]._send(ClientSession.release_frame(ids))

    def _gone_frame(self, side: str, dead: int, dead_r: int) -> Parts:
        """The ``gone`` that tells a neighbour of process *dead_r* of stage *dead* it died:
        on the ``"previous"`` side, naming that process's link (its generation's)."""
        if side == "previous":
            core = self._core
            pool = core.replicas[dead] > 1 or core.restart[dead] is not None
            link = link_id(dead, core.generation(dead, dead_r), replica=dead_r if pool else None)
            return ClientSession.gone_frame(side, link)
        return ClientSession.gone_frame(side, "", dead_r)

    def _send_routed_aborts(
        self,
        k: int,
        req_ids: list[str],
        routes: Mapping[str, tuple[int, ...]],
        tags: Mapping[tuple[int, str], int] | None = None,
    ) -> None:
        """Abort *req_ids* from stage *k* on: each at its route's replica, with the rest of
        its route (a gone replica's failure ends its requests anyway), and its tag if
        *tags* names one (``(k, id)``: an abort after a death, docs/wire.md section 8). A
        route's ``-1`` is a stage whose process on it died: nothing is sent there, and the
        stages chase the abort no further than the stage before it."""
        by: dict[tuple[int, int | None], tuple[list[str], list[list[Any]]]] = {}
        core = self._core
        for rid in req_ids:
            route = routes.get(rid)
            r = route[k] if route else 0
            if r < 0:
                continue
            tag = tags.get((k, rid)) if tags else None
            ids, rests = by.setdefault((r, tag), ([], []))
            ids.append(rid)
            rests.append(core.wire_route(route, k + 1) if route else [])
        for (r, tag), (ids, rests) in by.items():
            with contextlib.suppress(Exception):
                self._replicas[k][r]._send(ClientSession.abort_frame(ids, rests, tag))

    def _unlink_dead(self, k: int, r: int = 0) -> None:
        """Stage *k* (its replica *r*) is gone: unlink its shared-memory segments (a killed
        stage could not), and those of the stage before it, which sent it payloads it can no
        longer release (on an edge into or out of a replica pool: only the links to and from
        that replica, :func:`._shm.link_prefix`).
        Again :data:`SHM_SWEEP_S` later, on a timer thread: the stage before it may have
        made more before the abort of its requests reached it. A name's memory goes with
        the last mapping: the live neighbours let go of theirs when told the stage is gone
        (:meth:`_send_aborts`); the pipeline takes no more requests, and its shutdown
        unlinks the rest."""
        prefix = self._shm_prefix
        assert prefix is not None
        specs = self._specs
        token = slot_token(r, self._core.generation(k, r))  # the dead process's
        prefixes: list[str] = []
        own: str | None = None
        if k > 0:  # the previous stage's slots for it
            prefixes.append(_shm.stage_prefix(prefix, k - 1))
            if linked(specs[k - 1], specs[k]):
                prefixes[-1] += f"{token}-"
        if k + 1 < len(specs) and linked(specs[k], specs[k + 1]):  # its own, per link
            own = _shm.stage_prefix(prefix, k)
        else:
            prefixes.append(_shm.stage_prefix(prefix, k))

        def sweep() -> None:
            for prefix in prefixes:
                _shm.unlink_prefix(prefix)
            if own is not None:
                _shm.unlink_producer(own, token)

        sweep()
        timer = threading.Timer(SHM_SWEEP_S, sweep)
        timer.name = "enginecore-pipeline-shm-sweep"
        timer.daemon = True
        self._sweeps = [t for t in self._sweeps if t.is_alive()]
        self._sweeps.append(timer)  # shutdown cancels it: its own unlink covers the rest
        timer.start()

    # -- restarts (PipelineStage(restart=...)) -------------------------------------------------

    def _schedule_restart(self, k: int, r: int, delay: float) -> None:
        """Start process *r* of stage *k* again after *delay* seconds, and again after each
        failed start (its policy's backoff), until it is up, fails for good or the
        pipeline closes: a thread of the blocking pipeline, a task of the async one."""
        raise NotImplementedError

    def _restart_plan(self, k: int, r: int, generation: int) -> StartPlan:
        """The :data:`StartPlan` that starts process *r* of stage *k* again, as its
        *generation*-th restart: the same factory and options (on Ray if it is placed
        there), its links to the current addresses of the next stage's processes."""
        core = self._core
        next_clients: list[C] = []
        next_gens: list[int] | None = None
        if k + 1 < len(self._specs):
            next_clients = list(self._replicas[k + 1])
            next_gens = [core.generation(k + 1, c) for c in range(core.replicas[k + 1])]
        return start_plan(
            self._specs,
            k,
            r,
            next_clients,
            shm_prefix=self._shm_prefix,
            routed=True,
            startup_timeout=self._startup_timeout,
            generation=generation,
            next_generations=next_gens,
        )

    def _grants(self, k: int, r: int, key: bytes) -> list[tuple[C, list[bytes]]]:
        """Process *r* of stage *k*, about to start again, links with the public key *key*
        (its next stage listens on TCP, :func:`listens_on_tcp`): each live process of the
        next stage, with the keys it is to admit from now on (this stage's, the dead
        process's replaced by *key*)."""
        with self._lock:
            self._link_keys[k, r] = key
            keys = [key for (j, _), key in self._link_keys.items() if j == k]
            alive = self._core.alive(k + 1)
            return [(c, keys) for c, up in zip(self._replicas[k + 1], alive, strict=True) if up]

    def _admitted(self, k: int) -> list[bytes] | None:
        """What a process of stage *k* that listens on TCP (:func:`listens_on_tcp`), started
        again, must admit before the stage before it links to it: that stage's link keys
        (``None``: *k* listens on ipc, or is the first stage)."""
        if k == 0 or not listens_on_tcp(self._specs, k):
            return None
        with self._lock:
            return [key for (j, _), key in self._link_keys.items() if j == k - 1]

    def _linkable(self, k: int, r: int) -> bool:
        """Whether the new process *r* of stage *k* may be linked in now
        (:meth:`PipelineCore.linkable`: the stage before it has answered for every request
        the dead process held, so nothing of them can follow the new ``link`` to it), or
        the pipeline closes (the wait is over; :meth:`_started` then refuses)."""
        with self._lock:
            return self._closed or self._core.linkable(k, r)

    def _link_wait(self, k: int, r: int, wake: Callable[[], None] | None) -> None:
        """Register *wake* (``None``: remove it) for the restart of process *r* of stage *k*
        that waits until :meth:`_linkable`: called from :meth:`_take_events` once it is,
        and at shutdown (:meth:`_wake_link_waits`)."""
        with self._lock:
            if wake is None:
                self._link_waits.pop((k, r), None)
            else:
                self._link_waits[k, r] = wake

    def _wake_link_waits(self, every: bool = False) -> None:
        """Wake each restart waiting to link its new process in that may now (*every*: all
        of them, as the pipeline closes)."""
        with self._lock:
            if not self._link_waits:
                return
            core = self._core
            ready = [
                wake
                for (k, r), wake in self._link_waits.items()
                if every or self._closed or core.linkable(k, r)
            ]
        for wake in ready:
            wake()

    def _unlinkable(self, k: int, r: int) -> TimeoutError:
        """What ends a restart whose wait for :meth:`_linkable` outlasted the startup
        timeout: a failed start (the new process is stopped, and started again after the
        policy's backoff)."""
        return TimeoutError(
            f"the stage before {self._names[k]!r} did not answer for the requests of its dead "
            f"process {r} within the startup timeout ({self._startup_timeout} s): the new "
            f"process is not linked in"
        )

    def _install(self, k: int, r: int, client: C) -> list[C]:
        """Put *client*, of process *r* of stage *k* started again, in place of the dead
        one's (from now on only its events are heard, on its receiver), and send what links
        it in: a ``gone`` ``"next"`` to it for each process of the next stage that is down,
        a ``link`` to each live process of the previous stage, naming its address, the
        link's new slots and, on TCP (:func:`listens_on_tcp`), its CURVE server key.
        Returns those previous-stage clients: the link is up once each answers a
        :data:`._edge.LINKS_UTILITY` call after the ``link`` (its loop applies messages in
        order), which the caller awaits, then :meth:`_started`."""
        specs, core = self._specs, self._core
        generation = core.generation(k, r)
        client._event_sink = functools.partial(self._take_events, k, r, client)
        i = sum(core.replicas[:k]) + r
        client._session.label = f"pipeline stage {self._keys[i]!r}"
        client._pipeline_key = self._keys[i]
        with self._lock:
            self._replicas[k][r] = client
            self._clients[i] = client
            features = getattr(client, "features", ())
            core.tagged(k, r, "tags" in features)
            core.generational(k, r, "gens" in features)
        self._take_events(k, r, client)  # anything that came before the sink was set
        sends: list[tuple[C, Parts]] = []
        if k + 1 < len(specs):
            for c, up in enumerate(core.alive(k + 1)):
                if not up:
                    sends.append((client, ClientSession.gone_frame("next", "", c)))
        barrier: list[C] = []
        linked_from: list[int] = []
        if k > 0:
            prefix = self._shm_prefix
            placed = specs[k - 1].placement is not None or specs[k].placement is not None
            shm = prefix is not None and specs[k - 1].shm_threshold is not None and not placed
            # A process on TCP has CURVE: the link is a CURVE client of its key.
            tcp = listens_on_tcp(specs, k)
            server_key = _server_key(client).decode() if tcp else ""
            for j, up in enumerate(core.alive(k - 1)):
                if not up:
                    continue
                slots = ""
                if shm:
                    assert prefix is not None
                    slots = link_slots(prefix, k - 1, r, generation, j, core.generation(k - 1, j))
                before = self._replicas[k - 1][j]
                # The new process's generation, to a process that tells routes by it.
                gen = generation if core.says_generations(k - 1, j) else None
                frame = ClientSession.link_frame(r, client.address, slots, server_key, gen)
                sends.append((before, frame))
                barrier.append(before)
                linked_from.append(j)
        with self._lock:
            self._linking[k, r] = linked_from
        for target, frame in sends:
            with contextlib.suppress(Exception):  # a process that died: its death tells
                target._send(frame)
        return barrier

    def _started(self, k: int, r: int) -> bool:
        """Process *r* of stage *k* is up again and linked in: routed to from now on.
        ``False``: the pipeline failed or closes meanwhile (stop the new process).

        A neighbour that died while the new process was being linked in (after
        :meth:`_install`, before this) was not told to it then: the core tells only live
        processes that a process is gone, and the new one is not live until now. So it is
        told here, in the same hold of the lock that makes it live (a later death is told
        to it as to any process): each process of the next stage that is down (``gone``
        ``"next"``, its link closed; one down at :meth:`_install` was told then, and is
        told again, which changes nothing), and each process of the previous stage that
        was sent the ``link`` and has died since (``gone`` ``"previous"``, naming its
        link). Its restart, if any, waits for this one (restarts are made one at a time),
        so these ``gone`` reach the new process before any ``link`` from that restart."""
        core = self._core
        frames: list[Parts] = []
        with self._lock:
            linked_from = self._linking.pop((k, r), [])
            if self._closed or not core.started(k, r):
                return False
            if k > 0:
                before = core.alive(k - 1)
                frames += [
                    self._gone_frame("previous", k - 1, j) for j in linked_from if not before[j]
                ]
            if k + 1 < len(self._specs):
                after = core.alive(k + 1)
                frames += [
                    self._gone_frame("next", k + 1, c) for c, up in enumerate(after) if not up
                ]
            client = self._replicas[k][r]
        for frame in frames:
            with contextlib.suppress(Exception):  # the new process died: its death tells
                client._send(frame)
        logger.warning(
            "enginecore: pipeline stage %r, process %d, started again", self._names[k], r
        )
        return True

    def _start_failed(self, k: int, r: int, exc: BaseException) -> float | None:
        """Starting process *r* of stage *k* again failed with *exc*: the delay before the
        next try, or ``None`` (it failed for good; its stage may be dead now)."""
        d: PipelineDeliveries[S] = PipelineDeliveries()
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
        with self._lock:
            delay = self._core.start_failed(k, r, dead, time.monotonic(), d)
        self._deliver(d)
        if delay is None:
            logger.error(
                "enginecore: pipeline stage %r, process %d, did not start again (%s); it stays out",
                self._names[k],
                r,
                exc,
            )
        else:
            logger.warning(
                "enginecore: pipeline stage %r, process %d, did not start again (%s); next "
                "try in %.3g s",
                self._names[k],
                r,
                exc,
                delay,
            )
        return delay

    def _link_failed(self, k: int, r: int, exc: BaseException) -> None:
        """Linking the new process *r* of stage *k* in raised *exc* (not a neighbour's
        death or silence, which :meth:`_link_unconfirmed` takes): say so, with the
        traceback. The caller stops the new process, which is then a failed start: its
        death, if its client was put in place (:meth:`_install`), is heard as a death while
        starting, else :meth:`_unheard_start` counts it."""
        with self._lock:
            self._linking.pop((k, r), None)
        logger.error(
            "enginecore: pipeline stage %r, process %d, started again, but linking it in "
            "failed; it is stopped, as a failed start",
            self._names[k],
            r,
            exc_info=exc,
        )

    def _unheard_start(self, k: int, r: int, exc: BaseException) -> float | None:
        """After :meth:`_link_failed` stopped the new process *r* of stage *k*: if its death
        was not heard (still ``starting``: its client was not put in place, or its end was
        not taken as a death), count it as a failed start here (:meth:`_start_failed`):
        the delay before the next try, or ``None`` (no try left, or the death was heard,
        and that death's own restart, if any, takes over). Its live neighbours are told it
        is gone, as after a death (the previous stage's processes may have linked to it)."""
        with self._lock:
            if self._core.process_state(k, r) is not ReplicaState.STARTING:
                return None
            gone = self._gone_to_neighbours(k, r)
        self._send_gone(gone)
        return self._start_failed(k, r, exc)

    def _gone_to_neighbours(self, k: int, r: int) -> list[tuple[C, Parts]]:
        """With the lock held: the ``gone`` that tell each live neighbour of the new process
        *r* of stage *k*, started but never up, that it is gone (the previous stage's
        processes may have linked to it, and it linked to the next stage's at its start):
        sent by :meth:`_send_gone`, outside the lock."""
        core = self._core
        gone: list[tuple[C, Parts]] = []
        if k > 0:
            gone += [
                (c, self._gone_frame("next", k, r))
                for c, up in zip(self._replicas[k - 1], core.alive(k - 1), strict=True)
                if up
            ]
        if k + 1 < len(self._specs):
            gone += [
                (c, self._gone_frame("previous", k, r))
                for c, up in zip(self._replicas[k + 1], core.alive(k + 1), strict=True)
                if up
            ]
        return gone

    @staticmethod
    def _send_gone(gone: list[tuple[C, Parts]]) -> None:
        for client, frame in gone:
            with contextlib.suppress(Exception):  # a process that died: its death tells
                client._send(frame)

    def _give_up_restart(self, k: int, r: int, starting: bool, why: str) -> None:
        """The restart of process *r* of stage *k* ends before the process is up, *why*
        (its task cancelled, :class:`~enginecore.stage.AsyncPipeline`: an application that
        cancels tasks it does not own, a TaskGroup's teardown, ``asyncio.run``'s end; or an
        unexpected error in the restart itself, in either pipeline, logged by the caller)
        in its backoff (the process ``dead``), or, *starting*, once it had begun to start
        it (``starting``). Nothing would start it again, and it would read ``restarting`` for
        good, ``add`` refused while its stage has no live process. So it is failed, as
        after ``max_failures`` (:meth:`PipelineCore.abandoned`): it stays out, and if that
        leaves its stage no process live or coming back, the stage is dead (every request
        ends with its error naming it, and the pipeline takes no more); its live neighbours
        are told a started one is gone (as after a failed start, :meth:`_unheard_start`);
        an error says so. The caller stops the process it started (its end, heard after
        this, is no news to the core).

        Nothing once the pipeline closes (its shutdown's task, cancelled, cancels the
        restarts it waits for: no failure, and no word), or if the process is no longer the
        task's to start (the death of the process it started was heard, and that death's
        own restart takes over; or the pipeline failed)."""
        core = self._core
        d: PipelineDeliveries[S] = PipelineDeliveries()
        exc = EngineDeadError(f"{why}: it is not started again")
        with self._lock:
            self._linking.pop((k, r), None)
            owned = ReplicaState.STARTING if starting else ReplicaState.DEAD
            if self._closed or core.process_state(k, r) is not owned:
                return
            gone = self._gone_to_neighbours(k, r) if starting else []
            if not core.abandoned(k, r, exc, time.monotonic(), d):
                return
            failed = core.failure is not None
        self._deliver(d)
        self._send_gone(gone)
        logger.error(
            "enginecore: pipeline stage %r, process %d: %s; it is failed and stays out%s",
            self._names[k],
            r,
            why,
            "; its stage has no process left: the pipeline takes no more requests"
            if failed
            else "",
        )

    def _link_unconfirmed(self, k: int, r: int, exc: BaseException) -> None:
        """A process of the stage before *k* did not confirm its link to the restarted
        process *r* of stage *k* (it died, or did not answer within the startup timeout):
        the process takes requests anyway; say so, unless that neighbour is dead (its death
        is reported on its own)."""
        if isinstance(exc, EngineDeadError):
            return
        logger.warning(
            "enginecore: pipeline stage %r, process %d, started again, but a process of the "
            "stage before it did not confirm its new link (%s: %s)",
            self._names[k],
            r,
            type(exc).__name__,
            exc,
        )

    def _restarting(self, k: int, r: int) -> int | None:
        """The backoff of process *r* of stage *k* is over: the generation to start it
        with, or ``None`` (the pipeline failed or closes)."""
        with self._lock:
            if self._closed:
                return None
            return self._core.restarting(k, r)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {' -> '.join(self._names)}>"

    # -- what the stages say ------------------------------------------------------------------

    def _death(self, client: C, exc: BaseException | None) -> bool:
        """Whether the end of *client*'s event stream with *exc* is its process's death:
        always before :meth:`shutdown` (a clean end too, *exc* ``None``: the stage was
        stopped through its client, and nothing else ends its requests); during one, an
        ``EngineDeadError`` (the process died: while the stages before it drained, or in
        its own drain), whose requests could otherwise never finish: the stages still
        draining would wait out the deadline for them. The end of a stage the shutdown
        stopped is none (no error, or the client's ``StageClosedError`` once it had to kill
        it)."""
        return not self._closed or isinstance(exc, EngineDeadError)

    def _hands_over_deaths(self) -> bool:
        """Whether :meth:`health` may hand a dead client's events to the coordinator on the
        calling thread (:meth:`_take_events`): :class:`Pipeline`'s from any thread."""
        return True

    def _take_events(self, k: int, r: int = 0, client: C | None = None) -> None:
        """Stage *k*'s client (its replica *r*'s) appended to its ordered event stream: hand
        every event to the core, in order. Taken under the pipeline's lock, so two threads
        that read frames of one stage (its receiver and a ``call_utility``) cannot reorder
        them. *client*: the client that calls (an earlier process's, replaced by a restart,
        is no longer heard)."""
        if client is None:
            client = self._replicas[k][r]
        elif client is not self._replicas[k][r]:
            return
        buf = client._session.events
        if not buf:
            return
        core = self._core
        d: PipelineDeliveries[S] = PipelineDeliveries()
        dead: BaseException | None = None
        news = True  # the death: not known to the core before (PipelineCore.replica_dead)
        credit_items = credit_bytes = 0
        credits: dict[int, list[int]] = {}  # a pool's: per replica of stage k - 1
        with self._lock:
            now = time.monotonic()
            while buf:
                ev = buf.popleft()
                if isinstance(ev, Outputs):
                    core.outputs(k, ev.req_ids, ev.finished, ev.payloads, now, d, r)
                elif isinstance(ev, Aborted):
                    core.aborted(k, ev.req_ids, now, d, r, ev.fence, ev.tag)
                elif isinstance(ev, Credit):
                    if ev.links is None:
                        credit_items += ev.items
                        credit_bytes += ev.nbytes
                    else:
                        for link in ev.links:
                            if len(link) == 3:
                                owed = credits.setdefault(link[0], [0, 0])
                                owed[0] += link[1]
                                owed[1] += link[2]
                elif isinstance(ev, Replayed):
                    core.replayed(k, ev.req_id, ev.attempt, ev.ok, ev.message, now, d, r)
                elif isinstance(ev, ErrorReport):
                    if ev.req_id is not None:
                        core.error(k, ev.req_id, ev.message, now, d, r)
                    else:
                        logger.warning(
                            "enginecore: pipeline stage %r: %s", self._names[k], ev.message
                        )
                elif isinstance(ev, End) and self._death(client, ev.exc):
                    # The stage's event stream ended with its failure: it is gone. A clean
                    # end before the pipeline's shutdown is one too: the stage was stopped
                    # through its client (pipe.client(stage).shutdown()), not the pipeline.
                    dead = ev.exc or EngineDeadError(
                        "its client was shut down (pipe.client(...).shutdown()), not the pipeline"
                    )
                    exc = dead if isinstance(dead, EngineDeadError) else EngineDeadError(str(dead))
                    if self._pooled:
                        news = core.replica_dead(k, r, exc, now, d)
                    else:
                        core.stage_dead(k, exc, now, d)
        self._deliver(d)
        if self._link_waits:  # a restart waits for answers (or a death) of this stage
            self._wake_link_waits()
        if credit_items and k:
            # Stage k took that much of what stage k - 1 sent it: room in k - 1's window.
            credits[0] = [credit_items, credit_bytes]
        if credits and k:
            before = self._replicas[k - 1]
            for a, (items, nbytes) in credits.items():
                if items and 0 <= a < len(before):
                    with contextlib.suppress(Exception):  # k - 1 is gone: its failure tells
                        before[a]._send(ClientSession.credit_frame(items, nbytes, r))
        if dead is not None:
            if self._shm_prefix is not None:
                self._unlink_dead(k, r)
            if at_exit():
                return  # a pipeline never closed, its stages stopped as the program ends
            if not news:
                return  # a restart given up stopped its new process: it said so
            if self._closed:  # during a drain: nothing starts again, nothing more comes in
                logger.error(
                    "enginecore: pipeline stage %r, process %d, is gone (%s) during the "
                    "pipeline's shutdown; its requests ended",
                    self._names[k],
                    r,
                    dead,
                )
                return
            for k2, r2, delay in d.restarts:
                logger.error(
                    "enginecore: pipeline stage %r, process %d, is gone (%s); its requests "
                    "ended; it starts again in %.3g s",
                    self._names[k2],
                    r2,
                    dead,
                    delay,
                )
                self._schedule_restart(k2, r2, delay)
            if d.restarts:
                return
            if self._pooled and any(core.alive(k)):
                logger.error(
                    "enginecore: pipeline stage %r, replica %d, is gone (%s); its requests "
                    "ended, the stage goes on with its other replicas",
                    self._names[k],
                    r,
                    dead,
                )
                return
            logger.error(
                "enginecore: pipeline stage %r is gone (%s); the pipeline takes no more requests",
                self._names[k],
                dead,
            )
