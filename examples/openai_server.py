"""An OpenAI-compatible HTTP server over a stage that runs a model.

    pip install '.[serve,transformers]'
    python examples/openai_server.py [--model PATH] [--host 127.0.0.1] [--port 8000]

One :class:`~enginecore.stage.AsyncStageClient` over one stage process for the server's
life (launched in the app's lifespan, shut down with it). The stage runs the engine
(``--engine MODULE:FACTORY``, by default ``enginecore.engines.transformers:TransformersEngine``)
with ``{"model": PATH}`` plus ``--engine-kwargs`` (which may not hold ``model``: the engine's
model is the tokenizer's); this process owns the tokenizer (text to token ids, chat
template, ids back to text), so the engine sees token ids only.

Without ``--model`` it serves a small random-weight Llama model that it builds once, with
``make_random_model``, into ``$ENGINECORE_CACHE/tiny-llama`` (default
``~/.cache/enginecore/tiny-llama``): no hub access. Its output is noise, but real noise: a
real model's forward passes, KV cache and sampling.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{name}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (when the tokenizer has a chat template), streaming over
server-sent events or not, with ``usage``; and two of enginecore's own: ``GET /health`` (503
once the stage is dead) and ``GET /enginecore/stats`` (the stage's statistics: live requests,
steps, the engine's numbers). Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter, a body that
is not JSON (or is nested too deeply to parse) or a request the engine refused (a prompt
that, with ``max_tokens``, does not fit the model's context is refused before it is sent:
code ``context_length_exceeded``; the limit is the engine's ``model_info`` utility's
``max_positions``, asked once at startup; a ``max_tokens`` not sent,
16 or 256 in a chat, is cut to what the context and the engine's KV budget
(``kv_budget_tokens``) leave, as vLLM does), a prompt's token id outside the vocabulary
(the larger of the tokenizer's and the engine's ``model_info`` ``vocab_size``, as vLLM
checks it), a string holding a lone surrogate (JSON's ``"\\ud800"``) a 400 too, 404 for
another model's name (type ``invalid_request_error``, as every 4xx, code
``model_not_found``: OpenAI's) or a path it does not serve (``Invalid URL (GET /path)``, as
OpenAI words it), 405 for another method (with its ``Allow`` header), 503 when the stage is
dead, 413 for a body over ``--max-body-bytes`` (8 MiB by default). Text is tokenized off
the event loop, on two threads: texts of 64 Ki characters or more on one (with a copy of
the tokenizer), shorter ones on the other, so a long prompt (8 MiB take seconds) holds up
only the long ones behind it, never the short ones nor the running streams.

Parameters: ``prompt`` is one prompt, a string or a list of token ids (a list of several
prompts is a 400); ``max_tokens`` (in a chat ``max_completion_tokens`` wins when both are
sent; both are checked), ``temperature``, ``top_p``, ``seed``, ``stop`` (up to 4 strings,
as OpenAI's API takes), ``n`` (1 only), ``stream`` and ``stream_options`` (an object:
``include_usage``, and ``include_obfuscation``, accepted and not done; with ``stream``
only, as OpenAI's API says) are honoured (a ``temperature`` under 1e-5 is greedy, as 0
is). A completion that ends at an EOS token (the tokenizer's, or another the engine stops
at: its ``model_info``'s ``eos_token_ids``, as a
generation config's) has ``finish_reason`` ``stop``; the token counts in ``usage`` and is
not in the text. Every other parameter of OpenAI's API is
refused with a 400 naming it (``param``) when it asks for something (``echo``,
``logprobs`` (0 included), ``logit_bias``, penalties,
``response_format`` other than text, tools, ``best_of``, ``suffix``, ...), and accepted when
it asks for nothing or cannot change the tokens (``user``, ``metadata``, ``store``,
``tool_choice: "none"``, ...). A parameter OpenAI's API does not have (another server's
extension, such as ``top_k`` or ``min_tokens``) is refused as unrecognized, as OpenAI
refuses it. So is a chat message's: ``role`` (``system``, ``developer``, ``user`` or
``assistant``: another, ``tool`` and ``function`` included, is a 400 naming it, as OpenAI
answers; so is a role missing or not a string: ``param`` ``messages[1].role``), ``content``
(a string, or a list of text parts, joined with ``"\\n"`` as vLLM joins them; a part of
another type is a 400 naming it, as ``messages[0].content[1].type``) and ``name`` (passed
on to the chat template, which may render it) are used; ``tool_calls``, ``tool_call_id``,
``function_call``, ``audio`` and ``refusal`` are refused when not empty (``param`` names
the message, as ``messages[1].tool_calls``); any other field is refused.

A client that disconnects, during a stream or while it waits for a whole completion, has its
request aborted in the stage at once; one that goes while it sends its body is dropped
quietly (no error logged). SIGTERM or Ctrl-C stops the server (open requests get
``--graceful-timeout`` seconds; one still running then ends with a 503 in OpenAI's shape, code
``server_shutting_down``, sent in a stream as its last event before ``[DONE]``), then shuts
the stage down: no process is left. A second Ctrl-C stops the wait for open requests: the
stage is shut down at once (a request still open ends with a 503, code ``stage_dead``) and
the server exits quietly.

A client that stops reading with its connection open (a stalled or vanished reader) would hold
its request's place in the engine's batch and its KV cache for as long as it stalls: once
the socket's buffers are full, a send to it that waits longer than ``--send-timeout``
seconds (30 by default; a number > 0: a reader that reads nothing is never served, so there
is no "off", and a long wait is a large value) aborts the request in the stage, logs one
warning naming the request, and drops the connection with a reset (which frees the kernel's
send buffer too). Until then the request's outputs wait in this process's memory: the token
ids the engine makes in ``--send-timeout`` seconds, besides the bytes the buffers hold
(uvicorn's 64 KiB and the kernel's send buffer, up to ``net.ipv4.tcp_wmem``'s maximum: 4 MiB
by default on Linux). A whole completion's send has the same bound (uvicorn takes the body
into its buffer without waiting, so it rarely applies). A client that reads slowly but keeps
reading is not cut: each send waits only until the kernel takes more, once the client has
read about a third of that send buffer (on loopback, 1.4 MB: a second at 1.5 MB/s), so keep
the timeout well above the time the slowest client you serve takes to read that much.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import importlib
import json
import logging
import math
import os
import re
import shutil
import socket
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from enginecore import EngineCoreError
from enginecore.stage import (
    AsyncRequestStream,
    AsyncStageClient,
    EngineDeadError,
    RequestError,
    StageClosedError,
    UtilityError,
)

DEFAULT_ENGINE = "enginecore.engines.transformers:TransformersEngine"
TINY_MODEL = "tiny-llama"
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256
DETOKENIZE_CONTEXT = 5  # prompt ids decoded before the first new one (its leading space)
#: Characters from which a text is tokenized on the long texts' thread (64 Ki characters take
#: tens of milliseconds; the 8 MiB a body may hold, seconds).
LONG_TEXT = 2**16

logger = logging.getLogger("openai_server")
T = TypeVar("T")


# -- the model folder ------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$ENGINECORE_CACHE``, else ``~/.cache/enginecore``."""
    env = os.environ.get("ENGINECORE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "enginecore"


def tiny_model() -> Path:
    """The small random-weight model in the cache folder, built on first use.

    Built into a temporary folder beside it and renamed into place, so a folder that is
    there is complete (and two servers starting at once do not mix their files)."""
    path = cache_dir() / TINY_MODEL
    if (path / "config.json").is_file():
        return path
    try:
        engines = importlib.import_module("enginecore.engines.transformers")
    except ImportError as exc:
        raise SystemExit(
            f"no --model given, and the random model needs enginecore's transformers engine "
            f"({exc}); install it with: pip install 'enginecore[serve,transformers]'"
        ) from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL}-", dir=path.parent))
    try:
        logger.info("building a random-weight model in %s (once)", path)
        engines.make_random_model(str(tmp))
        try:
            tmp.rename(path)
        except OSError:  # another server built it meanwhile: keep theirs
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tokenizer(path: Path) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path)``: local files only."""
    transformers = importlib.import_module("transformers")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot load a tokenizer from {path}: {exc}") from exc


# -- errors ----------------------------------------------------------------------------------

#: An error's type, by status: "invalid_request_error" for every 4xx (OpenAI's API answers
#: a model or a path it does not have with a 404 of that type), "service_unavailable_error"
#: for a 503 (as OpenAI's overload answer), "server_error" for another 5xx.
_ERROR_TYPES = {503: "service_unavailable_error"}
MAX_BODY_BYTES = 8 * 2**20  # --max-body-bytes' default
SEND_TIMEOUT = 30.0  # --send-timeout's default, in seconds
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's escape of a surrogate
GREEDY_BELOW = 1e-5  # a temperature under it samples greedily (as vLLM does)
MAX_STOP = 4  # stop sequences a request may have (OpenAI's API: "up to 4")
#: stream_options' keys: include_usage is honoured; include_obfuscation (random padding in
#: each event) is accepted and not done (it cannot change the tokens).
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        default = "invalid_request_error" if self.status < 500 else "server_error"
        kind = _ERROR_TYPES.get(self.status, default)
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _shutting_down() -> ApiError:
    """What a request still running when the server stops answers (uvicorn cancels it once
    ``--graceful-timeout`` has passed)."""
    return ApiError(503, "the server is shutting down", code="server_shutting_down")


def _stage_error(exc: BaseException) -> ApiError:
    """What a failure of the stage or of one request answers."""
    if isinstance(exc, RequestError):
        return ApiError(400, exc.message, code="request_rejected")
    if isinstance(exc, EngineDeadError | StageClosedError):
        return ApiError(503, f"the model's stage is not running: {exc}", code="stage_dead")
    return ApiError(500, f"{type(exc).__name__}: {exc}")


# -- parameters ------------------------------------------------------------------------------


#: The integers the stage's wire (msgpack) carries: a JSON integer is unbounded.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


def _show(value: Any) -> str:
    """*value* for a message: its JSON, cut at 100 characters."""
    try:
        text = json.dumps(value)
    except RecursionError:  # parsed, but nested too deeply to write back from here
        return f"a {type(value).__name__} nested too deeply"
    return text if len(text) <= 100 else text[:97] + "..."


def _int(
    body: dict[str, Any], key: str, default: int | None, least: int, most: int = WIRE_INT_MAX
) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
        span = f">= {least}" if most == WIRE_INT_MAX else f"in [{least}, {most}]"
        if most == WIRE_INT_MAX and least != WIRE_INT_MIN:
            span += " (and below 2**64)"
        elif most == WIRE_INT_MAX:
            span = "in [-2**63, 2**64)"
        raise _bad(f"{key} must be an integer {span}, got {_show(value)}", key)
    return value


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"{key} must be a number in [{low}, {high}], got {_show(value)}", key)
    return float(value)


#: The parameters each endpoint takes: honoured, or refused by UNSUPPORTED when set to
#: anything that would change the result, or (user, metadata, ...) without effect on it.
_COMMON_PARAMETERS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n"}
_COMMON_PARAMETERS |= {"stream", "stream_options", "user", "logprobs", "logit_bias"}
_COMMON_PARAMETERS |= {"presence_penalty", "frequency_penalty"}
COMPLETION_PARAMETERS = frozenset(_COMMON_PARAMETERS | {"prompt", "echo", "best_of", "suffix"})
CHAT_PARAMETERS = frozenset(
    _COMMON_PARAMETERS
    | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
    | {"parallel_tool_calls", "functions", "function_call", "response_format", "audio"}
    | {"modalities", "metadata", "store", "service_tier", "prediction", "reasoning_effort"}
    | {"verbosity", "web_search_options", "prompt_cache_key", "safety_identifier"}
)
#: Parameters this server does not honour, and the values of them that ask for nothing (None,
#: the default, or an explicit "off"): any other value is a 400 naming the parameter.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "logprobs": lambda v: v is not None and v is not False,  # 0 asks for the chosen tokens'
    "top_logprobs": lambda v: v is not None and (isinstance(v, bool) or v != 0),
    "logit_bias": lambda v: v not in (None, {}),
    "presence_penalty": lambda v: v is not None and (isinstance(v, bool) or v != 0),
    "frequency_penalty": lambda v: v is not None and (isinstance(v, bool) or v != 0),
    "tools": lambda v: v not in (None, []),
    "functions": lambda v: v not in (None, []),
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "function_call": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "reasoning_effort": lambda v: v is not None,
    "verbosity": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
}


# A chat message's fields: role and content, and name (the participant's, passed on to the
# chat template, which may render it). OpenAI's other message fields ask for what this
# server does not do (tool and function calls, audio, a refusal): refused when they ask for
# something, accepted when empty, as the request's parameters are. Any other field is
# refused as unrecognized.
MESSAGE_KEYS = frozenset({"role", "content", "name"})
#: The roles of OpenAI's API that this server takes, passed on to the chat template as they
#: are (whether it renders "developer" is the template's business). OpenAI's "tool" and
#: "function" answer a tool call, which this server does not make; any other role is a 400,
#: as OpenAI's API answers (vLLM passes any role on).
ROLES = ("system", "developer", "user", "assistant")
MESSAGE_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tool_calls": lambda v: v not in (None, []),
    "function_call": lambda v: v is not None,
    "tool_call_id": lambda v: v is not None,
    "audio": lambda v: v is not None,
    "refusal": lambda v: v is not None,
}


def _size(tokenizer: Any) -> int | None:
    """The tokenizer's vocabulary, added tokens included (``len``); ``None`` if it has none."""
    try:
        size = len(tokenizer)
    except TypeError:
        return None
    return size if isinstance(size, int) and size >= 1 else None


