"""Prometheus metrics of stages (the optional extra ``enginecore[prometheus]``).

Two ways to expose the same metric names (``docs/observability.md``, "Prometheus"):

- :class:`StageCollector`, in the parent process: register it with your own
  ``CollectorRegistry`` (as vLLM's frontend does), :meth:`~StageCollector.add` each stage's
  client with a ``stage`` label (or a replica pool, each replica labelled ``replica`` too,
  or a pipeline, its stages labelled ``pipeline``), and every scrape asks each stage for its
  statistics
  (``client.stats()``, answered by the stage's input side without waiting for its loop).
  A stage that does not answer within the collector's timeout is skipped and counted in
  ``enginecore_scrape_errors_total``; the scrape never hangs on it.
- :func:`start_metrics_server`, in a stage process (``python -m enginecore serve
  --metrics-port``): an HTTP ``/metrics`` endpoint answered by prometheus-client's own
  server threads from :meth:`~enginecore.stage._runtime.StageRuntime.statistics`, which
  never waits for the loop or a step.

``enginecore.stage`` does not import this module; importing it needs prometheus-client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TypeAlias

try:
    import prometheus_client.metrics as _client_metrics
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
    from prometheus_client.samples import Sample
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"enginecore.stage.prometheus needs prometheus-client ({_exc}); "
        f"install it with: pip install 'enginecore[prometheus]'"
    ) from _exc

from .._stats import STEP_BUCKETS
from ._aclient import AsyncRequestStream, AsyncStageClient
from ._apipeline import AsyncPipeline
from ._apool import AsyncStagePool
from ._client import RequestStream, StageClient
from ._errors import EngineDeadError, StageClosedError
from ._pipeline import Pipeline
from ._pool import StagePool
from ._pool_core import Replica, ReplicaState
from ._statistics import StageStatistics

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

__all__ = [
    "MAX_SCRAPE_TIMEOUT",
    "SCRAPE_TIMEOUT",
    "TTFT_BUCKETS",
    "MetricsServer",
    "StageCollector",
    "stage_families",
    "start_metrics_server",
]

logger = logging.getLogger("enginecore.stage")

SCRAPE_TIMEOUT: Final = 1.0
"""How long a :class:`StageCollector` scrape waits for a stage's statistics (seconds)."""

MAX_SCRAPE_TIMEOUT: Final = 3600.0
"""The longest *timeout* a :class:`StageCollector` takes (seconds)."""

TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""The default upper bounds (seconds) of ``enginecore_time_to_first_output_seconds``: vLLM's
time-to-first-token buckets."""

_LABELS: Final = ("pipeline", "stage", "replica")
"""Every series' labels: ``stage``, and ``replica`` for a pool's replica, ``pipeline`` for a
pipeline's stage. A label that is empty in every sample of a family is left out of it
(:func:`_trim`), so that a plain stage's series carry ``stage`` alone."""

_Key: TypeAlias = "tuple[str, str, str]"
"""A series' (pipeline, stage, replica) labels; ``""``: absent."""


def _trim(metrics: list[Metric]) -> list[Metric]:
    """Drop each of :data:`_LABELS` from a family where no sample has it (plain stages'
    series are ``{stage="a"}``, not ``{pipeline="",replica="",stage="a"}``; a pipeline's
    time to first output ``{pipeline="omni"}``).

    Per family, not per sample: every sample of a family keeps the same label names (a
    plain stage's series next to a pool's carry ``replica=""``, which Prometheus stores as
    no label). A family whose samples differ in their label names is refused by other
    client libraries' registries (client_golang: "label dimensions inconsistent") and by
    anything that re-exposes the scrape through one."""
    for m in metrics:
        unused = {k for k in _LABELS if not any(s.labels.get(k) for s in m.samples)}
        if unused:
            m.samples = [
                s._replace(labels={k: v for k, v in s.labels.items() if k not in unused})
                for s in m.samples
            ]
    return metrics


def _buckets(counts: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, float]]:
    """Per-bucket *counts* (the last one: above the last bound) as Prometheus' cumulative
    ``(le, count)`` pairs, ending with ``+Inf``."""
    out: list[tuple[str, float]] = []
    seen = 0
    for bound, n in zip(bounds, counts, strict=False):
        seen += n
        out.append((repr(float(bound)), seen))
    out.append(("+Inf", sum(counts)))
    return out


