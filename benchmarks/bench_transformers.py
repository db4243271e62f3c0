"""TransformersEngine on a random-weight Llama: output tokens/s against its baselines.

The workload of issue 21: N requests (64; 8 with ``--quick``), prompt lengths 16-256 and
output lengths 16-128 (smaller with ``--quick``) drawn from a fixed seed, arriving as a
Poisson process within the first 2 s (0.2 s quick), greedy. A random-weight Llama of about
20 M parameters (``make_random_model``; a tiny one quick), float32 on the CPU. Each side
below runs in its own fresh interpreter, started once (all at once, before any clock) and
kept for the run, each warmed up with a few short requests of its own; the sides run the
whole workload once per round, one after the other, the order reversed every other round
(``_harness.interleave``), while the others wait idle (their processes use no CPU then).
``ROUNDS`` rounds (2 with ``--quick``; no warm-up round: each side warmed itself up);
every goal is judged on its lowest per-round ratio:

- the engine in an in-process ``EngineCoreLoop`` (adds submitted at their arrival times from
  another thread), output tokens / wall time from the first arrival to the last token;
- the same engine on a stage (``StageClient.launch``), the same way;
- ``model.generate`` one request at a time (arrivals ignored: a lower bound of its time);
- transformers' own continuous batching, in process: the ``ContinuousBatchingManager`` that
  ``model.generate_batch`` drives, set up as ``generate_batch`` sets it up (its context
  manager, workload hints, warm-up), with one warm request before the clock as on the stage.
  ``generate_batch`` itself takes one ``max_new_tokens`` for every prompt and all prompts at
  once, so the same workload (per-request output lengths, Poisson arrivals) goes through its
  manager's ``add_request``, and its results are read with ``get_result`` as
  ``generate_batch`` reads them;
- the bound: the bare model's own prefill rate (prompt tokens/s, batch of one, the workload's
  mean prompt length) and batched decode rate (tokens/s of one forward pass at batch
  ``min(N, max_batch)``, the workload's mean context), each the best of 5 blocks, measured
  here: total output tokens / (prompt tokens / prefill rate + output tokens / decode rate).

Also measured, without a goal (the trade of batch invariance): the same stage with
``batch_invariant=False``, and the engine's decode step alone, ``batch_invariant=True`` and
``False`` in one process (two engines, each with the same ``min(N, max_batch)`` requests
running at the bound's mean context), timed in alternating blocks of steps; both are in the
note of the "stage vs bound" line.

Each side uses torch's default thread count (one per CPU) unless ``OMP_NUM_THREADS`` is set,
which every side then inherits; the note says which.

Why fresh interpreters: whatever one side leaves behind in a process that ran torch (its
thread pool, its allocator) taxed the next; in one process the stage side after the others
measured 0.66x of the loop, each in its own process 0.93-1.23x. A side's process is
reused only by that side.

Goals (issue 21): engine on a stage >= 0.7x the bound; engine on a stage >= 2x
``generate_batch``; engine in process >= 3x generate one at a time; the stage >= 0.95x in
process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ._harness import Record, Skipped, higher_is_better, interleave, main_single

NAME = "transformers"
MAX_BATCH = 32  # TransformersEngine's default max_batch
ROUNDS = 3  # full run; --quick: 2 after a warm-up round
WARM = (0.0, [5, 6], 2)  # the stage's first request, at its launch


def warm_work(work: list[tuple[float, list[int], int]]) -> list[tuple[float, list[int], int]]:
    """Each side's own warm-up before its first round: 4 short requests of the workload at
    once (batched prefill and decode; one 2-token request left a side's first round up to
    10x slower than its next ones)."""
    return [(0.0, prompt[:16], 4) for _, prompt, _ in work[:4]]


PREFIX = "@side: "  # the lines a side answers with, told apart from anything else it prints


def workload(quick: bool) -> list[tuple[float, list[int], int]]:
    rng = random.Random(21)
    n, window = (8, 0.2) if quick else (64, 2.0)
    plen, olen = ((8, 32), (4, 16)) if quick else ((16, 256), (16, 128))
    t, out = 0.0, []
    rate = n / window
    for _ in range(n):
        t = min(t + rng.expovariate(rate), window)
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(*plen))]
        out.append((t, prompt, rng.randint(*olen)))
    return out


def run_loop(engine: Any, work: list[tuple[float, list[int], int]], tag: str) -> float:
    """One pass of *work* through a new ``EngineCoreLoop`` on *engine* (request ids
    prefixed with *tag*)."""
    from enginecore import Add, EngineCoreLoop

    left = len(work)
    tokens = 0
    end = [0.0]

    def emit(ev: Any) -> None:
        nonlocal left, tokens
        if ev[0] == "output":
            tokens += len(ev[1][1]["token_ids"])
            if ev[1][2]:
                left -= 1
                if not left:
                    end[0] = time.perf_counter()
                    loop.request_shutdown()

    loop = EngineCoreLoop(engine, emit)

    def feed(t0: float) -> None:
        for i, (at, prompt, n) in enumerate(work):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            loop.submit(Add(f"{tag}{i}", {"prompt": prompt, "max_tokens": n}))

    t0 = time.perf_counter()
    feeder = threading.Thread(target=feed, args=(t0,))
    feeder.start()
    loop.run()
    feeder.join()
    return tokens / (end[0] - t0)


def launch_stage(path: str, batch_invariant: bool = True) -> Any:
    """A launched stage of the engine, warmed up with one short request."""
    from enginecore.stage import StageClient

    client = StageClient.launch(
        "enginecore.engines.transformers:TransformersEngine",
        {"model": path, "batch_invariant": batch_invariant},
    )
    try:
        client.add("warm", {"prompt": WARM[1], "max_tokens": WARM[2]}).collect()
    except BaseException:
        client.close()
        raise
    return client


def run_stage(client: Any, work: list[tuple[float, list[int], int]], tag: str) -> float:
    """One pass of *work* through the launched stage *client* (ids prefixed with *tag*)."""
    streams = []
    t0 = time.perf_counter()
    for i, (at, prompt, n) in enumerate(work):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        streams.append(client.add(f"{tag}{i}", {"prompt": prompt, "max_tokens": n}))
    tokens = sum(len(p["token_ids"]) for s in streams for p in s)
    return tokens / (time.perf_counter() - t0)


def run_generate(model: Any, work: list[tuple[float, list[int], int]]) -> float:
    import torch

    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _, prompt, n in work:
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
            tokens += out.shape[1] - len(prompt)
    return tokens / (time.perf_counter() - t0)


def run_generate_batch(model: Any, work: list[tuple[float, list[int], int]]) -> float:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    eos = model.generation_config.eos_token_id
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, eos_token_id=eos, pad_token_id=eos, max_new_tokens=max(n for *_, n in work)
    )
    hints = WorkloadHints(max(len(p) for _, p, _ in work), config.max_new_tokens, len(work))
    with model.continuous_batching_context_manager(
        generation_config=config, workload_hints=hints, block=True, timeout=5
    ) as manager:

        def wait(n: int) -> int:
            """Tokens of the next *n* finished requests, read as ``generate_batch`` reads."""
            tokens = 0
            while n:
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("generate_batch's manager stalled or died")
                if result.is_finished():
                    n -= 1
                    tokens += len(result.generated_tokens)
            return tokens

        manager.add_request([5, 6], request_id="warm", max_new_tokens=2)
        wait(1)
        t0 = time.perf_counter()

        def feed() -> None:
            for i, (at, prompt, n) in enumerate(work):
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                manager.add_request(prompt, request_id=str(i), max_new_tokens=n)

        feeder = threading.Thread(target=feed)
        feeder.start()
        tokens = wait(len(work))
        rate = tokens / (time.perf_counter() - t0)
        feeder.join()
    return rate


def decode_rates(
    path: str, work: list[tuple[float, list[int], int]], batch: int, rounds: int, steps: int
) -> tuple[list[float], list[float]]:
    """Decode tokens/s of the engine's step with ``batch_invariant=True`` and ``False``:
    per round, *steps* steps of each engine, *batch* requests decoding in each."""
    from enginecore.engines.transformers import TransformersEngine

    prompt_tokens = sum(len(p) for _, p, _ in work)
    ctx = prompt_tokens // len(work) + sum(n for *_, n in work) // len(work) // 2
    total = (rounds + 1) * steps
    plen = max(1, ctx - total // 2)  # the mean context over the timed steps: the bound's
    engines = {}
    for invariant in (True, False):
        engine = TransformersEngine(path, batch_invariant=invariant, max_batch=batch)
        for i in range(batch):
            prompt = [3 + (7 * i + j) % 400 for j in range(plen)]
            engine.add(str(i), {"prompt": prompt, "max_tokens": total + batch + 2})
        while engine.stats()["running"] < batch or engine.stats()["waiting"]:
            engine.step()
        engines[invariant] = engine

    def block(engine: TransformersEngine) -> Callable[[], float]:
        def timed() -> float:
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            return batch * steps / (time.perf_counter() - t)

        return timed

    got = interleave({"true": block(engines[True]), "false": block(engines[False])}, rounds)
    return got["true"], got["false"]


def bound(model: Any, work: list[tuple[float, list[int], int]], batch: int) -> float:
    import torch
    from transformers import DynamicCache

    prompt_tokens = sum(len(p) for _, p, _ in work)
    out_tokens = sum(n for _, _, n in work)
    mean_p = prompt_tokens // len(work)
    ctx = mean_p + out_tokens // len(work) // 2
    # Each rate is the best of 5 blocks: a bound is what the model can do, and on a shared
    # machine one block can land on a stall (a single block of 4 steps once read 1/4 of the
    # others). The best block makes the goal harder, never easier.
    prefill = decode = 0.0
    with torch.inference_mode():
        ids = torch.randint(3, 500, (1, mean_p))
        model(input_ids=ids)
        for _ in range(5):
            t = time.perf_counter()
            model(input_ids=ids)
            prefill = max(prefill, mean_p / (time.perf_counter() - t))
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(3, 500, (batch, ctx)), cache=cache, use_cache=True)
        step = torch.randint(3, 500, (batch, 1))
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(4):
                model(input_ids=step, cache=cache, use_cache=True)
            decode = max(decode, 4 * batch / (time.perf_counter() - t))
    return out_tokens / (prompt_tokens / prefill + out_tokens / decode)


def run(quick: bool) -> list[Record]:
    try:
        import transformers  # noqa: F401

        from enginecore.engines.transformers import make_random_model
    except ImportError as exc:
        raise Skipped(
            f"needs torch and transformers (pip install -e '.[transformers]'): {exc}"
        ) from None
    work = workload(quick)
    rounds = 2 if quick else ROUNDS
    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            path = make_random_model(tmp, hidden_size=64, layers=2, vocab=512)
        else:  # about 20 M parameters
            path = make_random_model(
                tmp, hidden_size=384, layers=8, heads=6, kv_heads=2, vocab=8192,
                intermediate_size=1024, max_positions=512,
            )  # fmt: skip
        with _Sides(path, quick) as sides:

            def side(name: str) -> Callable[[], float]:
                return lambda: sides.round(name)[0]

            # The sides of each goal's pair run close together in every round (the order is
            # reversed every other round); stage_fast only feeds the note.
            order = ("generate", "loop", "stage", "generate_batch", "bound", "stage_fast")
            res = interleave({name: side(name) for name in order}, rounds, warmup=0)
            rates = sides.round("decode")
            params = sides.params
    threads = os.environ.get("OMP_NUM_THREADS") or f"torch's default ({os.cpu_count()})"
    note = (
        f"{params / 1e6:.1f} M params, float32 CPU, {threads} torch thread(s), "
        f"{len(work)} requests, {sum(n for *_, n in work)} output tokens; "
        f"batch_invariant=True; {rounds} rounds alternated, each side in its own interpreter"
    )
    stage, limit, fast = res["stage"], res["bound"], res["stage_fast"]
    inv, not_inv = rates[0::2], rates[1::2]
    per_round = [f / t for t, f in zip(inv, not_inv, strict=True)]
    fast_bound = [f / b for f, b in zip(fast, limit, strict=True)]
    fast_stage = [f / s for f, s in zip(fast, stage, strict=True)]
    trade = (
        f"; batch_invariant=False: stage {statistics.median(fast):.0f} tok/s "
        f"({statistics.median(fast_bound):.2f}x the bound, "
        f"{statistics.median(fast_stage):.2f}x the invariant stage, medians of the rounds); "
        f"decode step at batch {min(len(work), MAX_BATCH)}: {statistics.median(inv):.0f} tok/s "
        f"invariant, {statistics.median(not_inv):.0f} not ({statistics.median(per_round):.2f}x, "
        f"rounds {min(per_round):.2f}..{max(per_round):.2f})"
    )
    return [
        higher_is_better("transformers: stage vs bound", stage, limit, "tok/s", 0.7, note + trade),
        higher_is_better(
            "transformers: stage vs generate_batch",
            stage,
            res["generate_batch"],
            "tok/s",
            2.0,
            note,
        ),
        higher_is_better(
            "transformers: loop vs generate alone",
            res["loop"],
            res["generate"],
            "tok/s",
            3.0,
            note,
        ),
        higher_is_better("transformers: stage vs loop", stage, res["loop"], "tok/s", 0.95, note),
    ]


class _Sides:
    """One fresh interpreter per side (``--side NAME MODEL``), all started at once and kept
    for the run: :meth:`round` has one run the workload once and returns its figures.
    ``close()`` (also on leaving a ``with`` block) ends them all."""

    def __init__(self, path: str, quick: bool) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self._errs: dict[str, IO[str]] = {}
        self._rounds = 0
        self.params = 0
        root = Path(__file__).resolve().parent.parent
        try:
            for side in SIDES:
                argv = [sys.executable, "-m", "benchmarks.bench_transformers", "--side", side, path]
                self._errs[side] = err = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115
                self.procs[side] = subprocess.Popen(
                    [*argv, *(["--quick"] if quick else [])],
                    cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                    text=True,
                )  # fmt: skip
            for side in SIDES:  # each loads its model and warms up, in parallel
                ready, params = self._read(side).split()
                assert ready == "ready", ready
                self.params = int(params)
        except BaseException:
            self.close()
            raise

    def round(self, side: str) -> list[float]:
        """Run the workload once on *side*; its tokens/s figures."""
        proc = self.procs[side]
        assert proc.stdin is not None
        self._rounds += 1
        try:
            proc.stdin.write(f"round r{self._rounds}-\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _read says how
        return [float(x) for x in self._read(side).split()]

    def _read(self, side: str) -> str:
        """The next line *side* answers with (``PREFIX`` stripped; any other line it prints,
        a library's chatter, is skipped); a side that died fails the run with its exit
        status and the end of its stderr."""
        proc = self.procs[side]
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            if not line:
                code = proc.wait()
                err = self._errs[side]
                err.seek(0)
                raise RuntimeError(f"the {side} side failed ({code}):\n{err.read()[-3000:]}")
            if line.startswith(PREFIX):
                return line.removeprefix(PREFIX).strip()

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()  # end of input: the side returns
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for err in self._errs.values():
            err.close()

    def __enter__(self) -> _Sides:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _side(side: str, path: str, quick: bool) -> None:
    """``--side NAME PATH [--quick]``: one side of the benchmark, served over stdin. Loads
    the model (and for the stage sides, launches the stage), warms up, prints ``ready
    PARAMS``; then for each line ``round TAG`` runs the workload once (request ids prefixed
    with TAG) and prints its tokens/s figures on one line (the decode side: invariant and
    not, alternating, one pair a round of its own); returns at the end of its input."""
    from transformers import AutoModelForCausalLM

    work = workload(quick)
    warm = warm_work(work)
    model = AutoModelForCausalLM.from_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    once: Callable[[str], list[float]]
    with contextlib.ExitStack() as stack:
        if side == "bound":
            bound(model, warm, 1)
            once = lambda tag: [bound(model, work, min(len(work), MAX_BATCH))]  # noqa: E731
        elif side == "generate":
            run_generate(model, warm)
            once = lambda tag: [run_generate(model, work)]  # noqa: E731
        elif side == "generate_batch":
            once = lambda tag: [run_generate_batch(model, work)]  # noqa: E731 - warms itself
        else:
            del model  # the engine loads its own
            if side == "loop":
                from enginecore.engines.transformers import TransformersEngine

                engine = TransformersEngine(path)
                run_loop(engine, warm, "warm")
                once = lambda tag: [run_loop(engine, work, tag)]  # noqa: E731
            elif side in ("stage", "stage_fast"):
                client = stack.enter_context(launch_stage(path, batch_invariant=side == "stage"))
                run_stage(client, warm, "warm")
                once = lambda tag: [run_stage(client, work, tag)]  # noqa: E731
            elif side == "decode":
                rounds, steps = (2, 4) if quick else (5, 8)

                def decode_once(tag: str) -> list[float]:
                    t, f = decode_rates(path, work, min(len(work), MAX_BATCH), rounds, steps)
                    return [x for pair in zip(t, f, strict=True) for x in pair]

                once = decode_once

            else:
                raise SystemExit(f"unknown side {side!r}")
        print(PREFIX + "ready", params, flush=True)
        for line in sys.stdin:
            _, tag = line.split()
            print(PREFIX + " ".join(map(str, once(tag))), flush=True)


SIDES = ("bound", "generate", "generate_batch", "loop", "stage", "stage_fast", "decode")


def _model_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder (a model written by run())")
    return text


def _side_main(argv: list[str]) -> None:
    """``--side NAME MODEL [--quick]``, the arguments checked before any model is loaded: a
    bad one is a usage error (exit 2), not a traceback."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_transformers --side",
        description="One side of the benchmark, in this interpreter (run() starts each side "
        "this way): loads the model, warms up and prints 'ready PARAMS'; then for each line "
        "'round TAG' on its input runs the workload once and prints its tokens/s figures.",
    )
    parser.add_argument("side", choices=SIDES)
    parser.add_argument("model", type=_model_dir)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    _side(args.side, args.model, args.quick)


if __name__ == "__main__":
    if "--side" in sys.argv:
        _side_main([a for a in sys.argv[1:] if a != "--side"])
    else:
        main_single(run, __doc__)