def _text_part(where: str, part: Any) -> str:
    """A message's content part's text: a text part's, else a 400 naming the part."""
    if not isinstance(part, dict):
        raise _bad(
            f'{where} must be a content part object, like {{"type": "text", "text": "..."}}',
            where,
        )
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{where} has no type (a string): text parts only", f"{where}.type")
    if kind != "text":
        raise _bad(
            f"content parts of type {kind!r:.50} are not supported by this server: text only",
            f"{where}.type",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text must be a string", f"{where}.text")
    return text


class Sampling:
    """The request's parameters that the engine and the detokenizer use."""

    def __init__(self, body: dict[str, Any], *, chat: bool) -> None:
        self.max_tokens_key = "max_tokens"
        default = CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS
        self.max_tokens = _int(body, "max_tokens", default, 1)  # checked even if not used
        if chat and body.get("max_completion_tokens") is not None:  # the newer name wins
            self.max_tokens_key = "max_completion_tokens"
            self.max_tokens = _int(body, "max_completion_tokens", None, 1)
        # Not sent: the server's default, cut to what the context leaves (_check_length).
        self.max_tokens_given = body.get(self.max_tokens_key) is not None
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        # Under 1e-5 (the engine's least positive temperature: below, logits / temperature
        # can overflow float32) sampling is greedy in all but exact ties: take it greedily.
        self.temperature = 0.0 if temperature < GREEDY_BELOW else temperature
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise _bad("top_p must be > 0", "top_p")
        self.top_p = top_p
        self.seed = _int(body, "seed", None, WIRE_INT_MIN)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop must be a non-empty string or a list of them", "stop")
        if len(stop) > MAX_STOP:  # each is looked for at every new token, on the event loop
            raise _bad(f"stop takes at most {MAX_STOP} sequences, got {len(stop)}", "stop")
        self.stop: list[str] = stop
        if _int(body, "n", 1, 1) != 1:
            raise _bad("this server returns one choice per request: n must be 1", "n")
        stream = body.get("stream")
        if stream is None:  # null: the default, as for every optional parameter
            stream = False
        if not isinstance(stream, bool):
            raise _bad("stream must be a boolean", "stream")
        self.stream = stream
        options = body.get("stream_options")
        if options is None:
            options = {}
        if (
            not isinstance(options, dict)
            or not options.keys() <= STREAM_OPTIONS
            or not all(isinstance(v, bool) for v in options.values())
        ):
            raise _bad(
                'stream_options must be an object like {"include_usage": true} (keys: '
                f"{', '.join(sorted(STREAM_OPTIONS))}; booleans), got {_show(options)}",
                "stream_options",
            )
        include_usage = options.get("include_usage", False)
        if not stream and body.get("stream_options") is not None:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        self.include_usage = include_usage
        known = CHAT_PARAMETERS if chat else COMPLETION_PARAMETERS
        unknown = sorted(str(key) for key in body if key not in known)
        if unknown:
            raise _bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
        for key, used in UNSUPPORTED.items():
            if key in known and used(body.get(key)):
                raise _bad(f"{key} is not supported by this server", key)

    def engine_data(self, prompt: list[int], stop_token_ids: list[int]) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop_token_ids": stop_token_ids,
        }