def _created_series() -> bool:
    """Whether ``_created`` samples are written: prometheus-client's switch for its own
    metrics (``disable_created_metrics()``, ``PROMETHEUS_DISABLE_CREATED_SERIES=True``)
    turns ours off too."""
    return bool(getattr(_client_metrics, "_use_created", True))


def _histogram_created(family: HistogramMetricFamily, labels: Sequence[str], at: float) -> None:
    """Append the ``_created`` sample of a histogram labelled :data:`_LABELS`
    (``HistogramMetricFamily.add_metric`` takes none), after the series' other samples, as
    OpenMetrics groups them."""
    family.samples.append(
        Sample(f"{family.name}_created", dict(zip(_LABELS, labels, strict=True)), at)
    )


class _Starts:
    """When each stage process started (Unix seconds): its counters' and step histogram's
    ``_created``, which must stay the same at every scrape of one process and move on when
    a new process (a restart) starts its counts from 0 again, so that a scraper tells a
    reset from a decrease.

    A stage reports its uptime, not its start: the first scrape of a process estimates the
    start as the scrape's wall clock minus that uptime (late by at most the time the answer
    took), and later scrapes keep that estimate, so that it never jitters, nor follows a
    step of the wall clock. A new process is one with another pid, or whose uptime is more
    than *slack* seconds below the highest seen (the same pid again, in a container); two
    scrapes at once may see one process's answers out of order by up to *slack*. Thread-safe.
    """

    __slots__ = ("_known", "_lock", "_slack")

    def __init__(self, slack: float) -> None:
        self._known: dict[_Key, tuple[int, float, float]] = {}  # pid, start, highest uptime
        self._lock = threading.Lock()
        self._slack = slack

    def created(self, key: _Key, s: StageStatistics, now: float) -> float:
        """The start of the process whose statistics *s* are, reported as *key*; *now*: the
        wall clock (``time.time()``) when they were taken."""
        up = s.uptime_seconds
        with self._lock:
            known = self._known.get(key)
            if known is not None and known[0] == s.pid and up > known[2] - self._slack:
                start, up = known[1], max(up, known[2])
            else:
                start = now - up
            self._known[key] = (s.pid, start, up)
            return start

    def keep(self, keys: set[_Key]) -> None:
        """Forget every series but *keys* (a removed replica's)."""
        with self._lock:
            for key in self._known.keys() - keys:
                del self._known[key]


