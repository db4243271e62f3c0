"""The blocking stage pipeline: :class:`Pipeline` and :class:`PipelineStream`.

A pipeline runs each request through several stage processes in order (an encoder, an
LLM, a vocoder). Data goes from stage to stage directly, over ZeroMQ (:mod:`._pipe_stage`);
the parent holds the coordinator, which carries only control (:mod:`._pipeline_core`): the
caller's adds go to the first stage, the caller's aborts chase the data from the first
stage on, and each stage tells the coordinator what it sends the caller and when a request
ended in it. ``docs/pipelines.md`` is the guide; :mod:`._pipelinebase` has what this shares
with :class:`~._apipeline.AsyncPipeline`.

The coordinator is the client of every stage (a :class:`~._client.StageClient` each, with
the ordered event stream on and no per-request streams). Each stage's events go to the core
on the thread that read them, the client's receiver (``StageClient._event_sink``), under
the pipeline's lock, which is also the lock of every :class:`PipelineStream`: the pipeline
has no thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from . import _clientbase
from ._client import RequestStream, StageClient
from ._edge import LINKS_UTILITY
from ._errors import StageStartupError
from ._pipeline_core import PipelineDeliveries, check_budget
from ._pipelinebase import (
    PIPE_FACTORY,
    LaunchLinks,
    PipelineBase,
    PipelineStage,
    check_drain,
    check_startup_timeout,
    check_timeout,
    launch_options,
    named_startup_error,
    order_clients,
    retry_counts,
    stage_specs,
)
from ._statistics import StageStatistics

__all__ = ["Pipeline", "PipelineStream"]

logger = logging.getLogger("enginecore.stage")


def _stop_stage(name: str, client: StageClient, timeout: float, drain: float | None) -> int | None:
    """Shut one stage process down for :meth:`Pipeline.shutdown`, which stops the others
    whatever happens to this one; its exit code. A failure is logged, not raised
    (``None``)."""
    try:
        return client.shutdown(timeout, drain=drain)
    except Exception as exc:
        logger.warning("enginecore: stopping pipeline stage %r failed: %r", name, exc)
        return None


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


def _grant(links: LaunchLinks, key: bytes) -> None:
    """Before a stage's process that links with *key* starts: the next stage (on TCP)
    admits it (:meth:`LaunchLinks.grant`)."""
    _authorize(links.grant(key))


def _authorize(grants: list[tuple[StageClient, list[bytes]]]) -> None:
    """Each stage of *grants* (on Ray, or local on TCP) admits its keys from now on, its
    owner's too (a key rotation); returns once each has."""
    from ._launch import Launched

    for target, keys in grants:
        launched = target._launched
        if isinstance(launched, Launched):
            launched.authorize(keys)
        else:
            from .ray import grant_links

            grant_links(target, keys)


