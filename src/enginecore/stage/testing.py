"""Engines and factories for tests, examples and demos of stage processes.

A stage process is started with *spawn*: it imports its engine factory by name in a fresh
interpreter, so the factory must live in an importable module. A test suite's own
``tests/`` directory usually is not one, hence these ship with the library, like
:class:`~enginecore.CountdownEngine`. They are for tests and demos, not for production.

Factories (``"enginecore.stage.testing:NAME"``):

- ``countdown`` -> a :class:`~enginecore.CountdownEngine`.
- ``scripted`` -> a :class:`ScriptedEngine` (a CountdownEngine with test utilities).
- ``device(step_s=0.005)`` -> a :class:`DeviceEngine`: a CountdownEngine whose every step
  takes *step_s* seconds with the GIL released, whatever its batch (a stand-in for an
  accelerator; the replica pool's benchmarks and tests).
- ``echo`` -> an :class:`EchoEngine`: each request's one output is its own data (arrays
  and buffers included), and utility ``"echo"`` returns its arguments.
- ``relay(step_s=0.0, per_step=None)`` -> a :class:`RelayEngine`: a streaming pipeline
  stage (``docs/pipelines.md``) whose every input becomes one output, payload unchanged.
- ``flaky(fail_first=1, when="add")`` -> a :class:`FlakyRelayEngine` (fails each request's
  first attempts: ``Retry``); ``dying_on_retry(at="fence")`` -> a
  :class:`DyingOnRetryEngine` (its process dies when a request it failed is retried).
- Edge functions for pipelines: ``tee`` (every output to the next stage and the caller),
  ``to_caller`` (to the caller only), ``inflate`` (100,000 bytes on for each output, the
  output to the caller), ``checked_edge`` and ``last_fails`` (fail on purpose for some
  inputs), ``stamp`` and ``hop_seconds`` (one hop timed inside a pipeline: the first
  stamps each output as it leaves, the second sends the caller the seconds since).
- ``failing_factory(message)`` raises :class:`RuntimeError` (startup error path).
- ``exiting_factory(code)`` ends the process with ``os._exit(code)`` during startup.
- ``relay_once(marker)`` -> a :class:`RelayEngine` the first time, then raises
  :class:`RuntimeError` at every later start (a restart that fails), *marker* a file path.
- ``sleeping_factory(seconds)`` sleeps, then returns a CountdownEngine (startup timeout).
- ``killed_factory()`` is killed by SIGKILL during startup.
- ``barrier_factory(directory, parties, timeout=20.0)`` returns a CountdownEngine only once
  *parties* stages are being built at the same time (launches that must overlap).
- ``pipelined(depth=2, device_s=0.0, exact_abort=True)`` -> a
  :class:`PipelinedCountdownEngine` (a :class:`~enginecore.PipelinedEngine`).
- ``TokenEchoEngine(model=None, step_delay=0.0, max_model_len=2048)``: a token generator
  with the request contract of ``enginecore.engines.transformers.TransformersEngine``, and
  no model: a fast test double for a server in front of that engine.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

from .._engine import CountdownEngine
from .._exceptions import LoopEndedError, RequestRejected
from ._edge import NOTHING

__all__ = [
    "DeviceEngine",
    "DyingOnRetryEngine",
    "EchoEngine",
    "FlakyRelayEngine",
    "PipelinedCountdownEngine",
    "RelayEngine",
    "ScriptedEngine",
    "TokenEchoEngine",
    "barrier_factory",
    "checked_edge",
    "countdown",
    "device",
    "dying_on_retry",
    "echo",
    "exiting_factory",
    "failing_factory",
    "flaky",
    "inflate",
    "killed_factory",
    "last_fails",
    "pipelined",
    "relay",
    "scripted",
    "sleeping_factory",
    "tee",
    "to_caller",
]


class Unencodable:
    """An output payload that no wire can carry."""

    def __repr__(self) -> str:
        return "Unencodable()"


_LONE_SURROGATE: Final = "bad \ud800 text"


class _IntSubclass(int):
    """An ``int`` subclass: msgpack would silently turn it into a plain ``int``."""


# poison(rid, kind): what the next output of rid carries instead of its payload.
_POISONS: Final[dict[Any, Any]] = {
    "surrogate": lambda: _LONE_SURROGATE,
    "int_too_big": lambda: 2**64,
    "int_too_small": lambda: -(2**63) - 1,
    "int_subclass": lambda: _IntSubclass(5),
    "nested": lambda: [1, {"k": Unencodable()}],
}


class ScriptedEngine(CountdownEngine):
    """:class:`~enginecore.CountdownEngine` plus utilities that script failures.

    Utilities, besides ``div`` and ``num_requests``:

    - ``log`` -> the list of ``"add <rid>"`` / ``"abort <rid>"`` calls seen, in order (a
      rejected ``add`` is logged too: the engine saw it).
    - ``echo`` -> its arguments, as a list.
    - ``raise_loop_ended(message)`` -> raises ``LoopEndedError(message)``: the utility's own
      error, which the caller must get even when it reads like the loop's answer to a call
      it never applied.
    - ``fail_next_add`` -> the next ``add()`` raises ``RuntimeError("scripted add failure")``:
      not a :class:`~enginecore.RequestRejected`, so fatal, in a stage too.
    - ``reject(rid, message, last=False)`` -> the next output of *rid* is routed with the
      payload ``RequestRejected(message)``, which ends *rid* with that error in a stage;
      with *last*, that output is *rid*'s last (``finished``) and the engine drops *rid*.
    - ``fail_next_step`` -> the next ``step()`` raises ``RuntimeError("scripted step failure")``.
    - ``system_exit_next_step(code)`` -> the next ``step()`` raises ``SystemExit(code)``.
    - ``stall_next_step(seconds)`` -> the next ``step()`` (there is one, even with no
      request) sleeps that long first: a step the stage's watchdog sees as stalled.
    - ``exit(code)`` -> the process ends at once with ``os._exit(code)``.
    - ``unencodable_result`` -> returns a ``set``, which the wire refuses;
      ``unencodable_result("surrogate")`` returns a ``str`` with a lone surrogate, which
      passes ``check_encodable`` but cannot be encoded as UTF-8.
    - ``poison(rid)`` -> the next output of *rid* carries an unencodable payload;
      ``poison(rid, "surrogate")``: a ``str`` with a lone surrogate; ``"int_too_big"``
      (``2**64``), ``"int_too_small"`` (``-2**63 - 1``), ``"int_subclass"``, ``"nested"``
      (an unencodable object inside a list): other payloads the wire refuses.
    - ``payload(rid, value)`` -> the next output of *rid* carries *value* instead.
    - ``unrouted(value)`` -> the next ``step()`` also returns the bare *value* (no request id).
    - ``sleep(seconds)`` -> blocks the loop that long.
    - ``pace(seconds)`` -> from now on, every ``step()`` sleeps that long first (0: no
      more).

    Its ``stats()`` reports ``running`` (requests with steps left), ``pace`` and
    ``stats_calls``.
    - ``deferred(seconds, value=None)`` -> a :class:`~concurrent.futures.Future` that a timer
      completes with *value* after *seconds* (a deferred utility: the loop goes on);
      ``deferred_never`` -> a future nobody completes (answered with an error at the end).
    - ``linger(seconds)`` -> starts a non-daemon thread that sleeps that long, which keeps
      the process from exiting after its loop has ended.
    - ``emit_log(logger, level, message, exc=False)`` -> logs *message* at *level* (an int)
      on ``logging.getLogger(logger)``, with the traceback of a ``ValueError("scripted
      log error")`` if *exc*; returns whether the logger was enabled for *level*.
    - ``record_fields`` -> ``[stage, pid]``: the ``stage`` and ``process`` attributes of a
      record made by a logger in the stage (``None`` for a missing attribute).
    """

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self._fail_next = False
        self._fail_next_add = False
        self._rejections: dict[str, tuple[str, bool]] = {}
        self._system_exit: int | None = None
        self._poisoned: dict[str, Any] = {}
        self._unrouted: list[Any] = []
        self._stall_next = 0.0
        self._pace = 0.0
        self._stats_calls = 0

    def has_work(self) -> bool:
        return (
            super().has_work()
            or self._fail_next
            or self._system_exit is not None
            or self._stall_next > 0
            or bool(self._unrouted)
        )

    def add(self, req_id: str, data: Any) -> None:
        self.log.append(f"add {req_id}")
        if self._fail_next_add:
            self._fail_next_add = False
            raise RuntimeError("scripted add failure")
        super().add(req_id, data)

    def abort(self, req_ids: Sequence[str]) -> None:
        self.log.extend(f"abort {rid}" for rid in req_ids)
        super().abort(req_ids)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "log":
            return list(self.log)
        if name == "echo":
            return list(args)
        if name == "raise_loop_ended":
            raise LoopEndedError(args[0])
        if name == "fail_next_add":
            self._fail_next_add = True
            return None
        if name == "reject":
            self._rejections[args[0]] = (args[1], bool(args[2]) if len(args) > 2 else False)
            return None
        if name == "fail_next_step":
            self._fail_next = True
            return None
        if name == "stall_next_step":  # the next step sleeps args[0] seconds first
            self._stall_next = float(args[0])
            return None
        if name == "deferred":  # answered args[0] seconds later, with args[1]
            return _later(float(args[0]), args[1] if len(args) > 1 else None)
        if name == "deferred_never":  # a future nobody completes
            return Future()
        if name == "system_exit_next_step":
            self._system_exit = args[0]
            return None
        if name == "exit":
            os._exit(args[0])
        if name == "unencodable_result":
            return _LONE_SURROGATE if args == ("surrogate",) else {1, 2, 3}
        if name == "poison":
            kind = args[1] if len(args) > 1 else None
            self._poisoned[args[0]] = _POISONS.get(kind, Unencodable)()
            return None
        if name == "payload":
            self._poisoned[args[0]] = args[1]
            return None
        if name == "unrouted":
            self._unrouted.append(args[0])
            return None
        if name == "pace":  # every step sleeps args[0] seconds from now on
            self._pace = float(args[0])
            return None
        if name == "sleep":
            time.sleep(args[0])
            return None
        if name == "emit_log":
            return _emit_log(*args)
        if name == "record_fields":
            record = logging.getLogger("enginecore.test").makeRecord(
                "enginecore.test", logging.INFO, __file__, 0, "fields", (), None
            )
            return [getattr(record, "stage", None), getattr(record, "process", None)]
        if name == "linger":
            threading.Thread(target=time.sleep, args=(args[0],), name="linger").start()
            return None
        return super().utility(name, args)

    def stats(self) -> dict[str, float]:
        """The engine's own numbers (``docs/engines.md``): ``running`` requests, the
        ``pace`` in seconds, and the ``stats_calls`` made so far."""
        self._stats_calls += 1
        return {
            "running": len(self._remaining),
            "pace": self._pace,
            "stats_calls": self._stats_calls,
        }

    def step(self) -> list[Any]:
        if self._stall_next:
            seconds, self._stall_next = self._stall_next, 0.0
            time.sleep(seconds)
        if self._pace:
            time.sleep(self._pace)
        if self._fail_next:
            raise RuntimeError("scripted step failure")
        if self._system_exit is not None:
            raise SystemExit(self._system_exit)
        outputs: list[Any] = list(super().step())
        if self._rejections:
            for i, (rid, _) in enumerate(outputs):
                if rid in self._rejections:
                    message, last = self._rejections.pop(rid)
                    if last:
                        self._remaining.pop(rid, None)
                    outputs[i] = (rid, RequestRejected(message), last)
        if self._poisoned:
            for i, (rid, _) in enumerate(outputs):
                if rid in self._poisoned:
                    outputs[i] = (rid, self._poisoned.pop(rid))
        if self._unrouted:
            outputs.extend(self._unrouted)
            self._unrouted.clear()
        return outputs

    @staticmethod
    def route_output(output: Any) -> tuple[str | None, bool, Any]:  # type: ignore[override]
        if type(output) is tuple and type(output[1]) is int:
            return CountdownEngine.route_output(output)
        if type(output) is tuple and len(output) == 3:  # (rid, RequestRejected, last)
            return output[0], output[2], output[1]
        if type(output) is tuple:
            return output[0], False, output[1]
        return None, False, output

    @staticmethod
    def route_outputs(  # type: ignore[override]
        outputs: list[Any],
    ) -> tuple[list[str | None], list[bool], list[Any]]:
        # The batch hook inherited from CountdownEngine would be preferred by the stage and
        # bypass route_output's cases (poisoned payloads, unrouted values): route each here.
        triples = [ScriptedEngine.route_output(out) for out in outputs]
        return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]


def _emit_log(name: str, level: int, message: str, exc: bool = False) -> bool:
    log = logging.getLogger(name)
    if not exc:
        log.log(level, message)
    else:
        try:
            raise ValueError("scripted log error")
        except ValueError:
            log.log(level, message, exc_info=True)
    return log.isEnabledFor(level)


class EchoEngine:
    """Each request has one output, its own data, in the step after its ``add``: for
    round trips of any payload (arrays included). ``utility("echo", args)`` returns *args*
    as a list; ``utility("num_requests", ())`` the number of requests waiting. An ``add``
    of an id that is waiting raises :class:`~enginecore.RequestRejected`."""

    def __init__(self) -> None:
        self._waiting: dict[str, Any] = {}

    def has_work(self) -> bool:
        return bool(self._waiting)

    def add(self, req_id: str, data: Any) -> None:
        if req_id in self._waiting:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        self._waiting[req_id] = data

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self._waiting.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "echo":
            return list(args)
        if name == "num_requests":
            return len(self._waiting)
        raise ValueError(f"EchoEngine has no utility {name!r:.200}; known: 'echo', 'num_requests'")

    def step(self) -> list[tuple[str, Any]]:
        out = list(self._waiting.items())
        self._waiting = {}
        return out

    @staticmethod
    def route_outputs(
        outputs: list[tuple[str, Any]],
    ) -> tuple[list[str], list[bool], list[Any]]:
        """Every output finishes its request."""
        return [rid for rid, _ in outputs], [True] * len(outputs), [d for _, d in outputs]


_TOKEN_REQUEST_KEYS: Final = frozenset(
    {"prompt", "max_tokens", "temperature", "top_p", "seed", "stop_token_ids"}
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _TokenRequest:
    __slots__ = ("emitted", "max_tokens", "offset", "prompt", "stop")

    def __init__(self, prompt: list[int], max_tokens: int, offset: int, stop: set[int]) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.offset = offset
        self.stop = stop
        self.emitted = 0


class TokenEchoEngine:
    """A stand-in for a token-generating engine, with no model: the request and output
    contract of ``enginecore.engines.transformers.TransformersEngine``, for fast tests of
    what sits in front of it (``examples/openai_server.py``).

    A request is a dict ``{"prompt": [token ids], "max_tokens": int = 16, "temperature":
    float = 0, "top_p": float = 1, "seed": int | None, "stop_token_ids": [int]}``; any
    other key, a text prompt (this engine has no tokenizer), an empty prompt, a negative id
    (or one >= *vocab_size*, when given), ``max_tokens < 1``, ``temperature < 0``, ``top_p``
    outside ``(0, 1]``, or a prompt plus ``max_tokens`` longer than *max_model_len* is a
    :class:`~enginecore.RequestRejected`.

    Every step (after sleeping *step_delay* seconds, when there is work) gives each live
    request one token: the prompt's ids in a cycle, starting at the prompt's first id, or,
    when ``temperature > 0`` and a ``seed`` is given, at index ``seed``. Each output is
    ``{"token_ids": [id]}``; the last one also has ``"finish_reason"``: ``"stop"`` if the
    token is in ``stop_token_ids`` (the token is included), else ``"length"`` after
    ``max_tokens`` tokens. *model* is accepted and ignored, so that a server can launch it
    with the same arguments as the real engine.

    ``stats()`` reports ``running``, ``added``, ``aborted`` and ``finished``; utility
    ``"num_requests"`` returns the live requests, and ``"model_info"`` (as the transformers
    engine's) ``{"max_positions": max_model_len, "vocab_size": vocab_size}``.
    """

    def __init__(
        self,
        model: str | None = None,
        step_delay: float = 0.0,
        max_model_len: int = 2048,
        vocab_size: int | None = None,
    ) -> None:
        self.model = model
        self.step_delay = step_delay
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._live: dict[str, _TokenRequest] = {}
        self._added = 0
        self._aborted = 0
        self._finished = 0

    def has_work(self) -> bool:
        return bool(self._live)

    def add(self, req_id: str, data: Any) -> None:
        if req_id in self._live:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        self._live[req_id] = self._parse(data)
        self._added += 1

    def _parse(self, data: Any) -> _TokenRequest:
        if not isinstance(data, dict):
            raise RequestRejected(f"a request is a dict, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data.keys() - _TOKEN_REQUEST_KEYS)
        if unknown:
            raise RequestRejected(f"unknown parameter(s): {', '.join(unknown)}")
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            raise RequestRejected("a text prompt needs a tokenizer; TokenEchoEngine has none")
        if not isinstance(prompt, list) or not prompt:
            raise RequestRejected("prompt must be a non-empty list of token ids")
        if not all(_is_int(t) and t >= 0 for t in prompt):
            raise RequestRejected("prompt must be a list of token ids (ints >= 0)")
        if self.vocab_size is not None and max(prompt) >= self.vocab_size:
            raise RequestRejected(
                f"prompt has token id {max(prompt)}, outside the vocabulary of {self.vocab_size}"
            )
        max_tokens = data.get("max_tokens", 16)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise RequestRejected(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        temperature = data.get("temperature", 0.0)
        if not _is_number(temperature) or temperature < 0:
            raise RequestRejected(f"temperature must be a number >= 0, got {temperature!r}")
        top_p = data.get("top_p", 1.0)
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise RequestRejected(f"top_p must be in (0, 1], got {top_p!r}")
        seed = data.get("seed")
        if seed is not None and not _is_int(seed):
            raise RequestRejected(f"seed must be an int or None, got {seed!r}")
        stop = data.get("stop_token_ids", [])
        if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
            raise RequestRejected("stop_token_ids must be a list of token ids")
        if len(prompt) + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is longer "
                f"than the model's {self.max_model_len} positions"
            )
        offset = seed if seed is not None and temperature > 0 else 0
        return _TokenRequest(list(prompt), max_tokens, offset, set(stop))

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            if self._live.pop(rid, None) is not None:
                self._aborted += 1

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "num_requests":
            return len(self._live)
        if name == "model_info":
            return {"max_positions": self.max_model_len, "vocab_size": self.vocab_size}
        raise ValueError(
            f"TokenEchoEngine has no utility {name!r:.200}; known: 'num_requests', 'model_info'"
        )

    def stats(self) -> dict[str, float]:
        return {
            "running": len(self._live),
            "added": self._added,
            "aborted": self._aborted,
            "finished": self._finished,
        }

    def step(self) -> list[tuple[str, bool, dict[str, Any]]]:
        if self.step_delay > 0 and self._live:
            time.sleep(self.step_delay)
        out: list[tuple[str, bool, dict[str, Any]]] = []
        for rid, req in list(self._live.items()):
            token = req.prompt[(req.offset + req.emitted) % len(req.prompt)]
            req.emitted += 1
            payload: dict[str, Any] = {"token_ids": [token]}
            if token in req.stop:
                payload["finish_reason"] = "stop"
            elif req.emitted >= req.max_tokens:
                payload["finish_reason"] = "length"
            if "finish_reason" in payload:
                del self._live[rid]
                self._finished += 1
            out.append((rid, "finish_reason" in payload, payload))
        return out

    @staticmethod
    def route_outputs(
        outputs: list[tuple[str, bool, dict[str, Any]]],
    ) -> tuple[list[str], list[bool], list[Any]]:
        """Each output is ``(req_id, finished, payload)``."""
        return [o[0] for o in outputs], [o[1] for o in outputs], [o[2] for o in outputs]


def _later(seconds: float, value: Any) -> Future[Any]:
    """A future that a daemon timer completes with *value* after *seconds*."""
    future: Future[Any] = Future()
    timer = threading.Timer(seconds, future.set_result, (value,))
    timer.daemon = True
    timer.start()
    return future


class _Step:
    """A :class:`PipelinedCountdownEngine` step in flight: the device's future, and the
    requests aborted since its launch (its outputs of those are dropped at collect)."""

    __slots__ = ("aborted", "future")

    def __init__(self, future: Future[list[tuple[str, int]]]) -> None:
        self.future = future
        self.aborted: set[str] = set()


class PipelinedCountdownEngine(CountdownEngine):
    """:class:`~enginecore.CountdownEngine`'s requests, stepped in two phases with a thread
    standing in for the device: a :class:`~enginecore.PipelinedEngine` for tests and demos.

    ``launch()`` takes one step of every live request and decides its outputs there, as a
    device would compute them, then hands them to a one-thread pool that sleeps *device_s*
    (GIL released) and returns them; ``collect(step)`` waits for that (at most 60 s: an
    untimed wait could wedge the stage) and returns the outputs, minus those of requests
    aborted since the launch. With ``exact_abort=False`` it keeps them: an engine that
    breaks the abort contract, for the stage's own guard to catch. ``cancel(step)`` cancels
    the device's work. Runs at :attr:`pipeline_depth` in a stage; the ``step`` it inherits
    is not called there (the loop drives a pipelined engine through launch and collect).
    The utilities are :class:`~enginecore.CountdownEngine`'s, plus ``deferred`` as
    :class:`ScriptedEngine`'s.
    """

    def __init__(
        self, pipeline_depth: int = 2, device_s: float = 0.0, exact_abort: bool = True
    ) -> None:
        super().__init__()
        self.pipeline_depth = pipeline_depth
        self._device_s = device_s
        self._exact_abort = exact_abort
        self._device = ThreadPoolExecutor(1, thread_name_prefix="testing-device")
        self._inflight: collections.deque[_Step] = collections.deque()

    def abort(self, req_ids: Sequence[str]) -> None:
        super().abort(req_ids)
        if self._exact_abort:
            for step in self._inflight:
                step.aborted.update(req_ids)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "deferred":
            return _later(float(args[0]), args[1] if len(args) > 1 else None)
        return super().utility(name, args)

    def launch(self) -> _Step:
        outputs = CountdownEngine.step(self)  # decided now, delivered by collect
        step = _Step(self._device.submit(self._run_device, outputs))
        self._inflight.append(step)
        return step

    def _run_device(self, outputs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        if self._device_s:
            time.sleep(self._device_s)
        return outputs

    def collect(self, step: _Step) -> list[tuple[str, int]]:
        if not self._inflight or self._inflight[0] is not step:
            raise RuntimeError("collect() out of launch order")
        self._inflight.popleft()
        outputs = step.future.result(timeout=60)
        if step.aborted:
            outputs = [out for out in outputs if out[0] not in step.aborted]
        return outputs

    def cancel(self, step: _Step) -> None:
        step.future.cancel()
        if step in self._inflight:
            self._inflight.remove(step)


def pipelined(
    depth: int = 2, device_s: float = 0.0, exact_abort: bool = True
) -> PipelinedCountdownEngine:
    """Factory: a :class:`PipelinedCountdownEngine`."""
    return PipelinedCountdownEngine(depth, device_s, exact_abort)


class DeviceEngine(CountdownEngine):
    """:class:`~enginecore.CountdownEngine` whose every step first sleeps *step_s* seconds
    (``time.sleep``: the GIL is released, as a device kernel releases it), whatever the
    batch: every live request advances by one output per step. Utility ``pid`` returns
    the process id, ``echo`` its arguments, ``sleep(seconds)`` blocks the loop that long."""

    def __init__(self, step_s: float = 0.005) -> None:
        super().__init__()
        if not 0 <= step_s < 60:
            raise ValueError(f"step_s must be seconds in [0, 60), got {step_s!r}")
        self.step_s = step_s

    def step(self) -> list[tuple[str, int]]:
        if self.step_s:
            time.sleep(self.step_s)
        return super().step()

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "pid":
            return os.getpid()
        if name == "echo":
            return list(args)
        if name == "sleep":
            time.sleep(args[0])
            return None
        return super().utility(name, args)


class RelayEngine:
    """A streaming pipeline stage for tests, examples and benchmarks (``docs/pipelines.md``):
    every input of a request becomes one output of it, its payload unchanged, in the next
    step; the request ends once its input is complete (``close_input``) and every input has
    gone out (with the last one, or with the payload :data:`~enginecore.stage.NOTHING` if
    the input closed after that). It has ``feed``, so in a pipeline each payload of the
    previous stage is taken as it arrives. In the first stage, the caller's data is the one
    input. Each step first sleeps *step_s* seconds (``time.sleep``: the GIL is released, as
    for a device), whatever the batch, and sends out at most *per_step* inputs of each
    request (``None``: all it holds), for at most *batch* requests (``None``: all that have
    something; the others wait for a later step, as behind a device's batch size);
    :meth:`pending_inputs` says how many it holds, so that the pipeline counts them against
    the previous stage's window.

    The input ``"reject"`` raises :class:`~enginecore.RequestRejected` (from ``add`` or
    ``feed``), as does an ``add`` of a live id. Utilities: ``pid``, ``echo`` (its
    arguments), ``num_requests``, ``added`` (requests added since it started),
    ``sleep(seconds)`` (blocks the loop that long), ``gate(path, timeout=60.0)`` (blocks
    the loop while the file *path* exists: a test ends the wait when it chooses, by
    removing it; an error after *timeout* seconds) and
    ``hold(on)``: while on, steps emit nothing (the requests wait, as behind a slow
    device). Outside a pipeline nothing closes a request's input, so it never ends: use it
    in pipelines."""

    def __init__(
        self, step_s: float = 0.0, per_step: int | None = None, batch: int | None = None
    ) -> None:
        if not 0 <= step_s < 60:
            raise ValueError(f"step_s must be seconds in [0, 60), got {step_s!r}")
        if per_step is not None and per_step < 1:
            raise ValueError(f"per_step must be >= 1 or None, got {per_step!r}")
        if batch is not None and batch < 1:
            raise ValueError(f"batch must be >= 1 or None, got {batch!r}")
        self.step_s = step_s
        self.per_step = per_step
        self.batch = batch
        self._pending = 0  # inputs held, not yet sent out
        self._inputs: dict[str, list[Any]] = {}  # per live request: inputs not yet out
        self._closed: set[str] = set()  # live requests whose input is complete
        self._ready: dict[str, None] = {}  # requests with something for the next step
        self._hold = False
        self._added = 0

    def has_work(self) -> bool:
        return bool(self._ready) and not self._hold

    def add(self, req_id: str, data: Any) -> None:
        if req_id in self._inputs:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        self._check(data)
        self._added += 1
        self._inputs[req_id] = [data]
        self._ready[req_id] = None
        self._pending += 1

    def feed(self, req_id: str, data: Any) -> None:
        self._check(data)
        self._inputs[req_id].append(data)
        self._ready[req_id] = None
        self._pending += 1

    def pending_inputs(self) -> int:
        """The inputs it holds that have not gone out yet."""
        return self._pending

    def close_input(self, req_id: str) -> None:
        self._closed.add(req_id)
        self._ready[req_id] = None

    @staticmethod
    def _check(data: Any) -> None:
        if isinstance(data, str) and data == "reject":
            raise RequestRejected("the input 'reject' is refused on purpose")

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self._pending -= len(self._inputs.pop(rid, ()))
            self._closed.discard(rid)
            self._ready.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "pid":
            return os.getpid()
        if name == "echo":
            return list(args)
        if name == "num_requests":
            return len(self._inputs)
        if name == "added":
            return self._added
        if name == "sleep":
            time.sleep(args[0])
            return None
        if name == "gate":
            _wait_while(args[0], float(args[1]) if len(args) > 1 else 60.0)
            return None
        if name == "hold":
            self._hold = bool(args[0])
            return None
        raise ValueError(
            f"RelayEngine has no utility {name!r:.200}; known: 'pid', 'echo', 'num_requests', "
            f"'added', 'sleep', 'gate', 'hold'"
        )

    def step(self) -> list[tuple[str, bool, Any]]:
        if self.step_s:
            time.sleep(self.step_s)
        out: list[tuple[str, bool, Any]] = []
        inputs, closed, per_step = self._inputs, self._closed, self.per_step
        ready: dict[str, None] = {}
        todo = list(self._ready)
        if self.batch is not None and len(todo) > self.batch:
            todo, later = todo[: self.batch], todo[self.batch :]
            ready.update(dict.fromkeys(later))  # next steps, in turn
        for rid in todo:
            items = inputs[rid]
            if per_step is not None and len(items) > per_step:
                inputs[rid] = items[per_step:]
                items = items[:per_step]
                ready[rid] = None  # more next step
                done = False
            else:
                inputs[rid] = []
                done = rid in closed
            self._pending -= len(items)
            out += [(rid, False, item) for item in items]
            if done:
                if items:
                    out[-1] = (rid, True, items[-1])
                else:
                    out.append((rid, True, NOTHING))
                del inputs[rid]
                closed.discard(rid)
        self._ready = ready
        return out

    @staticmethod
    def route_outputs(
        outputs: list[tuple[str, bool, Any]],
    ) -> tuple[list[str], list[bool], list[Any]]:
        return [o[0] for o in outputs], [o[1] for o in outputs], [o[2] for o in outputs]


def relay(
    step_s: float = 0.0, per_step: int | None = None, batch: int | None = None
) -> RelayEngine:
    """Factory: a :class:`RelayEngine`."""
    return RelayEngine(step_s, per_step, batch)


class HeadEngine(RelayEngine):
    """A :class:`RelayEngine` that passes on the first *n* inputs of a request and ends it
    then, before its input has ended (a stage that has what it needs, as a stop condition
    would): later inputs of it are ignored. Factory: :func:`head`."""

    def __init__(self, n: int = 1, step_s: float = 0.0) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        super().__init__(step_s)
        self.n = n
        self._taken: dict[str, int] = {}

    def add(self, req_id: str, data: Any) -> None:
        super().add(req_id, data)
        self._taken[req_id] = 1
        if self.n == 1:
            super().close_input(req_id)

    def feed(self, req_id: str, data: Any) -> None:
        taken = self._taken.get(req_id, self.n)
        if taken >= self.n:
            return
        super().feed(req_id, data)
        self._taken[req_id] = taken + 1
        if taken + 1 >= self.n:
            super().close_input(req_id)

    def close_input(self, req_id: str) -> None:
        if req_id in self._inputs:
            super().close_input(req_id)

    def abort(self, req_ids: Sequence[str]) -> None:
        super().abort(req_ids)
        for rid in req_ids:
            self._taken.pop(rid, None)

    def step(self) -> list[tuple[str, bool, Any]]:
        out = super().step()
        for rid, fin, _ in out:
            if fin:
                self._taken.pop(rid, None)
        return out


def head(n: int = 1, step_s: float = 0.0) -> HeadEngine:
    """Factory: a :class:`HeadEngine`."""
    return HeadEngine(n, step_s)


class FlakyRelayEngine(RelayEngine):
    """A :class:`RelayEngine` that fails each request's first *fail_first* attempts (an
    attempt: an ``add`` of its id), for the tests of a pipeline's ``Retry``. *when* says
    how: ``"add"``, its ``add`` raises :class:`~enginecore.RequestRejected`; ``"first"``,
    its first output is a ``RequestRejected`` instead (an error while it is live: the stage
    drops it); ``"last"``, its last output is (after every other output went out). Extra
    utility: ``attempts(req_id)``, how many adds of that id it has seen."""

    def __init__(self, fail_first: int = 1, when: str = "add", step_s: float = 0.0) -> None:
        if when not in ("add", "first", "last"):
            raise ValueError(f"when must be 'add', 'first' or 'last', got {when!r}")
        super().__init__(step_s)
        self.fail_first = fail_first
        self.when = when
        self.attempts: dict[str, int] = {}
        self._failed: set[str] = set()  # failed in this attempt: its later outputs go

    def add(self, req_id: str, data: Any) -> None:
        n = self.attempts[req_id] = self.attempts.get(req_id, 0) + 1
        self._failed.discard(req_id)
        if self.when == "add" and n <= self.fail_first:
            raise RequestRejected(f"attempt {n} of {req_id!r} fails on purpose")
        super().add(req_id, data)

    def step(self) -> list[tuple[str, bool, Any]]:
        out = super().step()
        if self.when == "add":
            return out
        kept: list[tuple[str, bool, Any]] = []
        for rid, fin, item in out:
            if rid in self._failed:
                continue
            n = self.attempts.get(rid, 0)
            if n <= self.fail_first and (fin or self.when == "first"):
                self._failed.add(rid)
                kept.append((rid, fin, RequestRejected(f"attempt {n} of {rid!r} fails on purpose")))
            else:
                kept.append((rid, fin, item))
        return kept

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "attempts":
            return self.attempts.get(args[0], 0)
        return super().utility(name, args)


def flaky(fail_first: int = 1, when: str = "add", step_s: float = 0.0) -> FlakyRelayEngine:
    """Factory: a :class:`FlakyRelayEngine`."""
    return FlakyRelayEngine(fail_first, when, step_s)


class DyingOnRetryEngine(RelayEngine):
    """A :class:`RelayEngine` whose process dies when a request it failed is retried into
    it, for the tests of a pipeline's ``Retry`` into a stage that restarts. The input
    ``"retry"`` fails the request's first attempt here (:class:`~enginecore.RequestRejected`
    from ``add``); when the replay comes, the process kills itself with ``SIGKILL``: *at*
    ``"fence"``, when it applies the replay's fence (the abort before the inputs again), so
    the fence never goes on to the next stage; ``"input"``, when the inputs come again
    (the fence went on), after *delay_s* seconds (time for the fence to leave the process:
    a ``SIGKILL`` right after it was sent on may lose it). Any other input is relayed, as
    by :class:`RelayEngine`."""

    def __init__(self, at: str = "fence", delay_s: float = 0.0) -> None:
        if at not in ("fence", "input"):
            raise ValueError(f"at must be 'fence' or 'input', got {at!r}")
        if not 0 <= delay_s < 60:
            raise ValueError(f"delay_s must be seconds in [0, 60), got {delay_s!r}")
        super().__init__()
        self.at = at
        self.delay_s = delay_s
        self._failed: set[str] = set()  # requests whose first attempt failed here

    def add(self, req_id: str, data: Any) -> None:
        if isinstance(data, str) and data == "retry":
            if req_id not in self._failed:
                self._failed.add(req_id)
                raise RequestRejected(f"the first attempt of {req_id!r} fails on purpose")
            if self.at == "input":
                time.sleep(self.delay_s)
                os.kill(os.getpid(), signal.SIGKILL)
        super().add(req_id, data)

    def abort(self, req_ids: Sequence[str]) -> None:
        if self.at == "fence" and any(rid in self._failed for rid in req_ids):
            os.kill(os.getpid(), signal.SIGKILL)
        super().abort(req_ids)


def dying_on_retry(at: str = "fence", delay_s: float = 0.0) -> DyingOnRetryEngine:
    """Factory: a :class:`DyingOnRetryEngine`."""
    return DyingOnRetryEngine(at, delay_s)


# Edge functions for pipelines (``PipelineStage(edge="enginecore.stage.testing:NAME")``).


def tee(payload: Any) -> tuple[Any, Any]:
    """Edge: every output to the next stage *and* to the caller."""
    return payload, payload


def to_caller(payload: Any) -> tuple[Any, Any]:
    """Edge: every output to the caller only (the next stage never hears of the request)."""
    return NOTHING, payload


def inflate(payload: Any) -> tuple[Any, Any]:
    """Edge: 100,000 zero bytes to the next stage for each output, and the output itself to
    the caller (a stand-in for a stage that hands large tensors on)."""
    return bytes(100_000), payload


def inflate_array(payload: Any) -> tuple[Any, Any]:
    """Edge: a 1 MiB array of zeros to the next stage for each output (through shared
    memory by default), and the output itself to the caller."""
    import numpy as np

    return np.zeros(1 << 20, dtype=np.uint8), payload


def to_array(payload: Any) -> tuple[Any, Any]:
    """Edge: for each output, a 1 MiB float32 array filled with it to the next stage (big
    enough for shared memory by default), nothing to the caller."""
    import numpy as np

    return np.full(1 << 18, payload, dtype=np.float32), NOTHING


def stamp(payload: Any) -> tuple[Any, Any]:
    """Edge: each output to the next stage as ``[output, sent]``, *sent* the time it left
    this stage's step (:func:`time.perf_counter`), nothing to the caller: with
    :func:`hop_seconds` on the next stage, one hop timed from inside the pipeline."""
    return [payload, time.perf_counter()], NOTHING


def hop_seconds(payload: Any) -> tuple[Any, Any]:
    """Edge: for each ``[output, sent]`` (from :func:`stamp`, on a streaming stage such as
    ``relay``, whose outputs are its inputs), the seconds since *sent* to the caller,
    nothing to the next stage (the request ends here). The two stages must run on one
    host: :func:`time.perf_counter` is the system-wide monotonic clock on Linux."""
    return NOTHING, time.perf_counter() - payload[1]


def last_fails(payload: Any) -> tuple[Any, Any]:
    """Edge: every output to the next stage, except that ``0`` (a countdown's last) raises
    :class:`ValueError`: the request ends with an error in this stage after it has sent
    the others on."""
    if payload == 0:
        raise ValueError("the edge refuses 0 on purpose")
    return payload, NOTHING


def checked_edge(payload: Any) -> tuple[Any, Any]:
    """Edge: every output to the next stage, except that ``"boom"`` raises
    :class:`ValueError`, ``"unencodable"`` sends on an object that cannot cross the wire
    and ``"unprintable"`` raises an exception whose ``repr()`` raises (each ends its
    request with an error naming this stage's edge); ``"unencodable to the caller"`` sends
    the caller such an object (its request ends with an error naming this stage)."""
    if payload == "boom":
        raise ValueError("the edge refuses 'boom' on purpose")
    if payload == "unencodable":
        return object(), NOTHING
    if payload == "unencodable to the caller":
        return NOTHING, object()
    if payload == "unprintable":
        raise _Unprintable
    return payload, NOTHING


class _Unprintable(Exception):
    """An exception whose ``repr()`` and ``str()`` raise (an engine author's mistake)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__


def device(step_s: float = 0.005) -> DeviceEngine:
    return DeviceEngine(step_s)


def echo() -> EchoEngine:
    """Factory: an :class:`EchoEngine`."""
    return EchoEngine()


def countdown() -> CountdownEngine:
    """Factory: a fresh :class:`~enginecore.CountdownEngine`."""
    return CountdownEngine()


def scripted(log: str | None = None) -> ScriptedEngine:
    """Factory: a fresh :class:`ScriptedEngine`; with *log*, it first logs that message at
    ``WARNING`` on the ``enginecore.test`` logger (a record made while the engine is built)."""
    if log is not None:
        logging.getLogger("enginecore.test").warning(log)
    return ScriptedEngine()


def failing_factory(
    message: str = "factory failed on purpose", unprintable: bool = False
) -> CountdownEngine:
    """Factory that raises ``RuntimeError(message)`` (with *unprintable*, an exception
    whose ``repr()`` and ``str()`` raise)."""
    if unprintable:
        raise _Unprintable
    raise RuntimeError(message)


def relay_once(marker: str, step_s: float = 0.0) -> RelayEngine:
    """Factory: a :class:`RelayEngine` the first time it is called (it creates the file
    *marker*), :class:`RuntimeError` every later time (a stage that cannot start again)."""
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        raise RuntimeError("this stage starts only once, on purpose") from None
    return RelayEngine(step_s)


def exiting_factory(code: int = 3) -> CountdownEngine:
    """Factory that ends the process with ``os._exit(code)``, reporting nothing."""
    os._exit(code)


def killed_factory() -> CountdownEngine:
    """Factory whose process is killed by SIGKILL while it builds the engine (an OOM kill,
    say), reporting nothing."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached: the signal is delivered at once
    return CountdownEngine()


def sleeping_factory(seconds: float = 3600.0) -> CountdownEngine:
    """Factory that sleeps *seconds*, then returns a CountdownEngine."""
    time.sleep(seconds)
    return CountdownEngine()


def gated_factory(directory: str, timeout: float = 60.0) -> CountdownEngine:
    """Factory that writes a file named after its pid in *directory*, then waits while a
    file named ``hold`` is there (``RuntimeError`` after *timeout* seconds), then returns a
    CountdownEngine. A test holds a stage's start (a pool's restart) inside its factory:
    it puts ``hold`` there, waits for the new pid's file, acts, and removes ``hold``."""
    with open(os.path.join(directory, str(os.getpid())), "w"):
        pass
    _wait_while(os.path.join(directory, "hold"), timeout)
    return CountdownEngine()


def _wait_while(path: str, timeout: float) -> None:
    """Return once the file *path* is gone; ``RuntimeError`` after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"held for {timeout} s")
        time.sleep(0.01)


def barrier_factory(directory: str, parties: int, timeout: float = 20.0) -> CountdownEngine:
    """Factory that returns a CountdownEngine only once *parties* stages are being built at
    the same time: each writes a file named after its pid in *directory*, then waits until
    *parties* files are there; ``RuntimeError`` after *timeout* seconds. So a launch of
    *parties* stages fails unless their starts overlap: how a test proves, from the
    children's side and without a clock, that launches run together."""
    with open(os.path.join(directory, str(os.getpid())), "w"):
        pass
    deadline = time.monotonic() + timeout
    while (n := len(os.listdir(directory))) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {n} of {parties} stages were being built together after {timeout} s"
            )
        time.sleep(0.01)
    return CountdownEngine()