class _Families:
    """The metric families of one scrape; :meth:`add` appends one stage's samples."""

    def __init__(self) -> None:
        c, g = CounterMetricFamily, GaugeMetricFamily
        self.steps = c("enginecore_steps", "Engine steps that returned.", labels=_LABELS)
        self.outputs = c(
            "enginecore_outputs",
            "Outputs the stage handed to its output thread.",
            labels=_LABELS,
        )
        self.messages = c(
            "enginecore_messages",
            "Messages the loop applied, by kind (add, abort, utility, control).",
            labels=(*_LABELS, "kind"),
        )
        self.utility_errors = c(
            "enginecore_utility_errors", "Utility calls answered with an error.", labels=_LABELS
        )
        self.busy = c(
            "enginecore_busy_seconds",
            "Time the loop ran without waiting for a message.",
            labels=_LABELS,
        )
        self.idle = c(
            "enginecore_idle_seconds",
            "Time the loop blocked waiting for a message.",
            labels=_LABELS,
        )
        self.engine_errors = c(
            "enginecore_engine_stats_errors",
            "Calls of the engine's stats() that failed.",
            labels=_LABELS,
        )
        self.load_reports = c(
            "enginecore_load_reports", "Load reports the stage sent.", labels=_LABELS
        )
        self.cut_clients = c(
            "enginecore_cut_clients",
            "Clients the shared stage cut for falling behind.",
            labels=_LABELS,
        )
        self.live = g(
            "enginecore_live_requests",
            "Requests live in the stage (added, not yet ended).",
            labels=_LABELS,
        )
        self.queue_depth = g(
            "enginecore_queue_depth", "Messages waiting in the loop's input queue.", labels=_LABELS
        )
        self.backlog = g(
            "enginecore_output_backlog",
            "Events waiting for the stage's output thread.",
            labels=_LABELS,
        )
        self.last_drain = g(
            "enginecore_last_drain_messages",
            "Messages applied by the last drain that applied any.",
            labels=_LABELS,
        )
        self.peak_drain = g(
            "enginecore_peak_drain_messages", "The most messages one drain applied.", labels=_LABELS
        )
        self.step_max = g("enginecore_step_seconds_max", "The longest step so far.", labels=_LABELS)
        self.uptime = g(
            "enginecore_uptime_seconds", "Seconds since the stage started.", labels=_LABELS
        )
        self.running = g(
            "enginecore_loop_running", "1 while the stage's loop runs.", labels=_LABELS
        )
        self.stalled = g(
            "enginecore_step_stalled",
            "1 while a step has run past the stage's step_timeout.",
            labels=_LABELS,
        )
        self.engine = g(
            "enginecore_engine_stat",
            "The engine's own numbers, from its stats(), by field name.",
            labels=(*_LABELS, "name"),
        )
        self.engine_age = g(
            "enginecore_engine_stats_age_seconds",
            "Age of the engine's stats() sample.",
            labels=_LABELS,
        )
        self.up = g(
            "enginecore_stage_up",
            "1 if the stage answered this scrape, 0 if it was skipped.",
            labels=_LABELS,
        )
        self.info = InfoMetricFamily(
            "enginecore_stage", "The stage's engine factory and pid.", labels=_LABELS
        )
        self.step_seconds = HistogramMetricFamily(
            "enginecore_step_seconds", "Step time.", labels=_LABELS
        )

    def add(self, key: _Key, s: StageStatistics, created: float | None = None) -> None:
        """One stage process's samples; its counters' and step histogram's ``_created``
        is *created* (when the process started, Unix seconds), none if ``None``."""
        lp, lb = s.loop, list(key)
        self.steps.add_metric(lb, lp.steps, created)
        self.outputs.add_metric(lb, s.outputs, created)
        for kind, n in (
            ("add", lp.adds),
            ("abort", lp.aborts),
            ("utility", lp.utility_calls),
            ("control", lp.controls),
        ):
            self.messages.add_metric([*key, kind], n, created)
        self.utility_errors.add_metric(lb, lp.utility_errors, created)
        self.busy.add_metric(lb, lp.busy_seconds, created)
        self.idle.add_metric(lb, lp.idle_seconds, created)
        self.engine_errors.add_metric(lb, lp.engine_errors, created)
        self.load_reports.add_metric(lb, s.load_reports, created)
        self.cut_clients.add_metric(lb, s.cut_clients, created)
        self.live.add_metric(lb, s.live)
        self.queue_depth.add_metric(lb, lp.queue_depth)
        self.backlog.add_metric(lb, s.backlog)
        self.last_drain.add_metric(lb, lp.last_drain)
        self.peak_drain.add_metric(lb, lp.peak_drain)
        self.step_max.add_metric(lb, lp.step_seconds_max)
        self.uptime.add_metric(lb, s.uptime_seconds)
        self.running.add_metric(lb, 1.0 if lp.running else 0.0)
        self.stalled.add_metric(lb, 1.0 if s.stalled else 0.0)
        for name, value in lp.engine.items():
            self.engine.add_metric([*key, name], value)
        if lp.engine_age is not None:
            self.engine_age.add_metric(lb, lp.engine_age)
        self.up.add_metric(lb, 1.0)
        self.info.add_metric(lb, {"engine": s.factory, "pid": str(s.pid)})
        # steps == sum(step_histogram) in one snapshot: _count and the +Inf bucket agree.
        self.step_seconds.add_metric(lb, _buckets(lp.step_histogram, STEP_BUCKETS), lp.step_seconds)
        if created is not None:
            _histogram_created(self.step_seconds, lb, created)

    def all(self) -> list[Metric]:
        return _trim([m for m in vars(self).values() if isinstance(m, Metric)])


def stage_families(
    stats: Iterable[tuple[str, StageStatistics]], *, created: Mapping[str, float] | None = None
) -> list[Metric]:
    """The metric families of the stages in *stats*, ``(stage label, statistics)`` pairs:
    what both :class:`StageCollector` and the stage's own endpoint report. *created* maps a
    stage label to the Unix time its process started: its counters' and step histogram's
    ``_created`` (none for a stage it does not name; keep the value the same at every
    scrape of one process)."""
    families = _Families()
    for stage, s in stats:
        families.add(("", stage, ""), s, None if created is None else created.get(stage))
    return families.all()


