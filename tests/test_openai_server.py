"""examples/openai_server.py, as a user runs it: a real server process on 127.0.0.1, its stage
process, real HTTP, and the official ``openai`` client.

The engine is :class:`enginecore.stage.testing.TokenEchoEngine` (``--engine``), a model-free
stand-in with the transformers engine's request contract: it answers at once and its tokens
are known (the prompt's ids, in a cycle), so every text below is exact. The tokenizer is a
word-level one built here (``tokenizers`` + ``PreTrainedTokenizerFast``), with a chat
template, saved to a folder as a model's tokenizer is.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Installed by the dev extra (enginecore[serve], openai, httpx): CI runs these, never skips.
import httpx
import openai
import pytest
import tokenizers

from enginecore.stage.testing import TokenEchoEngine

ROOT = Path(__file__).parent.parent


def _body(exc: openai.APIStatusError) -> dict[str, Any]:
    """The error's JSON body (typed ``object`` by the client)."""
    assert isinstance(exc.body, dict)
    return exc.body


SERVER = ROOT / "examples" / "openai_server.py"
ECHO = "enginecore.stage.testing:TokenEchoEngine"
WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":", "hello", "world"]
WORDS += ["the", "a", "cat", "sat", "on", "mat", "stop", "!"]
ID = {w: i for i, w in enumerate(WORDS)}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m['name'] %} {{ m['name'] }}{% endif %} : "
    "{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
PROMPT = "hello world the cat"  # ids 7 8 9 11: the echo engine answers " hello world the cat ..."