class Pipeline(PipelineBase[PipelineStream, StageClient]):
    """Requests through several stages, with one client's API at the entrance.

    Build one with :meth:`launch`. :meth:`add` and :meth:`add_many` send requests to the
    first stage and return their :class:`PipelineStream`; :meth:`abort` aborts them in every
    stage; :meth:`health`, :meth:`stats` and :meth:`call_utility` reach each stage by name;
    :meth:`shutdown` (or leaving the ``with`` block) stops every stage. Thread-safe.

    *max_in_flight* and *max_bytes* are the admission budget: at most that many requests,
    and bytes of them (the frames that bring them to the first stage), are in the pipeline
    at once, each counted from :meth:`add` until the request is over in every stage. An
    :meth:`add` without room waits for it (or raises
    :class:`~enginecore.stage.PipelineFullError`: ``wait=False``, or its *timeout*), before
    the first stage does any work.
    """

    def __init__(
        self,
        clients: Sequence[StageClient],
        names: Sequence[str],
        *,
        max_in_flight: int | None = None,
        max_bytes: int | None = None,
        shm_prefix: str | None = None,
        retry: Sequence[int] | None = None,
        replicas: Sequence[int] | None = None,
        specs: Sequence[PipelineStage] | None = None,
        startup_timeout: float = 60.0,
        link_keys: Mapping[tuple[int, int], bytes] | None = None,
    ) -> None:
        # Private: use launch().
        lock = threading.Lock()
        super().__init__(
            clients,
            names,
            max_in_flight,
            max_bytes,
            lock,
            shm_prefix,
            retry,
            replicas,
            specs,
            startup_timeout,
            link_keys,
        )
        self._thread_lock = lock
        self._room = threading.Condition(lock)
        self._close_lock = threading.Lock()
        # Restarts (PipelineStage(restart=...)): one thread per process being restarted,
        # one start at a time (each learns the current addresses of the next stage's
        # processes); set when the pipeline closes, which ends every backoff.
        self._restart_threads: set[threading.Thread] = set()
        self._restart_lock = threading.Lock()
        self._stopping = threading.Event()
        # Each stage's events are taken on the thread that read them (its client's
        # receiver, or a call_utility reading meanwhile), as the client appends them to its
        # ordered event stream: no thread of the pipeline's own, no hand-over between two.
        for k, stage_clients in enumerate(self._replicas):
            for r, client in enumerate(stage_clients):
                client._event_sink = functools.partial(self._take_events, k, r, client)
                self._take_events(k, r, client)  # anything that came before the sink was set

    @classmethod
    def launch(
        cls,
        stages: Sequence[PipelineStage | str],
        *,
        max_in_flight: int | None = None,
        max_bytes: int | None = None,
        startup_timeout: float = 60.0,
    ) -> Pipeline:
        """Start one stage process per item of *stages* (a :class:`PipelineStage`, or a
        factory import string for a stage with no options), or ``replicas`` of them for a
        replica pool, connect each to the next (every replica to every replica of the next
        stage), and return the pipeline. The stages start last to first, each knowing where
        the next one's processes listen. If one fails to start, the ones started are shut
        down and its :class:`~enginecore.stage.StageStartupError` is raised. A stage
        with a ``placement`` runs in a Ray actor, its links in over CURVE
        (``docs/pipelines.md``, "Stages on other hosts"); no actor is left after a failed
        launch or a shutdown."""
        specs = stage_specs(stages)
        check_budget(max_in_flight, max_bytes)
        check_startup_timeout(startup_timeout)
        clients: list[StageClient] = []
        links = LaunchLinks(specs, startup_timeout)
        try:
            for k, r in links.plan:
                kwargs, plan, key = links.process(k, r)
                if key is not None:
                    _grant(links, key)
                if plan is None:
                    options = launch_options(specs, k, r)
                    try:
                        client = StageClient._launch(
                            PIPE_FACTORY, kwargs, startup_timeout, True, options
                        )
                    except StageStartupError as exc:
                        raise named_startup_error(specs[k], r, exc) from None
                else:
                    from .ray import open_on_ray

                    grant = functools.partial(_grant, links)
                    try:
                        client = open_on_ray(
                            plan, StageClient._open, ordered_events=True, grant=grant
                        )
                    except StageStartupError as exc:  # named as a local stage's is
                        raise named_startup_error(specs[k], r, exc) from None
                clients.append(client)
                links.started(k, r, client)
        except BaseException:
            for client in clients:
                with contextlib.suppress(Exception):
                    client.shutdown()
            links.unlink()
            raise
        clients = order_clients(specs, clients)
        names = [s.name or s.factory for s in specs]
        return cls(
            clients,
            names,
            max_in_flight=max_in_flight,
            max_bytes=max_bytes,
            shm_prefix=links.prefix,
            retry=retry_counts(specs),
            replicas=[spec.replicas for spec in specs],
            specs=specs,
            startup_timeout=startup_timeout,
            link_keys=links.link_keys,
        )

    # -- requests ---------------------------------------------------------------------------

    def add(
        self, req_id: str, data: Any, *, wait: bool = True, timeout: float | None = None
    ) -> PipelineStream:
        """Send request *req_id* with *data* to the first stage; return its stream.

        Without room in the budget, waits for it (at most *timeout* seconds), or raises
        :class:`~enginecore.stage.PipelineFullError` at once with ``wait=False``. Raises
        :class:`TypeError` if *data* is not wire-encodable and :class:`ValueError` if
        *req_id* is still in the pipeline (both before anything is sent),
        :class:`~enginecore.stage.NoReplicaError` at once while a stage that restarts has
        no live process (``PipelineStage(restart=...)``: it is being started again), else
        the pipeline's failure (a stage died, or it was closed). While a stage's client
        drains it (``pipe.client(stage).shutdown(drain=...)``), the first stage's included,
        the stream ends with that stage's :class:`~enginecore.stage.PipelineRequestError`."""
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
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, got {type(wait).__name__}")
        if not items:
            with self._thread_lock:  # refused as a client's once shut down, or failed
                self._check_open()
                self._core.check(())
            return []
        core = self._core
        ids, parts, nbytes = self._frame(items, many)
        deadline = _clientbase.deadline_after(timeout)
        now = time.monotonic()
        streams = [PipelineStream(rid, self._thread_lock, now) for rid in ids]
        with self._thread_lock:
            waited = False
            while not self._check_open() and not core.admissible(ids, nbytes):
                if not wait:
                    raise core.full_error(None)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise core.full_error(timeout)
                self._room.wait(left)
                waited = True
            if waited:  # sent now, not when the wait for room began (the timings' sent_at)
                now = time.monotonic()
                for stream in streams:
                    stream._sent_at = now
            failed = self._open_and_send(ids, streams, parts, nbytes, many, items)
        if failed is not None:
            self._failed_send(failed)
        return streams

    def abort(self, req_ids: Sequence[str]) -> None:
        """Abort requests in every stage that holds them; unknown ids are ignored. Each
        one's stream stops (:attr:`PipelineStream.aborted`) once every stage has applied the
        abort, unless the request was done first. Never blocks. Once :meth:`shutdown` has
        stopped every stage, :class:`~enginecore.stage.StageClosedError` (during a drain,
        aborts are taken)."""
        self._abort(req_ids)

    # -- stages ------------------------------------------------------------------------------

    def call_utility(
        self,
        stage: str,
        name: str,
        /,
        *args: Any,
        timeout: float | None = None,
        replica: int | None = None,
    ) -> Any:
        """Call utility *name* of the stage named *stage* (as
        :meth:`StageClient.call_utility`). A replica pool: with *replica*, that replica's
        answer; without, a list of every replica's answers, in order (the first error
        raises). :class:`~enginecore.stage.StageClosedError` once :meth:`shutdown` has
        begun, as a closing client's."""
        clients, many = self._utility_clients(stage, replica)
        if not many:
            return clients[0].call_utility(name, *args, timeout=timeout)
        return [client.call_utility(name, *args, timeout=timeout) for client in clients]

    def stats(self, timeout: float | None = 10.0) -> dict[str, StageStatistics | Exception]:
        """Each stage's statistics, by name (:meth:`StageClient.stats`), as ``{name:
        statistics or exception}``, as :meth:`StagePool.stats
        <enginecore.stage.StagePool.stats>` answers: a dead stage's entry is its
        :class:`~enginecore.stage.EngineDeadError` (and one that did not answer within
        *timeout* seconds, a :class:`TimeoutError`), so that the live stages' numbers can
        still be read once one died. A replica pool's replicas are ``name[r]``. Every stage is asked
        at once (on threads of the call's), so a stage that does not answer costs one
        *timeout*, however many do not. :class:`ValueError` for a negative or NaN
        *timeout*, :class:`TypeError` for a non-number;
        :class:`~enginecore.stage.StageClosedError` once :meth:`shutdown` is over, as a
        closed client's and a closed pool's. Thread-safe."""
        _clientbase.deadline_after(timeout)  # the call's error, not each stage's entry
        self._check_shut_down()
        asked = list(zip(self._keys, self._clients, strict=True))
        out: dict[str, StageStatistics | Exception] = {}
        with concurrent.futures.ThreadPoolExecutor(
            len(asked), thread_name_prefix="enginecore-pipeline-stats"
        ) as ex:
            futures = [(name, ex.submit(client.stats, timeout)) for name, client in asked]
            for name, future in futures:
                try:
                    out[name] = future.result()
                except Exception as exc:
                    out[name] = exc
        return out

    # -- restarts ----------------------------------------------------------------------------

    def _schedule_restart(self, k: int, r: int, delay: float) -> None:
        thread = threading.Thread(
            target=self._restart, args=(k, r, delay), name="enginecore-pipeline-restart"
        )
        thread.daemon = True
        with self._thread_lock:
            if self._closed:
                return
            self._restart_threads.add(thread)
            thread.start()  # in the lock: shutdown() never joins a thread not yet started

    def _restart(self, k: int, r: int, delay: float | None) -> None:
        """Thread: release the dead process's client, then start the process again after
        *delay*, and after each failed start's delay, until it is up, fails for good or the
        pipeline closes (a process started as it closes is stopped here). An unexpected
        error in the restart itself (not a failed start: those are counted and tried again)
        is logged, and the process failed (:meth:`_give_up_restart`): it would otherwise read
        ``restarting`` for good; a process it had started is stopped."""
        starting = False  # this try has begun to start the process (``starting``: its own)
        client: StageClient | None = None  # what this try started, not yet up
        try:
            with contextlib.suppress(Exception):
                self._replicas[k][r].shutdown(1.0)  # dead: reap it, close its sockets
            while delay is not None:
                if self._stopping.wait(delay):
                    return
                with self._restart_lock:
                    generation = self._restarting(k, r)
                    if generation is None:
                        return
                    starting = True
                    try:
                        client = self._start(k, r, generation)
                    except Exception as exc:
                        starting = False
                        delay = self._start_failed(k, r, exc)
                        continue
                    try:
                        up = self._link(k, r, client)
                    except Exception as exc:  # a failed start: stop it, count it, try again
                        self._link_failed(k, r, exc)
                        with contextlib.suppress(Exception):
                            client.shutdown(1.0)
                        client, starting = None, False
                        delay = self._unheard_start(k, r, exc)
                        continue
                    if not up:
                        with contextlib.suppress(Exception):
                            client.shutdown(1.0)
                    return
        except Exception as exc:
            logger.exception("enginecore: restarting a pipeline stage failed")
            try:
                self._give_up_restart(k, r, starting, f"its restart failed ({exc!r})")
            except Exception:
                logger.exception("enginecore: giving up a pipeline stage's restart failed")
            if client is not None and (not self._closed or self._replicas[k][r] is not client):
                with contextlib.suppress(Exception):
                    client.shutdown(1.0)
        finally:
            with self._thread_lock:
                self._restart_threads.discard(threading.current_thread())

    def _start(self, k: int, r: int, generation: int) -> StageClient:
        """Start process *r* of stage *k* again (:meth:`_restart_plan`): locally or on Ray,
        the keys of CURVE links granted and admitted first (``docs/pipelines.md``,
        "Restart"); what it started is stopped if a step after the start fails."""
        kwargs, plan, key = self._restart_plan(k, r, generation)
        if key is not None:  # a local process whose next stage is on Ray
            _authorize(self._grants(k, r, key))
        if plan is None:  # on TCP: the stage before's link keys admitted at start
            options = launch_options(self._specs, k, r, self._admitted(k) or ())
            try:
                return StageClient._launch(
                    PIPE_FACTORY, kwargs, self._startup_timeout, True, options
                )
            except StageStartupError as exc:
                raise named_startup_error(self._specs[k], r, exc) from None
        from .ray import grant_links, open_on_ray

        def grant(key: bytes) -> None:
            _authorize(self._grants(k, r, key))

        try:
            client: StageClient = open_on_ray(
                plan, StageClient._open, ordered_events=True, grant=grant
            )
        except StageStartupError as exc:  # named as a local stage's is
            raise named_startup_error(self._specs[k], r, exc) from None
        try:
            admitted = self._admitted(k)
            if admitted is not None:  # before the stage before it links to it
                grant_links(client, admitted)
        except BaseException:
            with contextlib.suppress(Exception):
                client.shutdown(1.0)
            raise
        return client

    def _link(self, k: int, r: int, client: StageClient) -> bool:
        """Put the new *client* in place, link it to its neighbours and wait until the
        previous stage's processes have applied the ``link`` (a utility call after it on
        the same connection), then route to it. ``False``: the pipeline closes.

        The barrier asks every process at once and waits for them all together, up to the
        startup timeout in all (a process that dies answers at once, with its death), and
        a shutdown ends the wait at once (:attr:`_stopping`).

        First, before the new process is put in place and the ``link`` sent, it waits until
        the stage before it has answered for every request the dead process held
        (:meth:`_linkable`), up to the startup timeout (then :class:`TimeoutError`: a
        failed start); its answers and deaths wake it, and so does a shutdown."""
        if not self._await_linkable(k, r):
            return False
        futures: list[concurrent.futures.Future[Any]] = []
        for target in self._install(k, r, client):
            try:
                futures.append(target.call_utility_future(LINKS_UTILITY))
            except Exception as exc:  # a process that died: its death tells
                self._link_unconfirmed(k, r, exc)
        deadline = time.monotonic() + self._startup_timeout
        pending = set(futures)
        while pending and not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pending = concurrent.futures.wait(pending, timeout=min(left, 0.25)).not_done
        for future in futures:
            if not future.done():  # not answered: the deadline, or a shutdown
                future.cancel()  # drops a late answer
                if not self._stopping.is_set():
                    late = TimeoutError(f"no answer within {self._startup_timeout} s")
                    self._link_unconfirmed(k, r, late)
            elif not future.cancelled() and (error := future.exception()) is not None:
                self._link_unconfirmed(k, r, error)  # a process that died: its death tells
        return self._started(k, r)  # False once the pipeline closes

    def _await_linkable(self, k: int, r: int) -> bool:
        """Wait until the new process *r* of stage *k* may be linked in (:meth:`_linkable`):
        ``False`` if the pipeline closes meanwhile; :class:`TimeoutError` after the startup
        timeout."""
        if self._linkable(k, r):
            return not self._stopping.is_set()
        ready = threading.Event()
        self._link_wait(k, r, ready.set)
        try:
            deadline = time.monotonic() + self._startup_timeout
            while not self._linkable(k, r):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._unlinkable(k, r)
                ready.wait(min(left, threading.TIMEOUT_MAX))  # a longer one: OverflowError
                ready.clear()
        finally:
            self._link_wait(k, r, None)
        return not self._stopping.is_set()

    # -- closing -----------------------------------------------------------------------------

    def shutdown(
        self, timeout: float = 5.0, *, drain: float | None = None
    ) -> dict[str, int | None]:
        """Stop every stage; return each stage process's exit code, by its name (a pooled
        stage's processes ``name[r]``, as :meth:`health` names them; ``None``: unknown, or
        its stop failed). Without *drain*, every stage process at once, now: requests
        still in the pipeline end with :class:`~enginecore.stage.StageClosedError`. With
        *drain* (seconds), the stages drain one after the other, first to last (a stage's
        replicas at once), so that each finishes what the one before sent it; requests
        still live in a stage at the deadline end with an error naming that stage. A stage
        that fails to stop is logged (``enginecore.stage``); the others still stop.
        Blocks; idempotent; thread-safe. A call interrupted (``KeyboardInterrupt`` while it
        waits for a stage) is finished by the next one."""
        check_timeout(timeout)
        check_drain(drain)
        with self._close_lock:
            if self._shutdown_done:
                return self._shutdown_result()
            with self._thread_lock:
                self._closed = True
                restarts = list(self._restart_threads)
                self._room.notify_all()  # an add waiting for room: it is refused
            self._stopping.set()
            self._wake_link_waits(every=True)  # a restart waiting to link in: it stops
            for thread in restarts:  # a start under way: it stops what it started
                thread.join()
            deadline = None if drain is None else time.monotonic() + drain
            self._draining = drain is not None  # health(): the stage draining is alive
            for k, wave in self._stop_waves(drain is not None):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if len(wave) == 1:
                    name, client = wave[0]
                    self._exit_codes[name] = _stop_stage(name, client, timeout, left)
                else:
                    with concurrent.futures.ThreadPoolExecutor(len(wave)) as ex:
                        stops = [
                            (name, ex.submit(_stop_stage, name, client, timeout, left))
                            for name, client in wave
                        ]
                    for name, stop in stops:
                        self._exit_codes[name] = stop.result()
                if k is not None:
                    self._stage_stopped(k)  # later aborts go to the stages still draining
            self._close_core()  # sets _shutdown_done, last
            return self._shutdown_result()

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

    def _deliver(self, d: PipelineDeliveries[PipelineStream]) -> None:
        for stream in d.wake:
            stream._wakeup.put(None)  # type: ignore[union-attr]  # set before _waiting
        if d.aborts or d.stage_aborts or d.gone or d.replays or d.releases:
            self._send_aborts(d)
        if d.freed:
            with self._room:
                self._room.notify_all()