# -- one request in the stage ----------------------------------------------------------------


class Generation:
    """One request: its stream in the stage, and its new tokens turned into text.

    Detokenizes incrementally (a window of ids decoded twice per step, as vLLM does), holds
    back text that may still become a stop string, and stops at the first stop string: the
    request is then aborted in the stage and its text cut before the stop string."""

    def __init__(
        self,
        server: Server,
        stream: AsyncRequestStream,
        prompt: list[int],
        sampling: Sampling,
        stop_token_ids: list[int],
    ) -> None:
        self.server = server
        self.stream = stream
        self.prompt_tokens = len(prompt)
        self.stop = sampling.stop
        self.stop_token_ids = set(stop_token_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.done = False  # the request has ended in the stage (or will: aborted by us)
        self._ids = prompt[-DETOKENIZE_CONTEXT:]
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""  # all the text decoded so far
        self._sent = 0  # how much of it was handed out

    async def next_delta(self) -> str | None:
        """The text the next output adds (possibly ``""``), or ``None`` once it has ended.
        Raises the stream's error as an :class:`ApiError`."""
        if self.done:
            return None
        try:
            payload = await self.stream.__anext__()
        except StopAsyncIteration:
            self.done = True
            if self.finish_reason is None:  # aborted by someone else: the stage stopped
                raise ApiError(503, "the request was aborted in the stage") from None
            return None
        except EngineCoreError as exc:
            self.done = True
            raise _stage_error(exc) from exc
        new_ids: list[int] = payload["token_ids"]
        self.completion_tokens += len(new_ids)
        reason = payload.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason
            self.done = True
        if reason == "stop" and new_ids and new_ids[-1] in self.stop_token_ids:
            new_ids = new_ids[:-1]  # counted, not shown
        self._decode(new_ids)
        return await self._delta()

    def _decode(self, new_ids: list[int]) -> None:
        if not new_ids:
            return
        tok = self.server.tokenizer
        self._ids.extend(new_ids)
        before = tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix = self._read
            self._read = len(self._ids)

    async def _delta(self) -> str:
        text = self._text
        end = len(text)
        for stop in self.stop:
            at = text.find(stop, max(0, self._sent - len(stop) + 1))
            if at != -1 and at < end:
                end = at
        if end < len(text):  # a stop string: the request ends here
            self._text = text = text[:end]
            if not self.done:
                await self.abort()
            self.finish_reason = "stop"
            self.done = True
        elif not self.done and self.stop:  # hold back what may start a stop string
            longest = max(len(s) for s in self.stop)
            end = max(self._sent, len(text) - longest + 1)
        delta = text[self._sent : end]
        self._sent = end
        return delta

    async def abort(self) -> None:
        """Abort the request in the stage, unless it has ended there."""
        if not self.done:
            self.done = True
            with contextlib.suppress(EngineCoreError):
                await self.server.stage.abort([self.stream.req_id])

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """*work*'s result, or ``None`` (and *work* cancelled) if the client goes first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return task.result() if not task.cancelled() else None


# -- clients that stop reading ---------------------------------------------------------------

#: The scope's key for the connection's transport (uvicorn's), where the app found it.
TRANSPORT = "openai_server.transport"
DROP_SEEN = 1.0  # seconds _drop waits for the server to see a dropped connection lost


class SendTimeout(Exception):
    """A send to the client did not complete within the server's send timeout: the client
    stopped reading, its connection open (the socket's buffers are full)."""


class BoundedSend:
    """*send*, each call of it bounded by *timeout* seconds (:class:`SendTimeout`).

    uvicorn's ``send`` waits, before it writes, while the connection's write buffer is over
    its high-water mark (64 KiB, on top of the kernel's socket buffers): that wait, which
    a client that stops reading makes endless, is what this bounds. With one timer for all
    the sends of a response, re-armed only when it comes due: a send costs a clock read
    (an ``asyncio.timeout`` per send, a timer each, took some 5 us a send, and a loaded
    server streamed visibly fewer events/s). Its timer is cancelled by :meth:`close`."""

    def __init__(self, send: Send, timeout: float) -> None:
        self._send = send
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the send under way began
        self._task: asyncio.Task[Any] | None = None  # the task that awaits it
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def __call__(self, message: Message) -> None:
        self._since = since = self._loop.time()
        self._task = task = asyncio.current_task()
        self._fired = False  # (a send that swallowed the timer's cancellation: a new start)
        if sys.version_info >= (3, 11):
            cancels = task.cancelling() if task else 0
        if self._timer is None:
            self._timer = self._loop.call_at(since + self._timeout, self._check)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self._fired:
                raise
            self._fired = False
            # Python 3.11+: cancelled from elsewhere too meanwhile (the server stops): that
            # cancellation goes on.
            if sys.version_info >= (3, 11) and task and task.uncancel() > cancels:
                raise
            raise SendTimeout from None
        finally:
            self._since = None

    def _check(self) -> None:
        self._timer = None
        since = self._since
        if since is None or self._task is None:  # between sends: the next one arms it
            return
        due = since + self._timeout
        if self._loop.time() >= due:
            self._fired = True
            self._task.cancel()
        else:  # a later send, under way: due later
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _drop(scope: Scope, receive: Receive, req_id: str, timeout: float, done: str) -> None:
    """Ends the connection of a client that stopped reading (*req_id*'s, over *timeout*
    seconds): a reset, as nginx's ``reset_timedout_connection`` does, so that the kernel
    frees what its send buffer holds at once rather than hold it for a peer that reads
    nothing (a close would wait for that buffer to drain, forever). Where the connection's
    transport is not known (or shared: HTTP/2, see :class:`_App`), the response is left
    incomplete: the server closes it (over HTTP/2: resets its stream). Else it returns once
    the server has seen the connection lost (*receive*: ``http.disconnect``), so that the
    response's end is no error to it. The warning says what was *done* about the request."""
    transport = scope.get(TRANSPORT)
    logger.warning(
        "request %s: a send to its client waited past the send timeout (%g s; the client "
        "stopped reading): %s, %s",
        req_id,
        timeout,
        done,
        "connection dropped" if transport is not None else "response left incomplete",
    )
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # linger 0: close with a reset, the buffer dropped
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    # Some loop turns later (over TLS, two: asyncio's TLS protocol passes it on).
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_disconnected(receive), DROP_SEEN)


class BoundedJSON(JSONResponse):
    """A whole completion, its sends bounded by the server's send timeout (uvicorn writes a
    body into its buffer at once, and waits only when that buffer is already full)."""

    def __init__(self, content: Any, req_id: str, send_timeout: float) -> None:
        super().__init__(content)
        self.req_id = req_id
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bounded = BoundedSend(send, self.send_timeout)
        try:
            await super().__call__(scope, receive, bounded)
        except SendTimeout:
            await _drop(scope, receive, self.req_id, self.send_timeout, "its response cut")
        finally:
            bounded.close()


class EventStream(Response):
    """A server-sent event stream that ends early, calling *on_close*, when the client goes,
    or when one send to it waits longer than *send_timeout* seconds (a client that stopped
    reading: its connection is dropped, see :func:`_drop`).

    Starlette's ``StreamingResponse`` only notices a disconnect this way on older ASGI
    versions; this does it always, and *on_close* runs however the stream ends."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        req_id: str,
        send_timeout: float,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.req_id = req_id
        self.send_timeout = send_timeout
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        bounded = BoundedSend(send, self.send_timeout)

        async def send_all() -> None:
            nonlocal started
            start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            await bounded(start)
            started = True
            async for event in self.events:
                await bounded({"type": "http.response.body", "body": event, "more_body": True})
            await bounded({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _unless_disconnected(receive, send_all())
        except SendTimeout:  # the client stopped reading: abort, then drop the connection
            await self.on_close()
            await _drop(scope, receive, self.req_id, self.send_timeout, "request aborted")
        except OSError:  # the client went while we sent
            pass
        except asyncio.CancelledError:  # the server stops: its graceful timeout has passed
            with contextlib.suppress(Exception):  # SendTimeout too: the server closes it
                if not started:
                    await _shutting_down().response()(scope, receive, bounded)
                else:
                    end = _sse(_shutting_down().body()) + b"data: [DONE]\n\n"
                    await bounded({"type": "http.response.body", "body": end, "more_body": False})
        finally:
            bounded.close()
            await self.on_close()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- the server ------------------------------------------------------------------------------


class Server:
    """The app's state: the tokenizer, the stage's client and the served model's name."""

    def __init__(
        self,
        model: Path,
        tokenizer: Any,
        engine: str,
        engine_kwargs: dict[str, Any],
        name: str,
        max_body_bytes: int = MAX_BODY_BYTES,
        send_timeout: float = SEND_TIMEOUT,
    ) -> None:
        self.model = model
        self.max_body_bytes = max_body_bytes
        self.send_timeout = send_timeout
        # Text to token ids off the event loop (a long prompt takes seconds; the fast
        # tokenizers release the GIL), on two lanes, each a thread with a tokenizer of its
        # own (a tokenizer is not made for concurrent encodes): texts under LONG_TEXT
        # characters on one, longer ones on the other (with a copy of the tokenizer), so a
        # long text holds up only the long texts behind it. Decoding a step's few ids stays
        # on the loop.
        self._lanes: list[tuple[ThreadPoolExecutor, Any]] = []
        self.tokenizer = tokenizer
        self.engine = engine
        self.engine_kwargs = engine_kwargs
        self.name = name
        self.created = int(time.time())
        self._stage: AsyncStageClient | None = None
        self.max_positions: int | None = None  # the model's, from the engine's model_info
        self.kv_budget: int | None = None  # the engine's KV tokens, from model_info too
        # A prompt's token ids must be under it: the larger of the tokenizer's vocabulary and
        # the model's (model_info's vocab_size), as vLLM checks them.
        self.vocab: int | None = _size(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids: list[int] = [eos] if isinstance(eos, int) else []

    @property
    def stage(self) -> AsyncStageClient:
        if self._stage is None:
            raise ApiError(503, "the model's stage is not running", code="stage_dead")
        return self._stage

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._lanes = self._open_lanes()
        # A first encode on each before any request: one that changes the tokenizer's
        # truncation or padding state does it now, never while the loop decodes.
        for size in (0, LONG_TEXT):
            with contextlib.suppress(Exception):
                await self._encode(lambda tok: tok(""), size)
        kwargs = {"model": str(self.model), **self.engine_kwargs}
        try:
            self._stage = await AsyncStageClient.launch(self.engine, kwargs, name="openai-server")
        except BaseException:
            self._close_lanes()
            raise
        logger.info("stage %s (pid %d) serves %s", self.engine, self._stage.pid, self.model)
        try:
            self.max_positions, self.kv_budget, vocab, eos = await self._limits(self._stage)
            if vocab is not None:
                self.vocab = max(vocab, self.vocab or 0)
            # The engine stops at its own EOS ids too (a generation config's): every stop
            # token is counted, not shown.
            self.eos_ids = sorted({*self.eos_ids, *eos})
            yield
        finally:
            self._close_lanes()
            code = await self._stage.shutdown()
            logger.info("stage exited with code %s", code)

    def _open_lanes(self) -> list[tuple[ThreadPoolExecutor, Any]]:
        """The tokenizer's two lanes (short texts, long texts): a thread and a tokenizer
        each. One that cannot be copied serves both lanes on one thread, one text at a time."""
        short = (ThreadPoolExecutor(1, thread_name_prefix="tokenizer"), self.tokenizer)
        try:
            other = copy.deepcopy(self.tokenizer)
        except Exception as exc:
            logger.warning("cannot copy the tokenizer (%r): one thread tokenizes every text", exc)
            return [short, short]
        return [short, (ThreadPoolExecutor(1, thread_name_prefix="tokenizer-long"), other)]

    def _close_lanes(self) -> None:
        for executor, _ in self._lanes:
            executor.shutdown(wait=False, cancel_futures=True)
        self._lanes = []

    @staticmethod
    async def _limits(
        stage: AsyncStageClient,
    ) -> tuple[int | None, int | None, int | None, list[int]]:
        """The model's context length and the engine's KV budget (each in tokens: prompt
        plus new tokens), its vocabulary's size, and the EOS ids the engine stops at, from
        the engine's ``model_info`` utility (``max_positions``, ``kv_budget_tokens``,
        ``vocab_size``, ``eos_token_ids``); ``None`` (no ids) for what an engine does not
        say (its own refusal then says what is too long)."""
        try:
            info = await stage.call_utility("model_info", timeout=30.0)
        except UtilityError:
            return None, None, None, []

        def whole(key: str) -> int | None:
            value = info.get(key) if isinstance(info, dict) else None
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            return value if ok else None

        eos = info.get("eos_token_ids") if isinstance(info, dict) else None
        ids = eos if isinstance(eos, list) else []
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        return whole("max_positions"), whole("kv_budget_tokens"), whole("vocab_size"), ids

    def _check_length(self, prompt: list[int], sampling: Sampling, *, chat: bool) -> None:
        """A 400 for a prompt that, with its new tokens, does not fit the model's context:
        before it is sent to the stage (a huge prompt is not shipped only to be refused).
        A ``max_tokens`` the request did not send (the default) is cut to what the context
        and the engine's KV budget leave, as vLLM does: only a prompt that leaves no room in
        the context is refused then (and one that leaves none in the budget, by the engine)."""
        limit = self.max_positions
        budget = self.kv_budget
        if limit is None:
            return
        room = limit - len(prompt)
        if not sampling.max_tokens_given:  # the default: what the context leaves, at most
            if room >= 1:
                fits = room if budget is None else max(1, min(room, budget - len(prompt)))
                sampling.max_tokens = min(sampling.max_tokens or fits, fits)
                return
            raise ApiError(
                400,
                f"the prompt ({len(prompt)} tokens) leaves no room for a new token in the "
                f"model's context of {limit} tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        if (sampling.max_tokens or 0) <= room:
            return
        raise ApiError(
            400,
            f"the prompt ({len(prompt)} tokens) plus {sampling.max_tokens_key} "
            f"({sampling.max_tokens}) is longer than the model's context of {limit} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/enginecore/stats", self.stats, methods=["GET"]),
        ]

        async def api_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, ApiError)
            return exc.response()

        async def http_error(request: Request, exc: Exception) -> Response:
            # Routing's: a path not served (in OpenAI's words), a method not taken (with its
            # Allow header, as HTTP requires).
            assert isinstance(exc, HTTPException)
            message = str(exc.detail)
            if exc.status_code == 404:
                message = f"Invalid URL ({request.method} {request.url.path})"
            response = ApiError(exc.status_code, message).response()
            response.headers.update(exc.headers or {})
            return response

        async def server_error(request: Request, exc: Exception) -> Response:
            # A bug: OpenAI's shape all the same (its SDKs parse the body of an error), the
            # type only (no internals to the client). Starlette logs the traceback after it.
            return ApiError(
                500,
                f"internal server error ({type(exc).__name__}); the server's log has the traceback",
            ).response()

        return _App(
            routes=routes,
            lifespan=self.lifespan,
            exception_handlers={
                ApiError: api_error,
                HTTPException: http_error,
                Exception: server_error,
            },
        )

    # -- endpoints ---------------------------------------------------------------------------

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "enginecore",
        }

    def _not_found(self, model: Any) -> ApiError:
        return ApiError(
            404,
            f"the model {_show(model)} does not exist; this server serves {self.name!r}",
            param="model",
            code="model_not_found",
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.name:
            raise self._not_found(name)
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        state = str(self.stage.health().value)
        return JSONResponse({"status": state}, status_code=503 if state == "dead" else 200)

    async def stats(self, request: Request) -> Response:
        try:
            stats = await self.stage.stats(timeout=5.0)
        except EngineCoreError as exc:
            raise _stage_error(exc) from exc
        return JSONResponse(
            {
                "pid": stats.pid,
                "live": stats.live,
                "steps": stats.steps,
                "outputs": stats.outputs,
                "stalled": stats.stalled,
                "engine": dict(stats.engine),
            }
        )

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        sampling = Sampling(body, chat=False)
        prompt = await self._prompt_ids(body.get("prompt"))
        return await self._respond(request, prompt, sampling, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        if not getattr(self.tokenizer, "chat_template", None):
            raise _bad(
                f"the model {self.name!r} has no chat template: use /v1/completions",
                "messages",
            )
        sampling = Sampling(body, chat=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list", "messages")
        chat = [self._message(i, m) for i, m in enumerate(messages)]

        def render(tokenizer: Any) -> str:
            text: str = tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )
            return text

        try:
            text = await self._encode(render, sum(len(m["content"]) for m in chat))
        except ApiError:
            raise
        except Exception as exc:  # the template's own checks (roles, order)
            raise _bad(f"the chat template refused the messages: {exc}", "messages") from exc
        prompt = await self._encode(
            lambda tok: list(tok(text, add_special_tokens=False)["input_ids"]), len(text)
        )
        return await self._respond(request, prompt, sampling, chat=True)

    # -- helpers -----------------------------------------------------------------------------

    async def _read(self, request: Request) -> bytes:
        """The request's body, refused (413) past ``max_body_bytes`` without reading on:
        before any of it when its Content-Length says so, else once it has grown past. A
        client that goes before the body is whole gets a 499 (sent to no one), not a 500."""
        limit = self.max_body_bytes
        too_large = ApiError(
            413, f"the request body is larger than this server's limit of {limit} bytes"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body was whole: no one to answer
            raise ApiError(499, "the client closed the connection") from None
        return b"".join(chunks)

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await self._read(request)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _bad(f"the body is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # nested deeper than the parser goes: not a bug here
            raise _bad("the body is not valid JSON: nested too deeply") from exc
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        if _SURROGATE_ESCAPE.search(raw):  # maybe a lone one: the tokenizer would raise
            try:
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError as exc:
                raise _bad(
                    "the body holds a lone surrogate (a \\ud800-\\udfff escape without its "
                    "pair): not a Unicode string"
                ) from exc
        model = body.get("model")
        if model is not None and model != self.name:
            raise self._not_found(model)
        return body

    async def _encode(self, work: Callable[[Any], T], size: int) -> T:
        """*work* (a call of the tokenizer it is given) for a text of *size* characters,
        on the lane of its size."""
        if not self._lanes:
            raise ApiError(503, "the server is not running", code="stage_dead")
        executor, tokenizer = self._lanes[size >= LONG_TEXT]
        return await asyncio.get_running_loop().run_in_executor(executor, work, tokenizer)

    async def _prompt_ids(self, prompt: Any) -> list[int]:
        # One prompt: a string or a list of token ids (or a list of one of them).
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
            ids = await self._encode(lambda tok: list(tok(text)["input_ids"]), len(text))
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= WIRE_INT_MAX
            for t in prompt
        ):
            ids = prompt
        else:
            raise _bad("prompt must be a string or a list of token ids (one prompt)", "prompt")
        if not ids:
            raise _bad("prompt is empty", "prompt")
        if self.vocab is not None and (top := max(ids)) >= self.vocab:
            # The engine may not check (a custom one), and the tokenizer cannot decode it.
            raise _bad(
                f"prompt has token id {top}, outside the vocabulary of {self.vocab} tokens "
                f"(ids 0 to {self.vocab - 1})",
                "prompt",
            )
        return ids

    @staticmethod
    def _message(index: int, message: Any) -> dict[str, str]:
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad("each message must be an object with a role and a content", where)
        if "role" not in message:
            raise _bad(f"missing required parameter: '{where}.role'", f"{where}.role")
        if not isinstance(message["role"], str):
            raise _bad(
                f"{where}.role must be a string, got {_show(message['role'])}", f"{where}.role"
            )
        for key, value in message.items():
            if key in MESSAGE_KEYS:
                continue
            used = MESSAGE_UNSUPPORTED.get(key)
            if used is None:
                raise _bad(f"unrecognized field in {where}: {key}", f"{where}.{key}")
            if used(value):
                raise _bad(f"{key} in a message is not supported by this server", f"{where}.{key}")
        role = message["role"]
        if role not in ROLES:
            why = (
                f"a message of role {role!r} answers a tool call, which this server does not make"
                if role in ("tool", "function")
                else f"invalid role {role!r:.50}"
            )
            roles = ", ".join(map(repr, ROLES))
            raise _bad(f"{why}: the roles are {roles}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only, joined as vLLM joins them
            if not content:
                raise _bad("a message's content is an empty array of parts", f"{where}.content")
            parts = [_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content)]
            content = "\n".join(parts)
        if not isinstance(content, str):
            raise _bad("a message's content must be a string", f"{where}.content")
        chat = {"role": role, "content": content}
        name = message.get("name")
        if name is not None:  # the participant's name: the chat template may render it
            if not isinstance(name, str) or not name:
                raise _bad("a message's name must be a non-empty string", f"{where}.name")
            chat["name"] = name
        return chat

    async def _respond(
        self, request: Request, prompt: list[int], sampling: Sampling, *, chat: bool
    ) -> Response:
        self._check_length(prompt, sampling, chat=chat)
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stop_ids = list(self.eos_ids)
        try:
            stream = await self.stage.add(req_id, sampling.engine_data(prompt, stop_ids))
        except (EngineDeadError, StageClosedError) as exc:
            raise _stage_error(exc) from exc
        except TypeError as exc:  # a value the wire cannot carry (checked above: a backstop)
            raise _bad(f"the request cannot be sent to the model's stage: {exc}"[:300]) from exc
        gen = Generation(self, stream, prompt, sampling, stop_ids)
        try:
            # The first output (or the engine's refusal) before any header: a refused
            # request is a 400, streamed or not.
            first = await _unless_disconnected(request.receive, gen.next_delta())
            if first is None and not gen.done:  # the client went
                await gen.abort()
                return Response(status_code=499)
            if sampling.stream:
                return EventStream(
                    self._chunks(req_id, gen, first or "", sampling, chat),
                    gen.abort,
                    req_id,
                    self.send_timeout,
                )
            text = await _unless_disconnected(request.receive, self._rest(gen, first or ""))
            if text is None:
                await gen.abort()
                return Response(status_code=499)
        except asyncio.CancelledError:  # the server stops: its graceful timeout has passed
            await gen.abort()
            return _shutting_down().response()
        except BaseException:
            await gen.abort()
            raise
        return BoundedJSON(self._whole(req_id, gen, text, chat), req_id, self.send_timeout)

    @staticmethod
    async def _rest(gen: Generation, text: str) -> str:
        while (delta := await gen.next_delta()) is not None:
            text += delta
        return text

    def _whole(self, req_id: str, gen: Generation, text: str, chat: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": req_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [choice],
            "usage": gen.usage(),
        }

    async def _chunks(
        self, req_id: str, gen: Generation, first: str, sampling: Sampling, chat: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        head = {
            "id": req_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.name,
        }

        extra = {"usage": None} if sampling.include_usage else {}  # null in all but the last

        def chunk(text: str | None, finish: str | None) -> bytes:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["text"] = text or ""
            return _sse({**head, "choices": [choice], **extra})

        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            yield _sse({**head, "choices": [{**role, "finish_reason": None}], **extra})
        delta: str | None = first
        try:
            while delta is not None:
                if delta:
                    yield chunk(delta, None)
                delta = await gen.next_delta()
        except ApiError as exc:  # the headers are out: the error goes as an event
            yield _sse(exc.body())
            yield b"data: [DONE]\n\n"
            return
        yield chunk(None if chat else "", gen.finish_reason)
        if sampling.include_usage:
            yield _sse({**head, "choices": [], "usage": gen.usage()})
        yield b"data: [DONE]\n\n"


class _App(Starlette):
    """Starlette, that puts the connection's transport in the scope (:data:`TRANSPORT`) when
    it can find it (uvicorn's ``send`` is a method of an object that holds it), so that a
    client that stops reading can have its connection dropped (:func:`_drop`). Over HTTP/1
    only: an HTTP/2 connection carries other requests' streams too (the server resets the
    one stream of a response left incomplete)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("http_version") in ("1.0", "1.1"):
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if callable(getattr(transport, "abort", None)):
                scope[TRANSPORT] = transport
        await super().__call__(scope, receive, send)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that a second Ctrl-C still shuts the stage down.

    On a second Ctrl-C uvicorn stops waiting for the open connections ("force quit") and
    skips the app's lifespan shutdown; the lifespan, left waiting, was then cancelled as the
    event loop closed, and logged that cancellation's traceback. Here the lifespan shuts
    down in either case (the stage's ``shutdown``: it stops at once, and the requests still
    open end with a 503), and the server exits quietly."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", help="a local model folder (default: a random tiny model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--engine", default=DEFAULT_ENGINE, help=f"MODULE:FACTORY (default: {DEFAULT_ENGINE})"
    )
    parser.add_argument(
        "--engine-kwargs",
        default="{}",
        metavar="JSON",
        help='more arguments for the engine, as a JSON object (e.g. \'{"device": "cpu"}\')',
    )
    parser.add_argument("--served-model-name", help="the model's name in the API")
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=5.0,
        help="seconds that open requests get on SIGTERM or Ctrl-C (default: 5)",
    )
    parser.add_argument(
        "--send-timeout",
        type=float,
        default=SEND_TIMEOUT,
        metavar="SECONDS",
        help="a response's send to its client that waits longer (a client that stopped "
        "reading) aborts the request and drops the connection "
        f"(default: {SEND_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"a larger request body is a 413 (default: {MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["critical", "error", "warning", "info", "debug"],
        help="default: info",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    # Checked before anything starts: uvicorn took a port out of range only once the stage
    # was up (an OverflowError, a traceback).
    if not 0 <= args.port <= 65535:
        cli.error(f"--port must be from 0 to 65535, got {args.port}")
    if not args.graceful_timeout >= 0:
        cli.error(f"--graceful-timeout must be >= 0 seconds, got {args.graceful_timeout}")
    if not 0 < args.send_timeout < math.inf:
        cli.error(f"--send-timeout must be a number of seconds > 0, got {args.send_timeout}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        engine_kwargs = json.loads(args.engine_kwargs)
    except ValueError as exc:
        cli.error(f"--engine-kwargs is not valid JSON: {exc}")
    if not isinstance(engine_kwargs, dict):
        cli.error("--engine-kwargs must be a JSON object")
    if "model" in engine_kwargs:  # the engine's model is the tokenizer's: --model's
        cli.error('--engine-kwargs may not hold "model": give the model folder as --model')
    if args.max_body_bytes < 1:
        cli.error("--max-body-bytes must be >= 1")
    model = Path(args.model) if args.model else tiny_model()
    if not model.is_dir():
        cli.error(f"--model {model}: no such folder")
    server = Server(
        model,
        load_tokenizer(model),
        args.engine,
        engine_kwargs,
        args.served_model_name or model.name,
        args.max_body_bytes,
        args.send_timeout,
    )
    config = uvicorn.Config(
        server.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        lifespan="on",
        timeout_graceful_shutdown=args.graceful_timeout,
    )
    # After a shutdown on a signal, uvicorn raises that signal again, so the process ends as
    # the signal's default would have it: SIGTERM's exit status, Ctrl-C's KeyboardInterrupt
    # (here: exit code 130, without a traceback; a second Ctrl-C too: _Uvicorn).
    try:
        _Uvicorn(config).run()
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
