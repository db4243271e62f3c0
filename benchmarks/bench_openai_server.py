"""``examples/openai_server.py`` against ``transformers serve --continuous-batching``.

Both servers serve the same local folder (a random-weight Llama written by
``make_random_model``, tokenizer included; about 20 M parameters, a tiny one with
``--quick``), float32 on the CPU, and both stay up for the whole run. The client is the
official ``openai`` package (``AsyncOpenAI``): each round opens 32 concurrent streaming
``/v1/completions`` (4 with ``--quick``) against one server, greedy, text prompts of 16-256
bytes (one token a byte) and ``max_tokens`` 16-128, drawn from a fixed seed (the same every
round). Rounds alternate the servers (A B B A ...).

Before the clock, each server gets one request alone and then a whole round that is thrown
away: ``transformers serve`` builds its continuous-batching manager (and its paged KV
cache) on its first request, and that request must be greedy, because the manager keeps the
first request's sampling settings for all.

Per round and server: output tokens (``usage.completion_tokens`` of each stream's last
chunk) over the wall time from the first request sent to the last stream ended, and the
median time to first token (request sent to the first chunk that carries a choice, i.e.
text). Goals (issue 21): tokens/s >= 1.5x ``transformers serve``, time to first token p50
<= 1.0x, every round.

Both servers run with the same torch thread count, ``OMP_NUM_THREADS`` = the CPUs less one
(1 on a 2-CPU machine): each server's HTTP process, the client and the model's threads share
the machine, and with a thread per CPU the model's threads spin in OpenMP barriers while the
others wait for a core. On this 2-CPU machine, ``examples/openai_server.py`` with torch's
default two threads measured 60-94 tok/s a round, and one request alone 20-60 tok/s; with
one, 180 tok/s and 70-150 tok/s.

``transformers serve`` sizes its paged KV cache from a fraction of the memory by default (on
this CPU several GiB, allocated during the first request, ~30 s); here it gets
``--cb-num-blocks`` for twice what the round's requests can hold at once, so that it fits
beside the other server. Without ``transformers[serving]`` installed the benchmark is
skipped, saying so; if ``transformers serve`` does not start, it is skipped with its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._harness import Record, Skipped, higher_is_better, interleave, lower_is_better, main_single

NAME = "openai_server"
ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "examples" / "openai_server.py"
PAGE = 256  # transformers' default page size (tokens per KV block)
START_TIMEOUT = 180.0
THREADS = max(1, (os.cpu_count() or 2) - 1)  # torch threads of each server (see above)

#: ``transformers serve`` from this interpreter (the console script may not be on PATH).
TRANSFORMERS_CLI = [
    sys.executable,
    "-c",
    "import sys; from transformers.cli.transformers import main; "
    "sys.argv[0] = 'transformers'; sys.exit(main())",
]


def workload(quick: bool) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) for each stream of a round."""
    rng = random.Random(21)
    n, plen, olen = (4, (8, 32), (4, 16)) if quick else (32, (16, 256), (16, 128))
    words = ["the", "a", "model", "stage", "token", "engine", "loop", "batch", "cache", "step"]
    out = []
    for _ in range(n):
        size = rng.randint(*plen)
        text = ""
        while len(text) < size:
            text += rng.choice(words) + " "
        out.append((text[:size], rng.randint(*olen)))
    return out


@dataclass
class RoundResult:
    tokens_per_s: float
    ttft_p50: float  # seconds
    ttfts: list[float]
    tokens: int