# -- the parent side -----------------------------------------------------------------------------


class _Ttft:
    """One stage's time-to-first-output histogram: per-bucket counts and a sum."""

    __slots__ = ("counts", "lock", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.sum = 0.0
        self.lock = threading.Lock()


_Client: TypeAlias = "StageClient | AsyncStageClient"
_Target: TypeAlias = (
    "StageClient | AsyncStageClient | StagePool | AsyncStagePool | Pipeline | AsyncPipeline"
)
_POOLS: Final = (StagePool, AsyncStagePool)
_PIPELINES: Final = (Pipeline, AsyncPipeline)
_CLIENTS: Final = (StageClient, AsyncStageClient)
_GONE: Final = (EngineDeadError, StageClosedError)
"""What a pool's or a pipeline's process raises once it is dead, or its client was closed
by the pool or pipeline (removed, replaced after a restart, shut down)."""
_RUNNING: Final = (ReplicaState.SERVING, ReplicaState.DRAINING)
"""A pool's replicas that a scrape asks: the others have no stage process to ask now."""


@dataclass(frozen=True)
class _Member:
    """One stage process a scrape reports: its series' labels, and the client to ask
    (``None``: a pool's replica or a pipeline's process that has no process running now,
    reported down without a scrape error)."""

    key: _Key
    client: _Client | None
    running: Callable[[], bool | None] | None = None
    """A pool's or a pipeline's: after the scrape asked it, whether it is still the
    running process it was (``False``: it died, is starting again or was replaced meanwhile,
    so a failure is no scrape error; ``None``: it was removed, and its series go)."""


@dataclass
class _Reported:
    """What one :meth:`StageCollector.add` reports: a stage's client, a pool or a pipeline."""

    target: _Target
    ttft: _Ttft
    errors: dict[_Key, int] = field(default_factory=dict)  # scrapes that skipped a series
    since: dict[_Key, float] = field(default_factory=dict)  # when a series' errors count began
    added_at: float = field(default_factory=time.time)  # the time to first output's start
    down: set[_Key] = field(default_factory=set)  # skipped by the last scrape (logged once)

    def ttft_key(self, name: str) -> _Key:
        return (name, "", "") if isinstance(self.target, _PIPELINES) else ("", name, "")

    def members(self, name: str) -> list[_Member]:
        """Each stage process to report now, with its series' labels."""
        t = self.target
        if isinstance(t, _POOLS):
            return [_pool_member(name, r) for r in t.replicas]
        if isinstance(t, _PIPELINES):
            return _pipeline_members(name, t)
        return [_Member(("", name, ""), t)]


def _pool_member(name: str, replica: Replica) -> _Member:
    """A pool's replica: asked while it serves or drains, as the client it has now."""
    key = ("", name, replica.name)
    client = replica._client
    if replica.state not in _RUNNING or client is None:
        return _Member(key, None)

    def running() -> bool | None:
        if replica.state is ReplicaState.REMOVED:
            return None
        return replica.state in _RUNNING and replica._client is client

    return _Member(key, client, running)


def _pipeline_members(name: str, pipe: Pipeline | AsyncPipeline) -> list[_Member]:
    """Every process of a pipeline, stage by stage: asked while it serves (not while it is
    dead, waits for its restart, starts again, or failed for good)."""
    core = pipe._core
    with pipe._lock:  # the processes and their states, as health() reads them
        stages: list[list[_Client]] = [list(c) for c in pipe._replicas]  # a restart replaces one
        states = [[core.process_state(k, r) for r in range(len(c))] for k, c in enumerate(stages)]
    out: list[_Member] = []
    for k, (stage, clients) in enumerate(zip(pipe._names, stages, strict=True)):
        for r, client in enumerate(clients):
            key = (name, stage, str(r) if len(clients) > 1 else "")
            serving = states[k][r] is ReplicaState.SERVING
            out.append(
                _Member(key, client, _serving(pipe, k, r, client))
                if serving
                else _Member(key, None)
            )
    return out


def _serving(pipe: Pipeline | AsyncPipeline, k: int, r: int, client: _Client) -> Callable[[], bool]:
    """Whether process *r* of stage *k* still serves, as *client*'s process."""

    def running() -> bool:
        with pipe._lock:
            same: bool = pipe._replicas[k][r] is client
            return same and pipe._core.process_state(k, r) is ReplicaState.SERVING

    return running


def _describe(key: _Key) -> str:
    pipeline, stage, replica = key
    where = f"pipeline {pipeline} stage {stage}" if pipeline else f"stage {stage}"
    return f"{where} replica {replica}" if replica else where


class StageCollector(Collector):
    """Prometheus metrics of the stages this process talks to: its clients' stages, its
    replica pools' replicas and its pipelines' stages.

    ::

        registry = CollectorRegistry()
        metrics = StageCollector(registry)           # or registry.register(StageCollector())
        metrics.add(prefill, stage="prefill-0")      # a StageClient or an AsyncStageClient
        metrics.add(pool, stage="decode")            # a StagePool or an AsyncStagePool
        metrics.add(pipe, pipeline="omni")           # a Pipeline or an AsyncPipeline
        prometheus_client.start_http_server(8000, registry=registry)

    Every series has a ``stage`` label. A pool's replicas add ``replica`` (the replica's
    name, ``r0``, ``r1``, ...), so that ``sum by (stage)`` adds up a pool; a pipeline's
    stages are labelled ``pipeline`` and ``stage`` (the stage's name in the pipeline), and
    a stage run by several replicas adds ``replica`` (``0``, ``1``, ...). A pool also
    reports ``enginecore_pool_replicas{stage, state}``, its replicas by state. Every
    series of a family has the same label names: where some have a ``replica`` or a
    ``pipeline`` and others not, those carry it empty (Prometheus stores it as no label).

    Each scrape (:meth:`collect`) asks every stage process for its statistics at once, on
    threads of its own, and waits at most *timeout* seconds for them (a number > 0, at
    most an hour: :class:`ValueError` otherwise, :class:`TypeError` for a non-number): a
    stage that does not answer in time, or is dead or closed, is skipped
    (``enginecore_stage_up`` 0, its
    other series absent from that scrape) and counted in ``enginecore_scrape_errors_total``.
    A pool's replica or a pipeline's process that has no process running now (starting,
    dead, failed, waiting for its restart) reads ``enginecore_stage_up`` 0 and is not
    counted as an error, nor is one that dies or is removed while it is asked; a removed
    replica's series go. Each stage process is asked on a thread of its own, so that
    however many hang, the others are asked at once.
    Counters are the stage's own, so they stay exact however many stages (and collectors)
    report.

    An :class:`AsyncStageClient` (an asyncio pool's replica, an asyncio pipeline's stage)
    is asked on its own event loop (``asyncio.run_coroutine_threadsafe``): scrape from
    another thread, as ``prometheus_client.start_http_server`` does. A scrape on that event
    loop's thread (an ASGI ``make_asgi_app`` mounted in the same app) cannot wait for it,
    and skips the stage as an error; run ``generate_latest(registry)`` in
    ``asyncio.to_thread`` there instead.

    Time to first output (``enginecore_time_to_first_output_seconds``) is fed by
    :meth:`observe`, once per stream: nothing is recorded per output.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        timeout: float = SCRAPE_TIMEOUT,
        ttft_buckets: Sequence[float] = TTFT_BUCKETS,
    ) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        if not 0 < timeout <= MAX_SCRAPE_TIMEOUT:
            # Past about 2**33 s, a wait overflows a C time_t and every scrape raised.
            raise ValueError(
                f"timeout must be > 0 seconds and at most {MAX_SCRAPE_TIMEOUT:g} (an hour), "
                f"got {timeout!r}"
            )
        bounds = tuple(float(b) for b in ttft_buckets)
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"ttft_buckets must be increasing bounds, got {ttft_buckets!r}")
        self.timeout = timeout
        self._ttft_bounds = bounds
        self._reported: dict[str, _Reported] = {}
        # Answers of two scrapes at once come at most a wait (timeout + 0.5 s) apart.
        self._starts = _Starts(slack=timeout + 1.0)
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def add(
        self, target: _Target, stage: str | None = None, *, pipeline: str | None = None
    ) -> None:
        """Report *target*: a :class:`~enginecore.stage.StageClient` or an
        :class:`~enginecore.stage.AsyncStageClient` (its stage, labelled
        ``stage=<stage>``), a :class:`~enginecore.stage.StagePool` or an
        :class:`~enginecore.stage.AsyncStagePool` (each replica, labelled
        ``stage=<stage>, replica=<its name>``: the replicas it has at each scrape), or a
        :class:`~enginecore.stage.Pipeline` or an :class:`~enginecore.stage.AsyncPipeline`
        (each stage, labelled ``pipeline=<pipeline>, stage=<its name>``), given by
        ``pipeline=`` instead of ``stage=``.

        :class:`TypeError` for another kind of target or the wrong one of ``stage`` and
        ``pipeline``; :class:`ValueError` if the name is empty, not a ``str``, or taken
        (a stage and a pipeline share the names :meth:`remove` and :meth:`observe` take),
        or if *target* is reported already (under another name)."""
        if isinstance(target, _PIPELINES):
            if stage is not None or pipeline is None:
                raise TypeError(
                    f"a {type(target).__name__} is added with pipeline=<name> (its stages "
                    f"are labelled with their own names), got stage={stage!r}, "
                    f"pipeline={pipeline!r}"
                )
            what, name = "pipeline", pipeline
        elif isinstance(target, (*_CLIENTS, *_POOLS)):
            if pipeline is not None or stage is None:
                raise TypeError(
                    f"a {type(target).__name__} is added with stage=<label>, got "
                    f"stage={stage!r}, pipeline={pipeline!r}"
                )
            what, name = "stage", stage
        else:
            raise TypeError(
                "not a StageClient, an AsyncStageClient, a StagePool, an AsyncStagePool, "
                f"a Pipeline or an AsyncPipeline: {target!r}"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what} must be a non-empty str, got {name!r}")
        with self._lock:
            if name in self._reported:
                raise ValueError(f"a stage or pipeline is already reported as {name!r}")
            for other, rep in self._reported.items():
                if rep.target is target:  # its counters would count twice in every sum
                    raise ValueError(
                        f"this {type(target).__name__} is already reported as {other!r}; "
                        f"remove({other!r}) first to report it as {name!r}"
                    )
            self._reported[name] = _Reported(target, _Ttft(len(self._ttft_bounds)))

    def remove(self, stage: str) -> None:
        """Stop reporting the stage, pool or pipeline added as *stage* (its series, time
        to first output included, disappear). :class:`KeyError` if it is not reported."""
        with self._lock:
            if self._reported.pop(stage, None) is None:
                raise KeyError(f"no stage or pipeline is reported as {stage!r}")

    @property
    def stages(self) -> tuple[str, ...]:
        """The names reported (stages, pools and pipelines), in the order they were added."""
        with self._lock:
            return tuple(self._reported)

    def observe(
        self, stream: RequestStream | AsyncRequestStream | float, stage: str
    ) -> float | None:
        """Record a request's time to first output in *stage*'s histogram and return it;
        ``None`` (nothing recorded) if its first output has not arrived. *stage* is the
        name it was added as: a pool's (one histogram for the pool, not per replica) or a
        pipeline's (labelled ``pipeline=<name>``).

        *stream* is a stream of that stage's client (or pool, or pipeline), read in O(1)
        (its send time and first arrival, as in
        :attr:`~enginecore.stage.StreamTimings.time_to_first_output`), or the time in
        seconds (>= 0 and finite: :class:`ValueError` otherwise, :class:`TypeError` for a
        non-number), for a consumer that times requests itself. Call it once per request,
        from any thread, typically when its stream ends (once more counts it twice).
        :class:`KeyError` if *stage* is not reported, whether or not there is a time."""
        try:
            h = self._reported[stage].ttft
        except KeyError:
            raise KeyError(f"no stage or pipeline is reported as {stage!r}") from None
        if isinstance(stream, (RequestStream, AsyncRequestStream)):
            arrivals = stream._arrivals
            if not arrivals:
                return None
            seconds = arrivals[0] - stream._sent_at
        elif isinstance(stream, bool) or not isinstance(stream, (int, float)):
            raise TypeError(f"observe() takes a stream or seconds, got {stream!r}")
        elif not 0 <= stream < math.inf:
            # A NaN or an infinity would stay in the histogram's sum for good.
            raise ValueError(f"observe() takes seconds >= 0 and finite, got {stream!r}")
        else:
            seconds = float(stream)
        with h.lock:
            h.counts[bisect_left(self._ttft_bounds, seconds)] += 1
            h.sum += seconds
        return seconds

    def describe(self) -> list[Metric]:
        """The families :meth:`collect` yields, without samples (the registry checks their
        names against its other collectors')."""
        return [*_Families().all(), *self._own_families()]

    def collect(self) -> list[Metric]:
        """One scrape: every stage process's statistics, fetched at once; at most about
        *timeout* seconds however many stages are slow or gone."""
        with self._lock:
            reported = list(self._reported.items())
        members = [(name, rep, rep.members(name)) for name, rep in reported]
        results = self._fetch([m for _, _, ms in members for m in ms if m.client is not None])
        families = _Families()
        errors, ttft, replicas = self._own_families()
        skipped: list[tuple[_Key, str]] = []
        wall = time.time()
        created = _created_series()
        everyone: set[_Key] = set()
        with self._lock:  # two scrapes at once (a threaded HTTP server) count apart
            for name, rep, ms in members:
                keys = set()
                for m in ms:
                    key = m.key
                    stats = results.get(key) if m.client is not None else None
                    if isinstance(stats, StageStatistics):
                        start = self._starts.created(key, stats, wall) if created else None
                        families.add(key, stats, start)
                        rep.down.discard(key)
                    else:
                        # A pool's or a pipeline's process that died, was replaced or was
                        # being removed while it was asked is down, not a scrape error, as
                        # one that was so before: its death (which the pool may not have
                        # heard of yet) or its client closed by the pool is no scrape's.
                        now = m.running() if m.running is not None else True
                        if now is None:
                            continue  # removed: its series go
                        if m.running is not None and isinstance(stats, _GONE):
                            now = False
                        families.up.add_metric(list(key), 0.0)
                        if m.client is not None and now:
                            rep.errors[key] = rep.errors.get(key, 0) + 1
                            if key not in rep.down:
                                rep.down.add(key)
                                skipped.append((key, _reason(stats)))
                    keys.add(key)
                    since = rep.since.setdefault(key, wall)
                    errors.add_metric(list(key), rep.errors.get(key, 0), since if created else None)
                # a removed replica's counts go with it
                rep.errors = {k: n for k, n in rep.errors.items() if k in keys}
                rep.since = {k: t for k, t in rep.since.items() if k in keys}
                rep.down &= keys
                everyone |= keys
                with rep.ttft.lock:
                    counts, total = list(rep.ttft.counts), rep.ttft.sum
                ttft_key = list(rep.ttft_key(name))
                ttft.add_metric(ttft_key, _buckets(counts, self._ttft_bounds), total)
                if created:
                    _histogram_created(ttft, ttft_key, rep.added_at)
                if isinstance(rep.target, _POOLS):
                    states = Counter(r.state for r in rep.target.replicas)
                    for state in ReplicaState:
                        if state is not ReplicaState.REMOVED:
                            replicas.add_metric([name, state.value], states[state])
            self._starts.keep(everyone)
        for key, why in skipped:
            logger.warning(
                "enginecore: %s did not answer the metrics scrape (%s); skipped, and "
                "counted in enginecore_scrape_errors_total",
                _describe(key),
                why,
            )
        return [*families.all(), *_trim([errors, ttft]), replicas]

    @staticmethod
    def _own_families() -> tuple[CounterMetricFamily, HistogramMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "enginecore_scrape_errors",
                "Scrapes that skipped the stage: no answer in time, dead or closed.",
                labels=_LABELS,
            ),
            HistogramMetricFamily(
                "enginecore_time_to_first_output_seconds",
                "Time from sending a request to its first output's arrival, in the client.",
                labels=_LABELS,
            ),
            GaugeMetricFamily(
                "enginecore_pool_replicas",
                "A replica pool's replicas, by state.",
                labels=("stage", "state"),
            ),
        )

    def _fetch(self, members: list[_Member]) -> dict[_Key, StageStatistics | BaseException]:
        """Every member's statistics, or why not."""
        if not members:
            return {}
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        timeout = self.timeout
        out: dict[_Key, StageStatistics | BaseException] = {}
        # A thread per stage process: every one is asked at once, so however many hang, a
        # scrape waits one timeout for them all, and asks the others at the start (a
        # bounded pool would queue the ones behind its first hanging threads past it).
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(members), thread_name_prefix="enginecore-metrics"
        )
        try:
            pending: dict[concurrent.futures.Future[StageStatistics], _Key] = {}
            for m in members:
                client = m.client
                if isinstance(client, AsyncStageClient):
                    if client._loop is here:
                        out[m.key] = _OnItsLoop("scraped on its own event loop's thread")
                        continue
                    fut = pool.submit(_fetch_async, client, timeout)
                else:
                    assert client is not None
                    fut = pool.submit(client.stats, timeout)
                pending[fut] = m.key
            # Each call has its own timeout; the extra half second only covers its thread
            # starting late on a loaded machine. Whatever is still out then is skipped.
            done, not_done = concurrent.futures.wait(pending, timeout + 0.5)
            for fut in not_done:
                out[pending[fut]] = TimeoutError(f"no answer within {timeout} s")
            for fut in done:
                try:
                    out[pending[fut]] = fut.result()
                except Exception as exc:
                    out[pending[fut]] = exc
        finally:
            pool.shutdown(wait=False)
        return out