def _write_tokenizer(path: Path, *, chat: bool, extra: tuple[str, ...] = ()) -> Path:
    """A word-level tokenizer over WORDS (and *extra*, ids from ``len(WORDS)``), saved as a
    model folder's tokenizer."""
    transformers: Any = importlib.import_module("transformers")  # untyped here: not analysed
    vocab = {**ID, **{w: len(WORDS) + i for i, w in enumerate(extra)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("models") / "tiny-words", chat=True)


@pytest.fixture(scope="module")
def words_no_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("models") / "no-chat", chat=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Served:
    """A running server process."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=20)

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=10)

    def stats(self) -> dict[str, Any]:
        reply = self.get("/enginecore/stats")
        assert reply.status_code == 200, reply.text
        stats: dict[str, Any] = reply.json()
        return stats

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """The stage's statistics once no request is live in it."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats())["live"] and time.monotonic() < deadline:
            time.sleep(0.05)
        return stats

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _start(model: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> Served:
    port = _free_port()
    log = tmp / f"server-{port}.log"
    argv = [sys.executable, str(SERVER), "--model", str(model), "--engine", ECHO]
    argv += ["--port", str(port), "--log-level", "warning", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
    served = Served(proc, f"http://127.0.0.1:{port}", log)
    # The real engine's server took 28 s to come up by hand on a loaded 2-CPU machine, and
    # twice missed a 45 s limit there: the test's own timeout is the tighter bound.
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(
                    f"the server exited with {proc.returncode}:\n{served.output()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if served.get("/health").status_code == 200:
                    return served
            time.sleep(0.1)
        raise AssertionError(f"the server did not start within 90 s:\n{served.output()}")
    except BaseException:  # pytest-timeout's too: the server and its stage must not stay
        _stop(served)
        raise


def _stop(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGTERM)
        try:
            served.proc.wait(20)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait()


@contextlib.contextmanager
def _serving(
    model: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[Served]:
    served = _start(model, tmp, *extra, env=env)
    try:
        yield served
    finally:
        _stop(served)


@pytest.fixture(scope="module")
def server(words: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # A step every 2 ms: a long request stays live long enough to be seen and aborted.
    tmp = tmp_path_factory.mktemp("server")
    kwargs = '{"step_delay": 0.002, "vocab_size": 64}'
    with _serving(words, tmp, "--engine-kwargs", kwargs) as served:
        yield served


class SilentVocabEcho(TokenEchoEngine):
    """A custom engine's stand-in (``--engine tests.test_openai_server:SilentVocabEcho``):
    :class:`TokenEchoEngine`, refusing a prompt id at or past its *vocab_size*, without a
    ``model_info`` utility, so the server cannot check the ids itself beyond its tokenizer's
    vocabulary."""

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "model_info":
            raise ValueError("SilentVocabEcho has no utility 'model_info'")
        return super().utility(name, args)


def _descendants(pid: int) -> set[int]:
    """Every live process under *pid*, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether *pid* runs (a zombie does not: it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _left(family: set[int], timeout: float = 5.0) -> list[int]:
    """The processes of *family* still running after *timeout* s at most. (multiprocessing's
    resource tracker, a child of the server, ends when it sees the server's end of its pipe
    close: a moment after the server.)"""
    deadline = time.monotonic() + timeout
    while (alive := sorted(p for p in family if _alive(p))) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


class TestEndpoints:
    @pytest.mark.timeout(30)
    def test_models_lists_the_served_model(self, server: Served) -> None:
        models = server.client().models.list()
        assert [m.id for m in models.data] == ["tiny-words"]
        assert models.data[0].object == "model"
        assert server.client().models.retrieve("tiny-words") == models.data[0]
        with pytest.raises(openai.NotFoundError) as info:
            server.client().models.retrieve("gpt-4")
        assert _body(info.value)["code"] == "model_not_found"

    @pytest.mark.timeout(30)
    def test_completion_with_usage(self, server: Served) -> None:
        done = server.client().completions.create(
            model="tiny-words", prompt=PROMPT, max_tokens=6, temperature=0
        )
        assert done.object == "text_completion"
        assert done.choices[0].text == " hello world the cat hello world"
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 6)
        assert done.usage.total_tokens == 10

    @pytest.mark.timeout(30)
    def test_completion_of_token_ids(self, server: Served) -> None:
        done = server.client().completions.create(
            model="tiny-words", prompt=[ID["cat"], ID["sat"]], max_tokens=3
        )
        assert done.choices[0].text == " cat sat cat"
        assert done.usage is not None
        assert done.usage.prompt_tokens == 2

    @pytest.mark.timeout(30)
    def test_streamed_completion_with_usage(self, server: Served) -> None:
        chunks = list(
            server.client().completions.create(
                model="tiny-words",
                prompt=PROMPT,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == " hello world the cat hello world"
        assert len([t for t in texts if t]) == 6  # one chunk a token
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length"
        assert not any(finishes[:-1])
        assert not chunks[-1].choices
        usage = chunks[-1].usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 6, 10)

    @pytest.mark.timeout(30)
    def test_concurrent_streams_get_their_own_tokens(self, server: Served) -> None:
        client = server.client()
        words = ["hello", "world", "cat", "sat", "on", "mat", "the", "a"]

        def run(i: int) -> str:
            prompt = f"{words[i]} {words[(i + 1) % 8]}"
            stream = client.completions.create(
                model="tiny-words", prompt=prompt, max_tokens=20, stream=True
            )
            return "".join(c.choices[0].text for c in stream)

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(run, range(8)))
        for i, text in enumerate(texts):
            assert text == f" {words[i]} {words[(i + 1) % 8]}" * 10
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_stream_is_server_sent_events_ending_in_done(self, server: Served) -> None:
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = reply.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert all(e.startswith("data: ") for e in events[:-1])
        first = json.loads(events[0].removeprefix("data: "))
        assert first["choices"][0]["text"] == " hello"

    @pytest.mark.timeout(30)
    def test_chat_completion(self, server: Served) -> None:
        client = server.client()
        messages: Any = [{"role": "user", "content": "hello cat"}]
        # The template makes "user : hello cat assistant :"; the echo engine repeats it.
        done = client.chat.completions.create(model="tiny-words", messages=messages, max_tokens=5)
        assert done.object == "chat.completion"
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == " user : hello cat assistant"
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (6, 5)
        chunks = list(
            client.chat.completions.create(
                model="tiny-words",
                messages=messages,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " user : hello cat assistant"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 5

    @pytest.mark.timeout(30)
    def test_stop_strings_and_the_eos_token(self, server: Served) -> None:
        client = server.client()
        done = client.completions.create(
            model="tiny-words", prompt=PROMPT, max_tokens=9, stop="the"
        )
        assert done.choices[0].text == " hello world "
        assert done.choices[0].finish_reason == "stop"
        streamed = client.completions.create(
            model="tiny-words", prompt=PROMPT, max_tokens=9, stop=["cat"], stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == " hello world the "
        # The tokenizer's EOS is a stop token for the engine: counted, not shown.
        eos = client.completions.create(model="tiny-words", prompt="hello </s>", max_tokens=9)
        assert eos.choices[0].text == " hello"
        assert eos.choices[0].finish_reason == "stop"
        assert eos.usage is not None
        assert eos.usage.completion_tokens == 2
        assert server.wait_idle()["live"] == 0  # the stop strings' requests were aborted

    @pytest.mark.timeout(30)
    def test_bad_parameters_are_400s(self, server: Served) -> None:
        client = server.client()
        bad: list[dict[str, Any]] = [
            {"max_tokens": 0},
            {"temperature": -1},
            {"top_p": 0},
            {"n": 2},
            {"extra_body": {"echo": True}},
            {"prompt": [PROMPT, PROMPT]},
            {"prompt": ""},
        ]
        for kwargs in bad:
            args = {"model": "tiny-words", "prompt": PROMPT, "max_tokens": 4, **kwargs}
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(**args)
            assert _body(info.value)["type"] == "invalid_request_error", kwargs

    @pytest.mark.timeout(30)
    def test_null_asks_for_the_default(self, server: Served) -> None:
        # OpenAI's API types the optional parameters "or null": null is the default, stream
        # included (it was a 400, "stream must be a boolean").
        nulls = dict.fromkeys(["stream", "stream_options", "stop", "seed", "n", "temperature"])
        nulls |= dict.fromkeys(["top_p", "user", "logprobs", "logit_bias", "presence_penalty"])
        for path, base in (
            ("/v1/completions", {"prompt": PROMPT, "echo": None}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
        ):
            body = {"model": "tiny-words", "max_tokens": 2, **base, **nulls}
            reply = httpx.post(server.url + path, json=body, timeout=10)
            assert reply.status_code == 200, (path, reply.text)
            assert reply.json()["usage"]["completion_tokens"] == 2  # not streamed
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_parameters_that_would_change_the_result_are_refused_by_name(
        self, server: Served
    ) -> None:
        # Not honoured, so never silently ignored: each is a 400 whose param names it. Those
        # that cannot change the tokens (user, metadata, ...) are accepted.
        completions: list[tuple[dict[str, Any], str]] = [
            ({"logprobs": 0}, "logprobs"),  # 0 asks for the chosen tokens' logprobs
            ({"logit_bias": {"7": 100}}, "logit_bias"),
            ({"presence_penalty": 1.0}, "presence_penalty"),
            ({"frequency_penalty": -0.5}, "frequency_penalty"),
            ({"min_tokens": 4}, "min_tokens"),  # another server's extension: unknown here
            ({"ignore_eos": True}, "ignore_eos"),
            ({"stream_options": {"include_usage": "no"}}, "stream_options"),
            # Only with stream: true (as OpenAI's API and vLLM refuse it).
            ({"stream_options": {"include_usage": True}}, "stream_options"),
            ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
        ]
        chat: list[tuple[dict[str, Any], str]] = [
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"top_k": 3}, "top_k"),
            ({"top_logprobs": 2}, "top_logprobs"),
        ]
        for path, base, cases in (
            ("/v1/completions", {"prompt": PROMPT}, completions),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}, chat),
        ):
            for extra, param in cases:
                body = {"model": "tiny-words", "max_tokens": 4, **base, **extra}
                reply = httpx.post(server.url + path, json=body, timeout=10)
                assert reply.status_code == 400, (extra, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param, error
                assert param in error["message"], error
        fine = {"user": "u", "metadata": {"k": "v"}, "logit_bias": {}, "presence_penalty": 0}
        fine |= {"top_logprobs": 0, "logprobs": False}
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "model": "tiny-words",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 2,
                "response_format": {"type": "text"},
                "tool_choice": "none",
                **fine,
            },
            timeout=10,
        )
        assert reply.status_code == 200, reply.text
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_a_messages_fields_are_used_or_refused_never_dropped(self, server: Served) -> None:
        # A message's name reaches the chat template (this one renders it); OpenAI's fields
        # this server does not do, and fields OpenAI does not have, were dropped silently.
        def chat(*messages: dict[str, Any], max_tokens: int = 5) -> httpx.Response:
            body = {"model": "tiny-words", "max_tokens": max_tokens, "messages": list(messages)}
            return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)

        reply = chat({"role": "user", "name": "cat", "content": "hello"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == " user cat : hello assistant"
        parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}]
        unused: dict[str, Any] = {
            "tool_calls": [],
            "function_call": None,
            "refusal": None,
            "audio": None,
        }
        reply = chat(
            {"role": "user", "content": "cat"},
            {"role": "assistant", "content": parts, **unused},
            max_tokens=9,
        )
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["message"]["content"]
        assert text == " user : cat assistant : hello world assistant :"
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        cases: list[tuple[Any, str]] = [
            (
                {"role": "assistant", "content": "hi", "tool_calls": [call]},
                "messages[1].tool_calls",
            ),
            ({"role": "tool", "content": "hi", "tool_call_id": "c1"}, "messages[1].tool_call_id"),
            ({"role": "user", "content": "hi", "weight": 2}, "messages[1].weight"),
            ({"role": "user", "content": "hi", "name": 7}, "messages[1].name"),
            ({"role": "user", "content": [{"type": "text"}]}, "messages[1].content[0].text"),
            ({"role": "user", "content": [{"type": "image_url"}]}, "messages[1].content[0].type"),
            ({"role": "user", "content": None}, "messages[1].content"),
            # The role's own param, as OpenAI's (was the message's, for a missing role too).
            ({"content": "hi"}, "messages[1].role"),
            ({"role": 7, "content": "hi"}, "messages[1].role"),
            ("hi", "messages[1]"),
        ]
        for message, param in cases:
            reply = chat({"role": "user", "content": "hello"}, message)
            assert reply.status_code == 400, (message, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param, error
            assert error["type"] == "invalid_request_error", error
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_integers_out_of_the_wires_range_are_400s_not_500s(self, server: Served) -> None:
        # JSON integers are unbounded; the stage's wire (msgpack) takes -2**63..2**64-1.
        cases: list[tuple[dict[str, Any], str]] = [
            ({"max_tokens": 10**30}, "max_tokens"),
            ({"max_tokens": 10**400}, "max_tokens"),  # too large for a float too
            ({"temperature": 10**400}, "temperature"),
            ({"seed": 2**64}, "seed"),
            ({"prompt": [7, 2**70]}, "prompt"),
        ]
        for extra, param in cases:
            for stream in (False, True):
                body = {"model": "tiny-words", "prompt": PROMPT, "stream": stream, **extra}
                reply = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
                assert reply.status_code == 400, (extra, reply.text)
                error = reply.json()["error"]
                assert error["type"] == "invalid_request_error", error
                assert error["param"] == param, error
                assert len(error["message"]) < 200, error
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_a_prompt_id_outside_the_models_vocabulary_is_a_400(self, server: Served) -> None:
        # The engine's vocabulary (model_info's vocab_size: 64) is larger than the
        # tokenizer's (17 words): the larger is the limit, as vLLM's. An id past it is
        # refused before it is sent (the engine's own refusal: test_a_default_max_tokens_is_
        # cut_to_the_kv_budget).
        client = server.client()
        added = server.stats()["engine"]["added"]
        for stream in (False, True):  # streamed too: the refusal comes before any header
            with pytest.raises(openai.BadRequestError, match="vocabulary of 64") as info:
                client.completions.create(
                    model="tiny-words", prompt=[ID["cat"], 100], max_tokens=3, stream=stream
                )
            assert _body(info.value)["param"] == "prompt"
            assert "100" in _body(info.value)["message"]
        done = client.completions.create(model="tiny-words", prompt=[ID["cat"], 63], max_tokens=2)
        assert done.usage is not None
        assert done.usage.prompt_tokens == 2
        assert server.wait_idle()["engine"]["added"] == added + 1

    @pytest.mark.timeout(30)
    def test_a_prompt_longer_than_the_context_is_refused_before_it_is_sent(
        self, server: Served
    ) -> None:
        # The limit is the engine's model_info (max_positions: 2048 here); the server refuses
        # in its own words (code context_length_exceeded), so the stage never saw it (its
        # own refusal would be request_rejected).
        client = server.client()
        added = server.stats()["engine"]["added"]
        huge = [ID["cat"]] * 200_000
        cases: list[tuple[Any, int, str]] = [(PROMPT, 3000, "4 tokens"), (huge, 3, "200000")]
        for prompt, max_tokens, said in cases:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError, match="2048 tokens") as info:
                    client.completions.create(
                        model="tiny-words", prompt=prompt, max_tokens=max_tokens, stream=stream
                    )
                error = _body(info.value)
                assert error["code"] == "context_length_exceeded", error
                assert error["param"] == "prompt", error
                assert said in error["message"], error
        messages: Any = [{"role": "user", "content": "hello " * 3000}]
        with pytest.raises(openai.BadRequestError, match="max_completion_tokens") as info:
            client.chat.completions.create(
                model="tiny-words", messages=messages, max_completion_tokens=5
            )
        assert _body(info.value)["param"] == "messages"
        # Exactly the limit fits.
        reply = client.completions.create(
            model="tiny-words", prompt=[ID["cat"]] * 2040, max_tokens=8
        )
        assert reply.usage is not None
        assert reply.usage.total_tokens == 2048
        assert server.stats()["engine"]["added"] == added + 1

    @pytest.mark.timeout(30)
    def test_a_default_max_tokens_is_cut_to_what_the_context_leaves(self, server: Served) -> None:
        # Not sent, max_tokens is the server's default (16; 256 in a chat), not the user's:
        # where the prompt leaves less of the context (2048 here), the request gets what is
        # left, as vLLM does, rather than a 400 naming a parameter the user never sent.
        client = server.client()
        # "user : hello ... assistant :": 2 + 2040 + 2 = 2044 tokens, 4 left.
        messages: Any = [{"role": "user", "content": "hello " * 2040}]
        chat = client.chat.completions.create(model="tiny-words", messages=messages)
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == 2044
        assert chat.usage.completion_tokens == 4
        assert chat.choices[0].finish_reason == "length"
        text = client.completions.create(model="tiny-words", prompt=[ID["cat"]] * 2040)
        assert text.usage is not None
        assert text.usage.completion_tokens == 8
        # A prompt that fills the context leaves no room at all: still a 400, in words that
        # do not name a max_tokens the user did not send.
        full: Any = [{"role": "user", "content": "hello " * 2044}]
        with pytest.raises(openai.BadRequestError, match="no room") as info:
            client.chat.completions.create(model="tiny-words", messages=full)
        error = _body(info.value)
        assert error["code"] == "context_length_exceeded", error
        assert "max_tokens" not in error["message"], error
        # Sent, max_tokens is the user's: too many is a 400, as before.
        with pytest.raises(openai.BadRequestError, match="context"):
            client.chat.completions.create(model="tiny-words", messages=messages, max_tokens=5)
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_errors_have_openais_shape(self, server: Served) -> None:
        with pytest.raises(openai.NotFoundError, match="tiny-words"):
            server.client().completions.create(model="gpt-4", prompt=PROMPT)
        reply = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10)
        assert reply.status_code == 400
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        reply = httpx.get(server.url + "/v1/nowhere", timeout=10)
        assert reply.status_code == 404
        # OpenAI's words for a path it does not serve (the server said "Not Found").
        error = {"message": "Invalid URL (GET /v1/nowhere)", "param": None, "code": None}
        assert reply.json() == {"error": {**error, "type": "invalid_request_error"}}
        # A served path with another method: a 405 with its Allow header (HTTP requires
        # it; it was dropped with Starlette's own body).
        reply = httpx.get(server.url + "/v1/completions", timeout=10)
        assert reply.status_code == 405
        assert reply.headers["allow"] == "POST"
        assert reply.json()["error"]["type"] == "invalid_request_error"

    @pytest.mark.timeout(30)
    def test_a_lone_surrogate_is_a_400_not_a_500(self, server: Served) -> None:
        # JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer takes (nor
        # the stage's wire): it was a 500 in plain text, with the tokenizer's traceback.
        bodies = [
            ("/v1/completions", b'{"prompt": "hello \\ud800", "max_tokens": 2}'),
            ("/v1/completions", b'{"prompt": "hello", "stop": ["\\udc00"], "max_tokens": 2}'),
            (
                "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
            ),
        ]
        for path, raw in bodies:
            reply = httpx.post(server.url + path, content=raw, timeout=10)
            assert reply.status_code == 400, (raw, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error", error
            assert "surrogate" in error["message"], error
        assert "TextEncodeInput" not in server.output()  # the tokenizer's error, logged
        # A pair is a character: "hello" then an emoji (an unknown word to this tokenizer).
        raw = b'{"prompt": "hello \\ud83d\\ude00", "max_tokens": 2}'
        reply = httpx.post(server.url + "/v1/completions", content=raw, timeout=10)
        assert reply.status_code == 200, reply.text
        assert server.wait_idle()["live"] == 0

    @pytest.mark.timeout(30)
    def test_a_body_over_the_limit_is_a_413_read_no_further(self, server: Served) -> None:
        # Default --max-body-bytes: 8 MiB. Announced by Content-Length, or streamed (chunked,
        # no length): refused once past the limit, never tokenized or sent to the stage.
        big = json.dumps({"model": "tiny-words", "prompt": "hello " * (1_500_000)}).encode()
        assert len(big) > 8 * 2**20

        def chunked() -> Iterator[bytes]:
            for at in range(0, len(big), 2**20):
                yield big[at : at + 2**20]

        for content in (big, chunked()):
            reply = httpx.post(server.url + "/v1/completions", content=content, timeout=20)
            assert reply.status_code == 413, reply.text[:200]
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "8388608" in error["message"]
        reply = httpx.put(server.url + "/v1/completions", timeout=10)  # a 4xx is the client's
        assert reply.status_code == 405
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert server.get("/health").status_code == 200

    @pytest.mark.timeout(60)
    def test_text_is_tokenized_off_the_event_loop(self, words: Path) -> None:
        # A long prompt takes seconds to tokenize: on the event loop it would hold every
        # stream and /health up. In process (Starlette's TestClient runs the lifespan, so a
        # real stage), with a tokenizer that records the thread of each call.
        from starlette.testclient import TestClient

        transformers: Any = importlib.import_module("transformers")
        module = _load_server_module()
        real = transformers.AutoTokenizer.from_pretrained(str(words), local_files_only=True)
        threads: list[str] = []

        class Recording:
            chat_template = real.chat_template
            eos_token_id = real.eos_token_id

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                threads.append(threading.current_thread().name)
                return real(*args, **kwargs)

            def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
                threads.append(threading.current_thread().name)
                return real.apply_chat_template(*args, **kwargs)

            def decode(self, *args: Any, **kwargs: Any) -> Any:
                return real.decode(*args, **kwargs)

        server = module.Server(words, Recording(), ECHO, {}, "tiny-words")
        with TestClient(server.app()) as client:
            done = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            assert done.status_code == 200, done.text
            assert done.json()["choices"][0]["text"] == " hello world the cat"
            chat = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
            )
            assert chat.status_code == 200, chat.text
        assert len(threads) >= 4  # the warm-up, the prompt, the template, the chat's text
        assert all(name.startswith("tokenizer") for name in threads), threads

    @pytest.mark.timeout(60)
    def test_an_unexpected_error_is_a_500_in_openai_s_shape(self, words: Path) -> None:
        # No path of the server is known to raise something unexpected: a tokenizer that
        # fails stands in for the bug that would. The client still gets OpenAI's error
        # shape (an SDK parses it), not Starlette's plain-text "Internal Server Error" (which
        # still re-raises it after the reply, for uvicorn to log with its traceback).
        from starlette.testclient import TestClient

        transformers: Any = importlib.import_module("transformers")
        module = _load_server_module()
        real = transformers.AutoTokenizer.from_pretrained(str(words), local_files_only=True)
        broken = threading.Event()

        class Failing:
            chat_template = real.chat_template
            eos_token_id = real.eos_token_id

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                if broken.is_set():
                    raise RuntimeError("tokenizer bug")
                return real(*args, **kwargs)

            def decode(self, *args: Any, **kwargs: Any) -> Any:
                return real.decode(*args, **kwargs)

        server = module.Server(words, Failing(), ECHO, {}, "tiny-words")
        with TestClient(server.app(), raise_server_exceptions=False) as client:
            broken.set()
            reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert reply.status_code == 500, reply.text
            error = reply.json()["error"]
            assert error["type"] == "server_error"
            assert "RuntimeError" in error["message"]
            broken.clear()
            again = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert again.status_code == 200, again.text  # the server goes on

    @pytest.mark.timeout(60)
    def test_a_custom_engines_refusal_of_a_prompt_id_is_a_400_with_its_message(
        self, words: Path, tmp_path: Path
    ) -> None:
        # An engine without model_info: the server checks ids against its tokenizer's
        # vocabulary only (17 words), and the engine (10) refuses those past its own.
        engine = "tests.test_openai_server:SilentVocabEcho"  # imported from the checkout
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        args = ("--engine", engine, "--engine-kwargs", '{"vocab_size": 10}')
        env = {"PYTHONPATH": os.pathsep.join(path)}
        with _serving(words, tmp_path, *args, env=env) as served:
            client = served.client()
            for stream in (False, True):  # the refusal comes before any header
                with pytest.raises(openai.BadRequestError) as info:
                    client.completions.create(
                        model="tiny-words", prompt=[ID["cat"], ID["hello"]], stream=stream
                    )
                error = _body(info.value)
                assert error["code"] == "request_rejected", error
                assert error["type"] == "invalid_request_error", error
                # The engine's own words, not the server's check (a vocabulary of 17).
                assert error["message"] == "prompt has token id 11, outside the vocabulary of 10"
            messages: Any = [{"role": "user", "content": "cat"}]  # rendered: id 11
            with pytest.raises(openai.BadRequestError, match="token id 11") as info:
                client.chat.completions.create(model="tiny-words", messages=messages)
            assert _body(info.value)["code"] == "request_rejected"
            done = client.completions.create(model="tiny-words", prompt=[ID["hello"]], max_tokens=2)
            assert done.choices[0].text == " hello hello"
            assert served.wait_idle()["live"] == 0
            assert "Traceback" not in served.output()


class TestDisconnect:
    @pytest.mark.timeout(30)
    def test_a_client_that_leaves_a_stream_aborts_its_request(self, server: Served) -> None:
        before = server.stats()["engine"]
        body = {"prompt": PROMPT, "max_tokens": 1500, "stream": True}  # 3 s of steps
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.stats()["live"] == 1
        # The connection is closed: the server sees it and aborts the request in the stage.
        started = time.monotonic()
        stats = server.wait_idle(timeout=5)
        assert stats["live"] == 0
        assert time.monotonic() - started < 2.0
        assert stats["engine"]["aborted"] == before["aborted"] + 1
        assert stats["engine"]["finished"] == before["finished"]

    @pytest.mark.timeout(30)
    def test_a_client_that_leaves_a_whole_completion_aborts_it(self, server: Served) -> None:
        before = server.stats()["engine"]
        body = {"prompt": PROMPT, "max_tokens": 1500}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        stats = server.wait_idle(timeout=5)
        assert stats["live"] == 0
        assert stats["engine"]["aborted"] == before["aborted"] + 1
        assert stats["engine"]["finished"] == before["finished"]


#: A word of 16 KiB: each streamed token is an event of that size, so a few hundred of them
#: fill the socket buffers between the server and a reader that stops (on loopback the
#: kernel takes some 3 MB before the server's send waits) in about a second.
LONG_WORD = "z" * 2**14
LONG_ID = len(WORDS)
SEND_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def long_words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(
        tmp_path_factory.mktemp("models") / "long-words", chat=False, extra=(LONG_WORD,)
    )


@pytest.fixture(scope="module")
def bounded(long_words: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server with a short --send-timeout, over steps of 5 ms (16 KiB of text each)."""
    tmp = tmp_path_factory.mktemp("bounded")
    kwargs = '{"step_delay": 0.005, "max_model_len": 100000}'
    extra = ("--engine-kwargs", kwargs, "--send-timeout", str(SEND_TIMEOUT))
    with _serving(long_words, tmp, *extra) as served:
        yield served


def _raw_post(served: Served, body: dict[str, Any], rcvbuf: int | None = None) -> socket.socket:
    """A socket that has sent ``POST /v1/completions`` with *body*, and read nothing yet
    (its receive buffer set to *rcvbuf* bytes first, before the window is agreed)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", int(served.url.rsplit(":", 1)[1])))
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def _read_until(sock: socket.socket, marker: bytes, got: bytearray, deadline: float) -> None:
    """Reads into *got* until it holds *marker*."""
    while marker not in got:
        assert time.monotonic() < deadline, f"no {marker!r} in time; got {bytes(got[:300])!r}"
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended before {marker!r}"
        got += chunk


class TestSlowReaders:
    """--send-timeout: a stream whose client stops reading (its connection open) is aborted
    in the stage and its connection dropped; one that reads slowly but keeps up is not."""

    @pytest.mark.timeout(60)
    def test_a_stalled_reader_is_aborted_and_dropped(self, bounded: Served) -> None:
        before = bounded.stats()["engine"]
        body = {"prompt": [LONG_ID], "max_tokens": 20000, "stream": True}  # 100 s of steps
        with contextlib.closing(_raw_post(bounded, body, rcvbuf=4096)) as sock:
            got = bytearray()
            _read_until(sock, b"\n\n", got, time.monotonic() + 10)  # the headers, one event
            assert got.startswith(b"HTTP/1.1 200 "), bytes(got[:200])
            found = re.search(rb'"id":"(cmpl-[0-9a-f]+)"', got)
            assert found, bytes(got[:300])
            req_id = found.group(1).decode()
            assert bounded.stats()["live"] == 1
            # It reads no more. The server's sends fill the socket's buffers, then wait: past
            # the send timeout the request is aborted in the stage.
            stopped = time.monotonic()
            deadline = stopped + SEND_TIMEOUT + 20  # + filling the buffers, on a busy machine
            while (stats := bounded.stats())["engine"]["aborted"] == before["aborted"]:
                assert time.monotonic() < deadline, "the stalled stream was not aborted"
                time.sleep(0.05)
            waited = time.monotonic() - stopped
            assert waited >= SEND_TIMEOUT
            assert stats["engine"]["finished"] == before["finished"]
            assert bounded.wait_idle(timeout=5)["live"] == 0
            # One warning, naming the request.
            lines = [line for line in bounded.output().splitlines() if req_id in line]
            assert len(lines) == 1, bounded.output()[-2000:]
            assert lines[0].startswith("WARNING:"), lines
            assert "send timeout" in lines[0], lines
            # The connection is dropped with a reset (not a close, which would wait for the
            # client to read what the kernel holds): it ends without the stream's [DONE].
            deadline = time.monotonic() + 20

            def read_to_the_end() -> None:
                while chunk := sock.recv(65536):
                    assert time.monotonic() < deadline, "the connection stayed open"
                    got.extend(chunk)

            with pytest.raises(ConnectionResetError):
                read_to_the_end()
            assert b"[DONE]" not in got
        # The server serves on.
        done = bounded.client().completions.create(
            model="long-words", prompt=[ID["hello"]], max_tokens=3
        )
        assert done.choices[0].text == " hello hello hello"
        assert "Traceback" not in bounded.output()
        assert "without completing" not in bounded.output()  # uvicorn's error, were it closed

    @pytest.mark.timeout(90)
    def test_a_slow_reader_that_keeps_up_is_served_in_full(self, bounded: Served) -> None:
        # 600 events of 16 KiB: 9.8 MB, more than the buffers between the server and a
        # reader of 64 KiB take (some 4 MB on loopback), read at 1.5 MB/s (the stage makes
        # 3.2 MB/s): past the first 2.5 s the server's sends wait on the reader, and the
        # whole takes 6.5 s, twice the send timeout. Each send waits until the kernel takes
        # more: once the reader has emptied about a third of its send buffer (1.4 MB here,
        # about 1 s; a send timeout of 0.5 s cuts this reader).
        before = bounded.stats()["engine"]
        warnings = bounded.output().count("WARNING")
        tokens = 600
        body = {"prompt": [LONG_ID], "max_tokens": tokens, "stream": True}
        rate = 1.5e6  # bytes/s
        started = time.monotonic()
        got = bytearray()
        with contextlib.closing(_raw_post(bounded, body, rcvbuf=2**16)) as sock:
            deadline = started + 60
            while not got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                assert time.monotonic() < deadline, bytes(got[-300:])
                chunk = sock.recv(2**15)
                assert chunk, f"the connection ended early: {bytes(got[-300:])!r}"
                got += chunk
                time.sleep(max(0.0, started + len(got) / rate - time.monotonic()))
        assert time.monotonic() - started >= 2 * SEND_TIMEOUT
        assert got.count(LONG_WORD.encode()) == tokens
        assert b'"finish_reason":"length"' in got
        stats = bounded.wait_idle(timeout=5)
        assert stats["engine"]["aborted"] == before["aborted"]
        assert stats["engine"]["finished"] == before["finished"] + 1
        assert bounded.output().count("WARNING") == warnings

    def test_each_send_is_bounded_not_the_whole(self) -> None:
        # One timer serves every send of a response: sends that each take most of the
        # timeout go through, one that takes longer raises; a cancellation from elsewhere
        # stays a cancellation.
        module = _load_server_module()

        async def main() -> None:
            async def send(message: dict[str, Any]) -> None:
                await asyncio.sleep(message["s"])

            bounded = module.BoundedSend(send, 0.2)
            started = time.monotonic()
            for _ in range(5):
                await bounded({"s": 0.13})
            await asyncio.sleep(0.5)  # between sends: no send to bound
            await bounded({"s": 0})
            assert time.monotonic() - started >= 1.0
            started = time.monotonic()
            with pytest.raises(module.SendTimeout):
                await bounded({"s": 10})
            assert 0.2 <= time.monotonic() - started < 2
            task = asyncio.ensure_future(bounded({"s": 10}))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            bounded.close()

        asyncio.run(asyncio.wait_for(main(), 20))

    def test_a_whole_completions_send_is_bounded_too(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # uvicorn takes a whole body into its buffer without waiting (it waits before a
        # write, while the buffer is full): here a send that never completes stands for one.
        module = _load_server_module()
        calls: list[str] = []

        class Transport:
            def get_extra_info(self, name: str) -> None:
                return None

            def abort(self) -> None:
                calls.append("abort")

        async def send(message: dict[str, Any]) -> None:
            calls.append(message["type"])
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()  # a client that reads nothing

        async def receive() -> dict[str, Any]:  # read once the connection is dropped
            assert calls[-1:] == ["abort"], calls
            return {"type": "http.disconnect"}

        response = module.BoundedJSON({"id": "cmpl-1"}, "cmpl-1", 0.2)
        scope = {"type": "http", module.TRANSPORT: Transport()}
        started = time.monotonic()
        asyncio.run(asyncio.wait_for(response(scope, receive, send), 10))
        assert 0.2 <= time.monotonic() - started < 5
        assert calls == ["http.response.start", "http.response.body", "abort"]
        (record,) = [r for r in caplog.records if "cmpl-1" in r.getMessage()]
        assert record.levelname == "WARNING"

    def test_a_long_wait_for_the_engine_is_not_a_send_wait(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # A slow engine: the next event comes long after the send timeout, to a client that
        # reads all it is sent. Only sends are bounded: the stream is served in full.
        module = _load_server_module()
        sent: list[bytes] = []
        closes: list[str] = []

        async def events() -> Any:
            yield b"a"
            await asyncio.sleep(0.5)  # the engine's next token: 5 send timeouts later
            yield b"b"
            await asyncio.sleep(0.5)
            yield b"c"

        async def on_close() -> None:
            closes.append("close")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b"start"))

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        stream = module.EventStream(events(), on_close, "cmpl-1", 0.1)
        asyncio.run(asyncio.wait_for(stream({"type": "http"}, receive, send), 10))
        assert sent == [b"start", b"a", b"b", b"c", b""]
        assert closes == ["close"]
        assert not [r for r in caplog.records if r.levelname == "WARNING"]

    @pytest.mark.parametrize(("version", "dropped"), [("1.1", True), ("1.0", True), ("2", False)])
    def test_only_an_http1_connection_is_dropped(self, version: str, dropped: bool) -> None:
        # Over HTTP/2 (uvicorn's zttp) a request's send is a method of its stream, which holds
        # the connection's transport, shared by every stream on it: a stream whose reader
        # stopped must not drop the others' connection (the server resets that one stream).
        module = _load_server_module()
        from starlette.responses import PlainTextResponse
        from starlette.routing import Route

        found: list[Any] = []

        async def endpoint(request: Any) -> Any:
            found.append(request.scope.get(module.TRANSPORT))
            return PlainTextResponse("")

        class Transport:
            def abort(self) -> None:
                raise AssertionError("not dropped here")

        class Cycle:  # uvicorn's request-response cycle: its send is a method
            transport = Transport()

            async def send(self, message: dict[str, Any]) -> None:
                pass

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        app = module._App(routes=[Route("/", endpoint)])
        scope = {
            "type": "http",
            "http_version": version,
            "method": "GET",
            "path": "/",
            "root_path": "",
            "query_string": b"",
            "headers": [],
        }
        cycle = Cycle()
        asyncio.run(app(scope, receive, cycle.send))
        assert found == [cycle.transport if dropped else None]

    def test_the_server_sees_the_connection_lost_before_the_app_returns(self) -> None:
        # Over TLS, asyncio reports an aborted connection to the server's protocol two loop
        # turns later (the socket's transport to the TLS protocol, that to uvicorn's): an
        # app that returns before uvicorn sees it lost has uvicorn log an error ("ASGI
        # callable returned without completing response"). Its receive says when it has.
        module = _load_server_module()
        loop_turns = 2

        class Cycle:  # uvicorn's request-response cycle, over a transport as TLS's
            def __init__(self) -> None:
                self.disconnected = False
                self.lost = asyncio.Event()
                self.transport = self

            def get_extra_info(self, name: str) -> None:
                return None

            def abort(self) -> None:
                def lost(turns: int) -> None:
                    if turns > 1:
                        asyncio.get_running_loop().call_soon(lost, turns - 1)
                    else:
                        self.disconnected = True
                        self.lost.set()

                asyncio.get_running_loop().call_soon(lost, loop_turns)

            async def send(self, message: dict[str, Any]) -> None:
                if message.get("body"):
                    await asyncio.Event().wait()  # a client that reads nothing

            async def receive(self) -> dict[str, Any]:
                await self.lost.wait()
                return {"type": "http.disconnect"}

        async def events() -> Any:
            yield b"a"

        async def on_close() -> None:
            pass

        async def main() -> None:
            for response in (
                module.EventStream(events(), on_close, "cmpl-1", 0.1),
                module.BoundedJSON({"id": "cmpl-2"}, "cmpl-2", 0.1),
            ):
                cycle = Cycle()
                scope = {"type": "http", module.TRANSPORT: cycle.transport}
                await response(scope, cycle.receive, cycle.send)
                assert cycle.disconnected, response

        asyncio.run(asyncio.wait_for(main(), 10))

    def test_the_warning_says_whether_the_connection_was_dropped(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # Without the connection's transport (HTTP/2, or a server whose send hides it) the
        # response is left to the server to end: the warning does not say "dropped".
        module = _load_server_module()

        async def receive() -> dict[str, Any]:
            raise AssertionError("not read")

        asyncio.run(module._drop({"type": "http"}, receive, "cmpl-3", 0.1, "request aborted"))
        (record,) = [r for r in caplog.records if "cmpl-3" in r.getMessage()]
        assert "request aborted" in record.getMessage()
        assert "dropped" not in record.getMessage()
        assert "left incomplete" in record.getMessage()


class TestLifecycle:
    @pytest.mark.timeout(60)
    def test_sigterm_stops_the_server_and_its_stage(self, words: Path, tmp_path: Path) -> None:
        served = _start(words, tmp_path, "--engine-kwargs", '{"step_delay": 0.01}')
        try:
            stage = served.stats()["pid"]
            family = _descendants(served.proc.pid)
            assert stage in family
            # SIGTERM while a stream is open: it ends, the stage shuts down, nothing is left.
            body = {"prompt": PROMPT, "max_tokens": 1500, "stream": True}
            with httpx.stream("POST", served.url + "/v1/completions", json=body) as reply:
                next(reply.iter_lines())
                served.proc.send_signal(signal.SIGTERM)
                # uvicorn raises the signal again once it has shut down gracefully
                assert served.proc.wait(15) == -signal.SIGTERM, served.output()
        finally:
            _stop(served)
        assert _left(family) == []
        assert "Traceback" not in served.output()

    @pytest.mark.timeout(60)
    def test_requests_cut_by_the_graceful_timeout_end_with_an_error(
        self, words: Path, tmp_path: Path
    ) -> None:
        # Past --graceful-timeout uvicorn cancels what is still running: a whole completion
        # gets a 503 in OpenAI's shape, a stream an error event and [DONE]; no traceback.
        served = _start(
            words, tmp_path, "--engine-kwargs", '{"step_delay": 0.01}', "--graceful-timeout", "0.5"
        )
        try:
            family = _descendants(served.proc.pid)
            body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1500}  # 15 s of steps
            with ThreadPoolExecutor(1) as pool:
                whole = pool.submit(
                    httpx.post, served.url + "/v1/completions", json=body, timeout=20
                )
                stream = {**body, "stream": True}
                with httpx.stream("POST", served.url + "/v1/completions", json=stream) as reply:
                    lines = reply.iter_lines()
                    assert next(lines).startswith("data: ")
                    deadline = time.monotonic() + 10
                    while served.stats()["live"] < 2 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    served.proc.send_signal(signal.SIGTERM)
                    events = [line for line in lines if line.startswith("data: ")]
                answer = whole.result()
            assert served.proc.wait(15) == -signal.SIGTERM, served.output()
        finally:
            _stop(served)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "server_shutting_down"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down"
        assert _left(family) == []
        assert "Traceback" not in served.output()

    @pytest.mark.timeout(60)
    def test_ctrl_c_stops_it_too(self, words_no_chat: Path, tmp_path: Path) -> None:
        served = _start(words_no_chat, tmp_path)
        try:
            family = _descendants(served.proc.pid)
            # A tokenizer without a chat template: chat completions are refused, clearly.
            messages: Any = [{"role": "user", "content": "hello"}]
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                served.client().chat.completions.create(model="no-chat", messages=messages)
            served.proc.send_signal(signal.SIGINT)
            assert served.proc.wait(15) == 130, served.output()
        finally:
            _stop(served)
        assert family
        assert _left(family) == []

    @pytest.mark.timeout(60)
    def test_a_second_ctrl_c_exits_at_once_and_quietly(self, words: Path, tmp_path: Path) -> None:
        # The first Ctrl-C waits for the open stream (graceful timeout: 60 s); the second
        # stops waiting, and the stage is still shut down through the lifespan: no
        # traceback, nothing left, exit code 130 (KeyboardInterrupt).
        served = _start(
            words,
            tmp_path,
            "--engine-kwargs",
            '{"step_delay": 0.025}',
            "--graceful-timeout",
            "60",
            "--log-level",
            "info",
        )
        try:
            family = _descendants(served.proc.pid)
            body = {"prompt": PROMPT, "max_tokens": 2000, "stream": True}  # 50 s of steps
            with httpx.stream("POST", served.url + "/v1/completions", json=body) as reply:
                lines = reply.iter_lines()
                assert next(lines).startswith("data: ")
                served.proc.send_signal(signal.SIGINT)
                deadline = time.monotonic() + 10
                while "Waiting for connections" not in served.output():
                    assert time.monotonic() < deadline, served.output()
                    time.sleep(0.05)
                served.proc.send_signal(signal.SIGINT)
                assert served.proc.wait(15) == 130, served.output()
        finally:
            _stop(served)
        assert _left(family) == []
        assert "Traceback" not in served.output(), served.output()
        assert "Application shutdown complete" in served.output()

    @pytest.mark.timeout(60)
    def test_a_dead_stage_is_a_503(self, words: Path, tmp_path: Path) -> None:
        with _serving(words, tmp_path) as served:
            os.kill(served.stats()["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 5
            while served.get("/health").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert served.get("/health").json() == {"status": "dead"}
            with pytest.raises(openai.InternalServerError) as info:
                served.client().completions.create(model="tiny-words", prompt=PROMPT)
            assert info.value.status_code == 503
            assert _body(info.value)["type"] == "service_unavailable_error"
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(15) == -signal.SIGTERM, served.output()


def _load_server_module() -> Any:
    spec = importlib.util.spec_from_file_location("openai_server", SERVER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestCommandLine:
    @pytest.mark.timeout(60)
    @pytest.mark.parametrize(
        ("args", "said"),
        [
            (["--engine-kwargs", "{nope"], "not valid JSON"),
            (["--engine-kwargs", "[1]"], "a JSON object"),
            (["--max-body-bytes", "0"], "--max-body-bytes"),
            # The engine's model is --model's, the folder this process takes its tokenizer
            # from: a "model" in --engine-kwargs replaced it in the engine alone, and the
            # server decoded one model's ids with another's tokenizer.
            (["--engine-kwargs", '{"model": "/elsewhere"}'], "--model"),
            # Checked before the stage starts: a port out of range was uvicorn's OverflowError,
            # two tracebacks after the stage's start; a bad level, logging's ValueError.
            (["--port", "65536"], "--port"),
            (["--port", "-1"], "--port"),
            (["--log-level", "loud"], "--log-level"),
            (["--graceful-timeout", "-1"], "--graceful-timeout"),
            (["--send-timeout", "0"], "--send-timeout"),
            (["--send-timeout", "-1"], "--send-timeout"),
            (["--send-timeout", "nan"], "--send-timeout"),
            (["--send-timeout", "inf"], "--send-timeout"),
        ],
    )
    def test_bad_arguments_exit_with_a_usage_error(
        self, words: Path, args: list[str], said: str
    ) -> None:
        argv = [sys.executable, str(SERVER), "--model", str(words), "--engine", ECHO, *args]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=50)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr


class TestReadme:
    """The README's "Serve a model" commands are what the server and pyproject accept."""

    @staticmethod
    def _section() -> str:
        readme = (ROOT / "README.md").read_text()
        match = re.search(r"^## Serve a model\n(.*?)^## ", readme, re.S | re.M)
        assert match, "README.md lost its 'Serve a model' section"
        return match.group(1)

    def test_install_and_run_commands(self) -> None:
        section = self._section()
        install = re.search(r"pip install '\.\[([a-z,]+)\]'", section)
        assert install, "no install command"
        pyproject = (ROOT / "pyproject.toml").read_text()
        table = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
        extras = re.findall(r"^([a-z-]+) = \[", table, re.M)
        for extra in install.group(1).split(","):
            if extra == "transformers" and importlib.util.find_spec("enginecore.engines") is None:
                continue  # the engine's own extra comes with the engine
            assert extra in extras, extra
        run = re.search(r"^(python examples/openai_server\.py.*?)(?:\s+#.*)?$", section, re.M)
        assert run, "no run command"
        argv = shlex.split(run.group(1))[2:]
        module = _load_server_module()
        module.parser().parse_args(argv)  # exits on a flag it does not know

    @pytest.mark.timeout(30)
    def test_the_curl_call_is_answered(self, server: Served) -> None:
        section = self._section()
        curl = re.search(r"curl [^\n]*?(localhost|127\.0\.0\.1):8000(/v1/\S+)", section)
        data = re.search(r"-d '(\{.*?\})'", section, re.S)
        assert curl, "no curl call"
        assert data, "no JSON body in the curl call"
        body = json.loads(data.group(1))
        assert body["model"] == _load_server_module().TINY_MODEL  # the default model's name
        body["model"] = "tiny-words"
        reply = httpx.post(server.url + curl.group(2), json=body, timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == body["max_tokens"]


class TestTinyModel:
    """Without --model: the random model is built once into the cache folder, then reused."""

    def test_built_once_into_the_cache_then_reused(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        built: list[str] = []

        def make_random_model(path: str) -> str:
            built.append(path)
            (Path(path) / "config.json").write_text("{}")
            return path

        fake = type(sys)("enginecore.engines.transformers")
        fake.make_random_model = make_random_model  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "enginecore.engines.transformers", fake)
        monkeypatch.setenv("ENGINECORE_CACHE", str(tmp_path / "cache"))
        module = _load_server_module()
        path = module.tiny_model()
        assert path == tmp_path / "cache" / "tiny-llama"
        assert (path / "config.json").is_file()
        assert len(built) == 1
        assert Path(built[0]) != path  # built beside it, then renamed into place
        assert module.tiny_model() == path
        assert len(built) == 1
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-llama"]


class TestTheRealEngine:
    """The server's default engine, TransformersEngine, on a random-weight model written by
    make_random_model (the no-``--model`` path builds the same), over the openai client."""

    @pytest.mark.timeout(120)
    def test_completions_stream_and_chat(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        from enginecore.engines.transformers import make_random_model

        tmp = tmp_path_factory.mktemp("real")
        model = Path(make_random_model(tmp / "tiny-llama"))
        engine = "enginecore.engines.transformers:TransformersEngine"
        with _serving(model, tmp, "--engine", engine) as served:
            client = served.client()
            ask = {"model": "tiny-llama", "prompt": "hello world", "max_tokens": 8}
            first = client.completions.create(**ask, temperature=0)
            again = client.completions.create(**ask, temperature=0)
            assert first.choices[0].text == again.choices[0].text  # greedy: the same tokens
            assert first.usage is not None
            assert 1 <= first.usage.completion_tokens <= 8
            assert first.choices[0].finish_reason in ("length", "stop")
            chunks = client.completions.create(**ask, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in chunks) == first.choices[0].text
            chat = client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                temperature=0,
            )
            assert chat.usage is not None
            assert chat.usage.completion_tokens <= 4
            # A temperature so small that logits / temperature would overflow (NaN in the
            # softmax, a fatal error in the stage): under 1e-5 the server samples greedily.
            for tiny in (1e-45, 1e-6):
                greedy = client.completions.create(**ask, temperature=tiny)
                assert greedy.choices[0].text == first.choices[0].text
            assert served.get("/health").json() == {"status": "ok"}
            # Everything finished: the engine holds no KV memory.
            stats = served.wait_idle()
            assert stats["live"] == 0
            assert stats["engine"]["kv_usage"] == 0

    @pytest.mark.timeout(120)
    def test_a_default_max_tokens_is_cut_to_the_kv_budget(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        # A chat's default max_tokens (256) over the engine's KV budget was the engine's
        # refusal, a 400 naming a max_tokens the client never sent: the default is cut to
        # what the budget leaves, as to what the context leaves.
        from enginecore.engines.transformers import make_random_model

        tmp = tmp_path_factory.mktemp("budget")
        model = Path(make_random_model(tmp / "tiny-llama"))  # a context of 512 tokens
        engine = "enginecore.engines.transformers:TransformersEngine"
        kwargs = '{"kv_budget_tokens": 40}'
        with _serving(model, tmp, "--engine", engine, "--engine-kwargs", kwargs) as served:
            client = served.client()
            messages: Any = [{"role": "user", "content": "hi"}]  # 24 tokens, 16 left
            chat = client.chat.completions.create(
                model="tiny-llama", messages=messages, temperature=0
            )
            assert chat.usage is not None
            assert chat.usage.prompt_tokens == 24
            assert 1 <= chat.usage.completion_tokens <= 16
            # Sent, max_tokens is the client's: over the budget, the engine refuses it (a
            # stream too: the refusal comes before any header).
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError, match="budget of 40") as info:
                    client.chat.completions.create(
                        model="tiny-llama", messages=messages, max_tokens=17, stream=stream
                    )
                assert _body(info.value)["code"] == "request_rejected"
            assert served.wait_idle()["engine"]["kv_usage"] == 0

    @pytest.mark.timeout(120)
    def test_the_engines_own_eos_ids_are_counted_not_shown(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        # The engine stops at every EOS id of the checkpoint (generation config, model
        # config, tokenizer), the stop token included in its output; the server dropped the
        # tokenizer's EOS from the text only, so a generation config's other EOS id showed
        # as text (unless the tokenizer skips it as special). It takes the engine's EOS ids
        # (model_info) too: every stop token is counted, not shown, as vLLM does.
        from transformers import AutoTokenizer, GenerationConfig

        from enginecore.engines.transformers import TransformersEngine, make_random_model

        tmp = tmp_path_factory.mktemp("eos")
        model = Path(make_random_model(tmp / "tiny-llama"))
        engine = TransformersEngine(str(model))
        engine.add("r", {"prompt": "hello world", "max_tokens": 2})
        first, second = [out[1]["token_ids"][0] for _ in range(2) for out in engine.step()]
        tok: Any = AutoTokenizer.from_pretrained(str(model))
        shown, stop = tok.decode([first]), tok.decode([second])
        assert shown  # text of their own
        assert stop
        assert "\ufffd" not in shown + stop
        config: Any = GenerationConfig  # untyped
        config(eos_token_id=[2, second]).save_pretrained(str(model))
        engine_name = "enginecore.engines.transformers:TransformersEngine"
        with _serving(model, tmp, "--engine", engine_name) as served:
            client = served.client()
            ask = {"model": "tiny-llama", "prompt": "hello world", "max_tokens": 8}
            done = client.completions.create(**ask, temperature=0)
            assert done.choices[0].finish_reason == "stop"
            assert done.choices[0].text == shown
            assert done.usage is not None
            assert done.usage.completion_tokens == 2
            chunks = client.completions.create(**ask, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in chunks) == shown