async def _one(client: Any, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One stream: (time to its first text chunk, its completion tokens)."""
    t0 = time.perf_counter()
    first = math.nan
    tokens = -1
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and math.isnan(first):
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if tokens < 0 or math.isnan(first):
        raise RuntimeError(f"a stream ended without text or usage (first={first}, usage={tokens})")
    return first, tokens


async def _round(url: str, model: str, work: list[tuple[str, int]]) -> RoundResult:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_one(client, model, p, n) for p, n in work))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    ttfts = [f for f, _ in got]
    tokens = sum(t for _, t in got)
    return RoundResult(tokens / wall, statistics.median(ttfts), ttfts, tokens)


def run_round(url: str, model: str, work: list[tuple[str, int]]) -> RoundResult:
    return asyncio.run(_round(url, model, work))


# -- the two servers ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """A server process, its log, and its base URL."""

    def __init__(self, name: str, argv: list[str], port: int, health: str, log: Path) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.health = health
        self.log = log
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(THREADS),
        }
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self) -> str | None:
        """``None`` once ``GET health`` answers 200; else why it never will (exited, or
        still not up after ``START_TIMEOUT`` s)."""
        import httpx

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.health, timeout=5).status_code == 200:
                    return None
            time.sleep(0.2)
        return (
            f"{self.name} did not answer {self.health} within {START_TIMEOUT:g} s:\n{self.tail()}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _check_dependencies() -> None:
    missing = [
        m
        for m in ("torch", "transformers", "openai", "httpx", "starlette", "uvicorn", "zmq")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise Skipped(f"needs {', '.join(missing)} (pip install -e '.[dev]')")
    # transformers serve imports these only when serving: transformers[serving].
    serving = [m for m in ("fastapi", "accelerate") if importlib.util.find_spec(m) is None]
    if serving:
        raise Skipped(
            f"transformers serve needs {', '.join(serving)}: "
            "pip install 'transformers[serving]' (the dev extra has it)"
        )


def run(quick: bool) -> list[Record]:
    _check_dependencies()
    from enginecore.engines.transformers import make_random_model

    work = workload(quick)
    rounds = 2 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            path = make_random_model(tmp + "/model", hidden_size=64, layers=2, vocab=512)
        else:  # about 20 M parameters, as bench_transformers
            path = make_random_model(
                tmp + "/model", hidden_size=384, layers=8, heads=6, kv_heads=2, vocab=8192,
                intermediate_size=1024, max_positions=512,
            )  # fmt: skip
        longest = max(len(p) for p, _ in work) + max(n for _, n in work)
        blocks = 2 * len(work) * math.ceil(longest / PAGE)
        ours_port, theirs_port = _free_port(), _free_port()
        servers: list[Server] = []  # each stopped at the end, however the run ends
        try:
            ours = Server(
                "examples/openai_server.py",
                [sys.executable, str(SERVER), "--model", path, "--served-model-name", path,
                 "--port", str(ours_port), "--log-level", "warning"],
                ours_port, "/health", Path(tmp) / "ours.log",
            )  # fmt: skip
            servers.append(ours)
            theirs = Server(
                "transformers serve",
                [*TRANSFORMERS_CLI, "serve", "--continuous-batching", path, "--host",
                 "127.0.0.1", "--port", str(theirs_port), "--cb-num-blocks", str(blocks),
                 "--log-level", "warning"],
                theirs_port, "/health", Path(tmp) / "theirs.log",
            )  # fmt: skip
            servers.append(theirs)
            why = ours.wait_ready()
            if why:
                raise RuntimeError(why)
            why = theirs.wait_ready()
            if why:
                raise Skipped(f"transformers serve cannot run here: {why}")
            t_warm = {}
            for server in (ours, theirs):  # the first request alone, greedy
                t = time.perf_counter()
                run_round(server.url, path, work[:1])
                t_warm[server.name] = time.perf_counter() - t
            sides: dict[str, Callable[[], RoundResult]] = {
                "ours": lambda: run_round(ours.url, path, work),
                "theirs": lambda: run_round(theirs.url, path, work),
            }
            res = interleave(sides, rounds, warmup=1)
        finally:
            for server in servers:
                server.stop()
        params = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 4
    out_tokens = [r.tokens for r in res["ours"]] + [r.tokens for r in res["theirs"]]
    note = (
        f"{params / 1e6:.1f} M params, float32 CPU, {THREADS} torch thread(s) each, "
        f"{len(work)} concurrent streams, greedy, "
        f"{min(out_tokens)}-{max(out_tokens)} output tokens a round; {rounds} rounds after a "
        f"warm-up round; first request alone: ours {t_warm[ours.name]:.2f} s, transformers "
        f"serve {t_warm[theirs.name]:.2f} s"
    )
    ours_ttft = [x for r in res["ours"] for x in r.ttfts]
    theirs_ttft = [x for r in res["theirs"] for x in r.ttfts]
    return [
        higher_is_better(
            "openai server vs transformers serve, tokens/s",
            [r.tokens_per_s for r in res["ours"]],
            [r.tokens_per_s for r in res["theirs"]],
            "tok/s", 1.5, note,
        ),
        lower_is_better(
            "openai server vs transformers serve, time to first token p50",
            [r.ttft_p50 * 1e3 for r in res["ours"]],
            [r.ttft_p50 * 1e3 for r in res["theirs"]],
            "ms", 1.0,
            pooled=(statistics.median(ours_ttft) * 1e3, statistics.median(theirs_ttft) * 1e3),
            note=note,
        ),
    ]  # fmt: skip


if __name__ == "__main__":
    main_single(run, __doc__)