class _OnItsLoop(RuntimeError):
    """An asyncio client scraped on its own event loop's thread, which cannot wait for it."""


def _reason(why: StageStatistics | BaseException | None) -> str:
    """Why a stage was skipped, in a warning: the error's type and message."""
    if isinstance(why, _OnItsLoop):
        return str(why)
    if isinstance(why, TimeoutError) and str(why).startswith("no answer within"):
        return str(why)
    return f"{type(why).__name__}: {why}"


def _fetch_async(client: AsyncStageClient, timeout: float) -> StageStatistics:
    if client._loop.is_closed():
        # Its client is closed too; and a coroutine made for a closed loop is never awaited.
        raise StageClosedError("the client's event loop is closed")
    future = asyncio.run_coroutine_threadsafe(client.stats(timeout), client._loop)
    try:
        return future.result(timeout + 0.25)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"stats did not answer within {timeout} s") from None


# -- the stage side ------------------------------------------------------------------------------


class _RuntimeCollector(Collector):
    """One stage's metrics, in its own process: from *statistics*, which never waits
    (``None`` while the stage starts: then only ``enginecore_stage_up`` 0)."""

    def __init__(self, statistics: Callable[[], StageStatistics | None], stage: str) -> None:
        self._statistics = statistics
        self._stage = stage
        self._starts = _Starts(slack=1.0)  # one process: its start, estimated once

    def describe(self) -> list[Metric]:
        return _Families().all()

    def collect(self) -> list[Metric]:
        stats = self._statistics()
        if stats is not None:
            created = None
            if _created_series():
                start = self._starts.created(("", self._stage, ""), stats, time.time())
                created = {self._stage: start}
            return stage_families([(self._stage, stats)], created=created)
        families = _Families()
        families.up.add_metric(["", self._stage, ""], 0.0)
        return families.all()


@dataclass(frozen=True)
class MetricsServer:
    """A running ``/metrics`` endpoint, from :func:`start_metrics_server`."""

    host: str
    """The bound address, as the server reports it."""
    port: int
    """The bound port (the one picked, for port 0)."""
    _httpd: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics`` (an IPv6 host in brackets): what ``serve`` prints."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (waits for the server thread's poll, at most about 0.5 s)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def start_metrics_server(
    statistics: Callable[[], StageStatistics | None], stage: str, host: str, port: int
) -> MetricsServer:
    """Serve *stage*'s metrics over HTTP at ``http://host:port/metrics`` (port 0: a free
    one), on prometheus-client's server threads: every scrape calls *statistics*
    (``StageRuntime.statistics``, which never waits for the loop; ``None`` while the stage
    starts), plus the standard ``process_*`` metrics. Raises :class:`OSError` if the
    address cannot be bound."""
    from prometheus_client import ProcessCollector, start_http_server

    registry = CollectorRegistry()
    registry.register(_RuntimeCollector(statistics, stage))
    ProcessCollector(registry=registry)
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    thread.name = "enginecore-metrics"
    bound = httpd.server_address
    return MetricsServer(str(bound[0]), int(bound[1]), httpd, thread)
