"""Stage pipelines: :class:`Pipeline`, :class:`PipelineStage`, :class:`PipelineStream`.

A pipeline runs each request through several stage processes in order (an encoder, an
LLM, a vocoder). Data goes from stage to stage directly, over ZeroMQ (:mod:`._pipe_stage`);
the parent holds the coordinator, which carries only control (:mod:`._pipeline_core`): the
caller's adds go to the first stage, the caller's aborts chase the data from the first
stage on, and each stage tells the coordinator what it sends the caller and when a request
ended in it. ``docs/pipelines.md`` is the guide.

The coordinator is the client of every stage (a :class:`~._client.StageClient` each, with
the ordered event stream on and no per-request streams). Each stage's events go to the core
on the thread that read them, the client's receiver (``StageClient._event_sink``), under
the pipeline's lock, which is also the lock of every :class:`PipelineStream`: the pipeline
has no thread of its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from . import _clientbase
from ._client import RequestStream, StageClient
from ._errors import EngineDeadError, PipelineFullError, StageClosedError
from ._pipeline_core import PipelineCore, PipelineDeliveries
from ._session import End, StageHealth
from ._statistics import StageStatistics
from ._wire import Aborted, ErrorReport, Outputs

__all__ = ["Pipeline", "PipelineStage", "PipelineStream"]

logger = logging.getLogger("enginecore.stage")

_PIPE_FACTORY: Final = "enginecore.stage._pipe_stage:pipe_stage"


class PipelineStream(RequestStream):
    """The outputs of one request of a :class:`Pipeline`, in order of arrival: every payload
    that a stage's edge sent to the caller, and the last stage's outputs. The same iterator
    as :class:`~enginecore.stage.RequestStream` (``next()``, :meth:`get`, :meth:`collect`,
    :attr:`finished`, :attr:`aborted`, :attr:`timings`). Payloads of one stage arrive in
    that stage's order; payloads of two stages have no order between them.

    It stops when the request is done in every stage it reached, or once its abort has been
    applied in every stage (:attr:`aborted`). It raises
    :class:`~enginecore.stage.PipelineRequestError` when a stage reported an error for the
    request (``exc.stage`` names it), :class:`~enginecore.stage.PipelineStageDeadError` when
    a stage died, and :class:`~enginecore.stage.StageClosedError` when the pipeline was
    closed first."""

    __slots__ = ()


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
    *step_timeout*, *log_level* and *forward_logs* are :meth:`StageClient.launch`'s.
    """

    factory: str
    kwargs: Mapping[str, Any] | None = None
    name: str | None = None
    edge: str | None = None
    step_timeout: float | None = 60.0
    log_level: int | str | None = None
    forward_logs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str):
            raise TypeError(f"factory must be an import string, got {self.factory!r}")
        if self.edge is not None and not isinstance(self.edge, str):
            raise TypeError(
                f"edge must be an import string 'pkg.module:fn' (it runs in the stage's "
                f"process), got {self.edge!r}"
            )


def _stages(stages: Sequence[PipelineStage | str]) -> list[PipelineStage]:
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
    names: list[str] = []
    for k, spec in enumerate(specs):
        name = spec.name
        if name is None:
            name = spec.factory
            if sum(s.factory == spec.factory and s.name is None for s in specs) > 1:
                name = f"{spec.factory}[{k}]"
        if name in names:
            raise ValueError(f"two stages are named {name!r}")
        names.append(name)
    return [
        PipelineStage(s.factory, s.kwargs, n, s.edge, s.step_timeout, s.log_level, s.forward_logs)
        for s, n in zip(specs, names, strict=True)
    ]


