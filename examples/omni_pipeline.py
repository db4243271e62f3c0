"""A three-stage "omni" pipeline: thinker -> talker -> vocoder, each its own process.

The shape of vllm-omni's Qwen-Omni serving, with toy engines: the **thinker** streams text
to the caller and a hidden-state array per token to the **talker**; the talker turns each
hidden state into audio codes for the **vocoder**, which turns each code frame into a chunk
of audio samples for the caller. Each stage takes its input as it arrives (``feed``), so
audio starts before the thinker has finished. Data goes stage to stage directly; the parent
only admits, aborts and hears when a request ended (``docs/pipelines.md``).

    pip install 'enginecore[zmq]' numpy     # the audio and hidden states are numpy arrays
    python examples/omni_pipeline.py
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from enginecore import RequestRejected
from enginecore.stage import NOTHING, Pipeline, PipelineRequestError, PipelineStage

HIDDEN = 64  # the thinker's hidden size
CODES = 4  # audio codes per frame
SAMPLES = 240  # audio samples per code frame (10 ms at 24 kHz)


class Thinker:
    """``add(rid, {"prompt": str, "tokens": n})``: one word per step, with its hidden state.
    Outputs are ``(rid, finished, {"text": word, "hidden": float32[HIDDEN]})``."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[list[str], int, int]] = {}  # words, next index, tokens

    def has_work(self) -> bool:
        return bool(self._live)

    def add(self, req_id: str, data: Any) -> None:
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
            raise RequestRejected('need {"prompt": str, "tokens": int}')
        words = data["prompt"].split() or ["..."]
        tokens = data.get("tokens", len(words))
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            # Refused alone; any other exception here would be fatal to the stage.
            raise RequestRejected(f"tokens must be an int >= 1, got {tokens!r}")
        self._live[req_id] = (words, 0, tokens)

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self._live.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        raise ValueError(f"no utility {name!r}")

    def step(self) -> list[tuple[str, bool, dict[str, Any]]]:
        time.sleep(0.002)  # the "model"
        out = []
        for rid, (words, i, n) in list(self._live.items()):
            hidden = np.arange(HIDDEN, dtype=np.float32) + i
            last = i + 1 == n
            out.append((rid, last, {"text": words[i % len(words)], "hidden": hidden}))
            if last:
                del self._live[rid]
            else:
                self._live[rid] = (words, i + 1, n)
        return out

    @staticmethod
    def route_output(out: tuple[str, bool, Any]) -> tuple[str, bool, Any]:
        return out


def thinker_edge(output: dict[str, Any]) -> tuple[Any, Any]:
    """The edge thinker -> talker, run in the thinker's process: the hidden state goes on,
    the text goes to the caller."""
    return output["hidden"], output["text"]


class _Streaming:
    """A stage that turns each input into one output as it arrives (``feed``), and ends a
    request once its input is complete (``close_input``) and everything has gone out."""

    def __init__(self) -> None:
        self._inputs: dict[str, list[Any]] = {}
        self._closed: set[str] = set()
        self._ready: dict[str, None] = {}

    def convert(self, item: Any) -> Any:
        raise NotImplementedError

    def has_work(self) -> bool:
        return bool(self._ready)

    def add(self, req_id: str, data: Any) -> None:
        self._inputs[req_id] = [data]
        self._ready[req_id] = None

    def feed(self, req_id: str, data: Any) -> None:
        self._inputs[req_id].append(data)
        self._ready[req_id] = None

    def close_input(self, req_id: str) -> None:
        self._closed.add(req_id)
        self._ready[req_id] = None

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self._inputs.pop(rid, None)
            self._closed.discard(rid)
            self._ready.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        raise ValueError(f"no utility {name!r}")

    def step(self) -> list[tuple[str, bool, Any]]:
        out: list[tuple[str, bool, Any]] = []
        for rid in self._ready:
            items, done = self._inputs[rid], rid in self._closed
            self._inputs[rid] = []
            out += [(rid, False, self.convert(item)) for item in items]
            if done:  # the last output ends it, or NOTHING if everything went out before
                if items:
                    out[-1] = (rid, True, out[-1][2])
                else:
                    out.append((rid, True, NOTHING))
                del self._inputs[rid]
                self._closed.discard(rid)
        self._ready = {}
        return out

    @staticmethod
    def route_output(out: tuple[str, bool, Any]) -> tuple[str, bool, Any]:
        return out


class Talker(_Streaming):
    """Hidden state -> ``int16[CODES]`` audio codes."""

    def convert(self, hidden: Any) -> Any:
        return (hidden.reshape(CODES, -1).mean(axis=1) % 1024).astype(np.int16)


class Vocoder(_Streaming):
    """Audio codes -> ``float32[SAMPLES]`` audio samples."""

    def convert(self, codes: Any) -> Any:
        t = np.arange(SAMPLES, dtype=np.float32) / 24_000
        return sum(np.sin(2 * np.pi * (100 + c) * t) for c in codes.astype(np.float32)) / CODES


def main() -> None:
    stages = [
        PipelineStage("omni_pipeline:Thinker", name="thinker", edge="omni_pipeline:thinker_edge"),
        PipelineStage("omni_pipeline:Talker", name="talker"),
        PipelineStage("omni_pipeline:Vocoder", name="vocoder"),
    ]
    with Pipeline.launch(stages, max_in_flight=16) as pipe:
        print("stages    ", " -> ".join(pipe.stages))

        started = time.monotonic()
        stream = pipe.add("q1", {"prompt": "the quick brown fox jumps over the lazy dog"})
        text: list[str] = []
        audio: list[np.ndarray[Any, Any]] = []
        first_audio: float | None = None
        for item in stream:
            if isinstance(item, str):
                text.append(item)
            else:
                first_audio = first_audio or time.monotonic() - started
                audio.append(item)
        print("text      ", " ".join(text))
        samples = sum(len(chunk) for chunk in audio)
        print(f"audio      {len(audio)} chunks, {samples} samples of {audio[0].dtype}")
        total = stream.timings.total or 0.0
        first_ms = float("nan") if first_audio is None else first_audio * 1000
        print(f"streaming  first audio after {first_ms:.0f} ms, all after {total * 1000:.0f} ms")

        # 40 requests under the admission budget: an add waits while 16 are in the pipeline.
        streams, most = [], 0
        for i in range(40):
            streams.append(pipe.add(f"b{i}", {"prompt": "hello world", "tokens": 8}))
            most = max(most, pipe.in_flight)
        outs = [s.collect(timeout=30) for s in streams]
        print(
            f"burst      {len(outs)} requests, {sum(map(len, outs))} outputs, at most {most} "
            f"in the pipeline at once"
        )

        # An abort reaches every stage that holds the request.
        long = pipe.add("long", {"prompt": "la", "tokens": 100_000})
        next(long)
        pipe.abort(["long"])
        long.collect(timeout=10)
        print(f"abort      long: aborted={long.aborted}")

        # A bad request ends alone, naming the stage that refused it.
        try:
            pipe.add("bad", {"tokens": 3}).collect(timeout=10)
        except PipelineRequestError as exc:
            print(f"error      bad: stage {exc.stage!r} refused it")
    print("closed     every stage stopped")


def cli(main: Callable[[], int | None]) -> int:
    """Run *main* as a command: ``--help`` prints this module's docstring, and Ctrl-C or
    SIGTERM stops it early, cleanly: the ``with`` blocks shut the stages down on the way out,
    then one line on stderr and status 130 or 143 (no traceback, nothing left behind)."""
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    terminated = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return main() or 0
    except KeyboardInterrupt:
        print("terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(cli(main))
