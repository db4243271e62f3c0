"""examples/openai_server.py against what OpenAI's API and the ``openai`` client expect: the
request checks found wanting by a black-box audit (a real server process, real HTTP).

The server, its engine (``TokenEchoEngine``) and the word-level tokenizer are
tests/test_openai_server.py's; this module starts a server of its own.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests import test_openai_server as base

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[base.Served]:
    model: Path = base._write_tokenizer(tmp_path_factory.mktemp("models") / "tiny-words", chat=True)
    tmp = tmp_path_factory.mktemp("server")
    with base._serving(model, tmp, "--engine-kwargs", '{"vocab_size": 64}') as served:
        yield served


def _post(served: base.Served, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=10, **kwargs)


CHAT = {"model": "tiny-words", "messages": [{"role": "user", "content": "hello"}]}
TEXT = {"model": "tiny-words", "prompt": base.PROMPT}


class TestRequestChecks:
    def test_json_nested_past_the_parsers_depth_is_a_400_not_a_500(
        self, server: base.Served
    ) -> None:
        # json.loads raises RecursionError (not a ValueError) for arrays nested deeper than
        # the interpreter's recursion limit: it was a 500, "internal server error".
        deep = b"[" * 100_000 + b"]" * 100_000
        for raw in (deep, b'{"prompt": ' + deep + b"}"):
            reply = httpx.post(server.url + "/v1/completions", content=raw, timeout=10)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error", error
            assert "JSON" in error["message"], error
        # Just shallow enough to parse, a wrong value was a 500 all the same: the message
        # that shows it wrote it back as JSON, from a deeper stack than the parser's.
        for depth in range(900, 1001, 2):
            nested = b"[" * depth + b"]" * depth
            raw = b'{"prompt": "hello", "max_tokens": ' + nested + b"}"
            reply = httpx.post(server.url + "/v1/completions", content=raw, timeout=10)
            assert reply.status_code == 400, (depth, reply.text)
        assert server.get("/health").status_code == 200

    def test_more_stop_sequences_than_openais_four_are_refused(self, server: base.Served) -> None:
        # OpenAI's API takes up to 4. Each one is looked for in the text at every new token,
        # on the event loop: 300,000 of them (3.5 MB) held every other request, /health
        # included, for seconds at a time, and one request of 400 tokens took 90 s.
        client = server.client()
        four = ["zz", "yy", "xx", "ww"]
        done = client.completions.create(model="tiny-words", prompt=base.PROMPT, stop=four)
        assert done.choices[0].finish_reason == "length"
        for path, body in (("/v1/completions", TEXT), ("/v1/chat/completions", CHAT)):
            for stream in (False, True):
                ask = {**body, "stop": [*four, "vv"], "stream": stream, "max_tokens": 2}
                reply = _post(server, path, ask)
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["param"] == "stop", error
                assert "4" in error["message"], error
        assert server.wait_idle()["live"] == 0

    def test_a_chats_max_tokens_is_checked_beside_max_completion_tokens(
        self, server: base.Served
    ) -> None:
        # With max_completion_tokens set, max_tokens was not looked at: a wrong type or a
        # value out of range was accepted silently.
        for bad in ("x", 0, -1, 1.5, True):
            body = {**CHAT, "max_completion_tokens": 2, "max_tokens": bad}
            reply = _post(server, "/v1/chat/completions", body)
            assert reply.status_code == 400, (bad, reply.text)
            assert reply.json()["error"]["param"] == "max_tokens", reply.text
        # Both valid: max_completion_tokens, the newer name, is the one used (as vLLM does).
        body = {**CHAT, "max_completion_tokens": 2, "max_tokens": 5}
        reply = _post(server, "/v1/chat/completions", body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2

    def test_stream_options_is_an_object_of_openais_keys(self, server: base.Served) -> None:
        # A stream_options that is not an object but is falsy ([], 0, "", false) was taken as
        # no options, and a key OpenAI's API does not have was dropped silently.
        wrong: list[Any] = [[], 0, "", False, {"include_usage": True, "usage": True}]
        for options in wrong:
            body = {**TEXT, "max_tokens": 2, "stream": True, "stream_options": options}
            reply = _post(server, "/v1/completions", body)
            assert reply.status_code == 400, (options, reply.text)
            assert reply.json()["error"]["param"] == "stream_options", reply.text
        # OpenAI's include_obfuscation (random padding in each event) asks for nothing
        # about the tokens: accepted, as a boolean.
        client = server.client()
        chunks = list(
            client.completions.create(
                model="tiny-words",
                prompt=base.PROMPT,
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True, "include_obfuscation": False},
            )
        )
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 2
        body = {**TEXT, "stream": True, "stream_options": {"include_obfuscation": 1}}
        reply = _post(server, "/v1/completions", body)
        assert reply.status_code == 400, reply.text
        extra: Any = {"include_usage": True, "extra": True}  # not in the client's TypedDict
        with pytest.raises(openai.BadRequestError, match="stream_options"):
            client.chat.completions.create(
                model="tiny-words",
                messages=[{"role": "user", "content": "hello"}],
                stream=True,
                stream_options=extra,
            )

    def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(
        self, server: base.Served
    ) -> None:
        # Starlette raises ClientDisconnect from the body's stream: it went to the catch-all
        # handler, a 500 to no one, and uvicorn logged "Exception in ASGI application" with
        # its traceback, as for a bug.
        heads = [
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "hel',
            b"Transfer-Encoding: chunked\r\n\r\n" + b'5\r\n{"pro\r\n',
        ]
        for head in heads:
            with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head)
        # A whole request after them: the server has handled both disconnects by then.
        done = server.client().completions.create(model="tiny-words", prompt=base.PROMPT)
        assert done.choices[0].finish_reason == "length"
        assert "ClientDisconnect" not in server.output()
        assert "Exception in ASGI application" not in server.output()

    def test_every_chunk_of_a_stream_with_include_usage_has_a_usage(
        self, server: base.Served
    ) -> None:
        # With include_usage, OpenAI's API gives every chunk a "usage" (null but in the last):
        # a chat's first chunk, the assistant's role, had none.
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
            ask = {**body, "max_tokens": 2, "stream": True}
            ask["stream_options"] = {"include_usage": True}
            reply = _post(server, path, ask)
            assert reply.status_code == 200, reply.text
            events = [e[6:] for e in reply.text.split("\n\n") if e.startswith("data: {")]
            chunks = [json.loads(e) for e in events]
            assert len(chunks) >= 3, chunks
            assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
            assert chunks[-1]["usage"]["completion_tokens"] == 2


def _chat(served: base.Served, *messages: Any, max_tokens: int = 9) -> httpx.Response:
    body = {"model": "tiny-words", "max_tokens": max_tokens, "messages": list(messages)}
    return _post(served, "/v1/chat/completions", body)


class TestChatMessages:
    def test_a_role_openais_api_does_not_have_is_a_400(self, server: base.Served) -> None:
        # "wizard" went to the chat template, which rendered it; OpenAI's API answers a 400
        # naming the message's role. Its tool and function roles answer a tool call, which
        # this server does not make: refused too.
        for role in ("wizard", "", "USER", "tool", "function"):
            reply = _chat(
                server, {"role": "user", "content": "hello"}, {"role": role, "content": "hi"}
            )
            assert reply.status_code == 400, (role, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error", error
            assert error["param"] == "messages[1].role", error
            assert repr(role) in error["message"], error
        # OpenAI's others reach the template as they are.
        for role in ("system", "developer", "user", "assistant"):
            reply = _chat(server, {"role": role, "content": "hello"}, max_tokens=2)
            assert reply.status_code == 200, (role, reply.text)
        assert server.wait_idle()["live"] == 0

    def test_text_parts_are_joined_with_a_newline(self, server: base.Served) -> None:
        # Joined with "" ("hello" "world": "helloworld", one unknown word here); vLLM joins a
        # message's text parts with "\n".
        parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
        reply = _chat(server, {"role": "user", "content": parts}, max_tokens=6)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == " user : hello world assistant :"

    def test_a_part_that_is_not_text_is_a_400_naming_it(self, server: base.Served) -> None:
        image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
        text = {"type": "text", "text": "hello"}
        cases: list[tuple[Any, str, str]] = [
            ([text, image], "messages[0].content[1].type", "'image_url'"),
            ([{"type": "refusal", "refusal": "no"}], "messages[0].content[0].type", "'refusal'"),
            ([{"text": "hello"}], "messages[0].content[0].type", "type"),
            (["hello"], "messages[0].content[0]", "object"),
            ([{"type": "text", "text": 7}], "messages[0].content[0].text", "string"),
            ([], "messages[0].content", "empty"),
        ]
        for content, param, said in cases:
            reply = _chat(server, {"role": "user", "content": content})
            assert reply.status_code == 400, (content, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error", error
            assert error["param"] == param, error
            assert said in error["message"], error


class TestErrorBodies:
    def test_a_404_is_an_invalid_request_error_as_openais(self, server: base.Served) -> None:
        # OpenAI's API answers a model it does not have, and a path it does not serve, with a
        # 404 of type "invalid_request_error" (code "model_not_found" for the model); this
        # server's type was "not_found_error", a type OpenAI's API does not use.
        replies = [
            _post(server, "/v1/completions", {**TEXT, "model": "gpt-4"}),
            _post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-4"}),
            server.get("/v1/models/gpt-4"),
            server.get("/v1/nowhere"),
        ]
        for reply in replies:
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error", error
        assert [r.json()["error"]["code"] for r in replies[:3]] == ["model_not_found"] * 3


def _in_process(model: Path, tokenizer: Any) -> Any:
    """A Starlette TestClient over the server, with *tokenizer*, in this process (the
    lifespan runs: a real stage of TokenEchoEngine, without a vocab_size)."""
    from starlette.testclient import TestClient

    module = base._load_server_module()
    server = module.Server(model, tokenizer, base.ECHO, {}, "tiny-words")
    return TestClient(server.app(), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base._write_tokenizer(tmp_path_factory.mktemp("models") / "tiny-words", chat=True)


class TestTokenIds:
    @pytest.mark.timeout(60)
    def test_a_prompt_id_outside_the_vocabulary_is_a_400_naming_it(self, words: Path) -> None:
        # An engine that does not check its prompt's ids (TokenEchoEngine without a
        # vocab_size, as a custom engine may not) echoed 2**32 back, and decoding it with the
        # tokenizer raised OverflowError: a 500. The server checks them, as vLLM does,
        # against the larger of the tokenizer's vocabulary and the engine's (here: the
        # tokenizer's, 17 words; the engine says none).
        module = base._load_server_module()
        with _in_process(words, module.load_tokenizer(words)) as client:
            for bad in (2**32, len(base.WORDS), 2**64 - 1):
                for stream in (False, True):
                    body = {"prompt": [7, bad, 8], "max_tokens": 2, "stream": stream}
                    reply = client.post("/v1/completions", json=body)
                    assert reply.status_code == 400, (bad, reply.text)
                    error = reply.json()["error"]
                    assert error["type"] == "invalid_request_error", error
                    assert error["param"] == "prompt", error
                    assert str(bad) in error["message"], error
            last = len(base.WORDS) - 1
            reply = client.post("/v1/completions", json={"prompt": [7, last], "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens"] == 2


class TestTokenizerThreads:
    @pytest.mark.timeout(60)
    def test_a_long_text_does_not_hold_up_a_short_ones_tokenization(self, words: Path) -> None:
        # One tokenizer thread for every request: a chat of 7.9 MB held it 24 s, and every
        # other request, however short, waited for it before it could start. Here the long
        # text's tokenization is held (an event) until the short request has been answered.
        module = base._load_server_module()
        real = module.load_tokenizer(words)
        entered = threading.Event()
        release = threading.Event()
        long_text = 500_000  # characters; the server's "long" begins well below

        class Gated:
            chat_template = real.chat_template
            eos_token_id = real.eos_token_id

            def __call__(self, text: str, *args: Any, **kwargs: Any) -> Any:
                if len(text) >= long_text:
                    entered.set()
                    release.wait(30)
                return real(text, *args, **kwargs)

            def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
                return real.apply_chat_template(*args, **kwargs)

            def decode(self, *args: Any, **kwargs: Any) -> Any:
                return real.decode(*args, **kwargs)

            def __len__(self) -> int:
                return len(real)

        chat = {"messages": [{"role": "user", "content": "hello " * (long_text // 6 + 1)}]}
        short = {"prompt": base.PROMPT, "max_tokens": 2}
        with _in_process(words, Gated()) as client, ThreadPoolExecutor(2) as pool:
            try:
                held = pool.submit(client.post, "/v1/chat/completions", json=chat)
                assert entered.wait(20), "the long text never reached the tokenizer"
                answer = pool.submit(client.post, "/v1/completions", json=short)
                reply = answer.result(timeout=20)  # behind the long text: TimeoutError
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == " hello world"
                assert not held.done()
            finally:
                release.set()
            refused = held.result(timeout=30)  # 83,000 tokens: over the context of 2048
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "context_length_exceeded"