class Pipeline:
    """Requests through several stages, with one client's API at the entrance.

    Build one with :meth:`launch`. :meth:`add` and :meth:`add_many` send requests to the
    first stage and return their :class:`PipelineStream`; :meth:`abort` aborts them in every
    stage; :meth:`health`, :meth:`stats` and :meth:`call_utility` reach each stage by name;
    :meth:`shutdown` (or leaving the ``with`` block) stops every stage. Thread-safe.

    *max_in_flight* is the admission budget: at most that many requests are in the
    pipeline at once, counted from :meth:`add` until the request is over in every stage.
    An :meth:`add` without room waits for it (or raises
    :class:`~enginecore.stage.PipelineFullError`: ``wait=False``, or its *timeout*), before
    the first stage does any work.
    """

    def __init__(
        self,
        clients: Sequence[StageClient],
        names: Sequence[str],
        *,
        max_in_flight: int | None = None,
    ) -> None:
        # Private: use launch(). *clients* are the stages' clients, in order, each launched
        # with the pipe factory and ordered_events=True.
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._core: PipelineCore[PipelineStream] = PipelineCore(names, max_in_flight)
        self._clients = list(clients)
        self._names = tuple(names)
        self._closed = False
        self._close_lock = threading.Lock()
        # Each stage's events are taken on the thread that read them (its client's
        # receiver, or a call_utility reading meanwhile), as the client appends them to its
        # ordered event stream: no thread of the pipeline's own, no hand-over between two.
        for k, client in enumerate(self._clients):
            client._event_sink = functools.partial(self._take_events, k)
            self._take_events(k)  # anything that came before the sink was set

    @classmethod
    def launch(
        cls,
        stages: Sequence[PipelineStage | str],
        *,
        max_in_flight: int | None = None,
        startup_timeout: float = 60.0,
    ) -> Pipeline:
        """Start one stage process per item of *stages* (a :class:`PipelineStage`, or a
        factory import string for a stage with no options), connect each to the next, and
        return the pipeline. The stages start last to first, each knowing where the next
        one listens. If one fails to start, the ones started are shut down and its
        :class:`~enginecore.stage.StageStartupError` is raised."""
        specs = _stages(stages)
        PipelineCore(["check"], max_in_flight)  # check the budget before starting anything
        clients: list[StageClient] = []
        downstream: str | None = None
        try:
            for spec in reversed(specs):
                kwargs: dict[str, Any] = {
                    "factory": spec.factory,
                    "stage": spec.name,
                    "kwargs": dict(spec.kwargs or {}),
                }
                if spec.edge is not None:
                    kwargs["edge"] = spec.edge
                if downstream is not None:
                    kwargs["downstream"] = downstream
                client = StageClient.launch(
                    _PIPE_FACTORY,
                    kwargs,
                    startup_timeout=startup_timeout,
                    ordered_events=True,
                    name=spec.name,
                    step_timeout=spec.step_timeout,
                    log_level=spec.log_level,
                    forward_logs=spec.forward_logs,
                )
                clients.append(client)
                downstream = client.address
        except BaseException:
            for client in clients:
                with contextlib.suppress(Exception):
                    client.shutdown()
            raise
        clients.reverse()
        return cls(
            clients, [s.name for s in specs if s.name is not None], max_in_flight=max_in_flight
        )

    # -- requests ---------------------------------------------------------------------------

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages' names, in order."""
        return self._names

    @property
    def in_flight(self) -> int:
        """Requests in the pipeline now (each holds its place in the budget until it is
        over in every stage)."""
        with self._lock:
            return self._core.in_flight

    def add(
        self, req_id: str, data: Any, *, wait: bool = True, timeout: float | None = None
    ) -> PipelineStream:
        """Send request *req_id* with *data* to the first stage; return its stream.

        Without room in the budget, waits for it (at most *timeout* seconds), or raises
        :class:`~enginecore.stage.PipelineFullError` at once with ``wait=False``. Raises
        :class:`TypeError` if *data* is not wire-encodable and :class:`ValueError` if
        *req_id* is still in the pipeline (both before anything is sent), else the
        pipeline's failure (a stage died, or it was closed)."""
        return self._admit([(req_id, data)], wait, timeout, many=False)[0]

    def add_many(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> list[PipelineStream]:
        """Send many ``(req_id, data)`` requests to the first stage in one frame; return
        their streams in order. All or nothing, as :meth:`add` (the budget must have room
        for all of them: more than *max_in_flight* at once is a :class:`ValueError`)."""
        return self._admit(list(items), wait, timeout, many=True)

    def _admit(
        self, items: list[tuple[str, Any]], wait: bool, timeout: float | None, many: bool
    ) -> list[PipelineStream]:
        for item in items:
            if type(item) is not tuple or len(item) != 2:
                raise TypeError(f"add_many() takes (req_id, data) pairs, got {item!r:.100}")
            _check_req_id(item[0])
        ids = [rid for rid, _ in items]
        core = self._core
        budget = core.max_in_flight
        if budget is not None and len(ids) > budget:
            raise ValueError(f"{len(ids)} requests at once, more than max_in_flight ({budget})")
        deadline = _clientbase.deadline_after(timeout)
        now = time.monotonic()
        streams = [PipelineStream(rid, self._lock, now) for rid in ids]
        with self._lock:
            while True:
                core.check(ids)
                room = core.room()
                if room is None or room >= len(ids):
                    break
                if not wait:
                    raise PipelineFullError(
                        f"the pipeline holds {core.in_flight} requests, its max_in_flight"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PipelineFullError(
                        f"no room in the pipeline (max_in_flight {budget}) within {timeout} s"
                    )
                self._room.wait(left)
            for rid, stream in zip(ids, streams, strict=True):
                core.open(rid, stream)
        first = self._clients[0]
        try:
            if many:
                first.add_many(items, streams=False)
            else:
                first.add(ids[0], items[0][1], stream=False)
        except BaseException:
            d: PipelineDeliveries[PipelineStream] = PipelineDeliveries()
            with self._lock:
                core.forget(ids, d)
            self._deliver(d)
            raise
        return streams

    def abort(self, req_ids: Sequence[str]) -> None:
        """Abort requests in every stage that holds them; unknown ids are ignored. Each
        one's stream stops (:attr:`PipelineStream.aborted`) once every stage has applied the
        abort, unless the request was done first. Never blocks."""
        if isinstance(req_ids, str):
            raise TypeError("abort() takes a sequence of request ids, not a str")
        d: PipelineDeliveries[PipelineStream] = PipelineDeliveries()
        with self._lock:
            self._core.abort(req_ids, d)
        self._deliver(d)

    # -- stages ------------------------------------------------------------------------------

    def client(self, stage: str) -> StageClient:
        """The client of the stage named *stage* (for what the pipeline does not wrap).
        :class:`KeyError` for an unknown name."""
        try:
            return self._clients[self._names.index(stage)]
        except ValueError:
            raise KeyError(
                f"no stage named {stage!r}; the stages are {list(self._names)}"
            ) from None

    def call_utility(
        self, stage: str, name: str, /, *args: Any, timeout: float | None = None
    ) -> Any:
        """Call utility *name* of the stage named *stage* (as
        :meth:`StageClient.call_utility`)."""
        return self.client(stage).call_utility(name, *args, timeout=timeout)

    def health(self) -> dict[str, StageHealth]:
        """Each stage's health, by name. Never blocks."""
        return {name: c.health() for name, c in zip(self._names, self._clients, strict=True)}

    def stats(self, timeout: float | None = 5.0) -> dict[str, StageStatistics]:
        """Each stage's statistics, by name (:meth:`StageClient.stats`)."""
        return {
            name: c.stats(timeout=timeout)
            for name, c in zip(self._names, self._clients, strict=True)
        }

    # -- closing -----------------------------------------------------------------------------

    def shutdown(self, timeout: float = 5.0, *, drain: float | None = None) -> None:
        """Stop every stage. Without *drain*, at once: requests still in the pipeline end
        with :class:`~enginecore.stage.StageClosedError`. With *drain* (seconds), the stages
        drain one after the other, first to last, so that each finishes what the one before
        sent it; requests still live in a stage at the deadline end with an error naming
        that stage. Blocks; idempotent; thread-safe."""
        if drain is not None and not drain >= 0:
            raise ValueError(f"drain must be >= 0, got {drain}")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            deadline = None if drain is None else time.monotonic() + drain
            for client in self._clients:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                with contextlib.suppress(Exception):
                    client.shutdown(timeout, drain=left)
            d: PipelineDeliveries[PipelineStream] = PipelineDeliveries()
            with self._lock:
                self._core.close(
                    StageClosedError("the pipeline was shut down"), time.monotonic(), d
                )
            self._deliver(d)

    close = shutdown

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<Pipeline {' -> '.join(self._names)}>"

    # -- what the stages say ------------------------------------------------------------------

    def _take_events(self, k: int) -> None:
        """Stage *k*'s client appended to its ordered event stream: hand every event to the
        core, in order. Taken under the pipeline's lock, so two threads that read frames of
        one stage (its receiver and a ``call_utility``) cannot reorder them."""
        client = self._clients[k]
        buf = client._session.events
        if not buf:
            return
        core = self._core
        d: PipelineDeliveries[PipelineStream] = PipelineDeliveries()
        dead: BaseException | None = None
        with self._lock:
            now = time.monotonic()
            while buf:
                ev = buf.popleft()
                if isinstance(ev, Outputs):
                    core.outputs(k, ev.req_ids, ev.finished, ev.payloads, now, d)
                elif isinstance(ev, Aborted):
                    core.aborted(k, ev.req_ids, now, d)
                elif isinstance(ev, ErrorReport):
                    if ev.req_id is not None:
                        core.error(k, ev.req_id, ev.message, now, d)
                    else:
                        logger.warning(
                            "enginecore: pipeline stage %r: %s", self._names[k], ev.message
                        )
                elif isinstance(ev, End) and ev.exc is not None and not self._closed:
                    # The stage's event stream ended with its failure: it is gone.
                    dead = ev.exc
                    exc = dead if isinstance(dead, EngineDeadError) else EngineDeadError(str(dead))
                    core.stage_dead(k, exc, now, d)
        self._deliver(d)
        if dead is not None:
            logger.error(
                "enginecore: pipeline stage %r is gone (%s); the pipeline takes no more requests",
                self._names[k],
                dead,
            )

    def _deliver(self, d: PipelineDeliveries[PipelineStream]) -> None:
        for stream in d.wake:
            stream._wakeup.put(None)  # type: ignore[union-attr]  # set before _waiting
        if d.aborts:
            # The first stage is gone: its reader fails every request.
            with contextlib.suppress(EngineDeadError, StageClosedError):
                self._clients[0].abort(d.aborts)
        if d.freed:
            with self._room:
                self._room.notify_all()


def _check_req_id(req_id: object) -> None:
    if type(req_id) is not str:
        raise TypeError(f"a request id must be a str, got {type(req_id).__name__}")
