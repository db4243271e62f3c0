"""TransformersEngine: batch-invariant greedy and seeded decoding against ``model.generate``
alone, request checks, KV accounting, text prompts, stop tokens, and a launched stage.

The model is a tiny random-weight Llama written once per session with ``save_pretrained``
(``make_random_model``) and loaded back with ``from_pretrained``: no hub.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from enginecore import Abort, Add, EngineCoreLoop, Event, RequestRejected  # noqa: E402
from enginecore.engines.transformers import (  # noqa: E402
    TransformersEngine,
    make_random_model,
)

pytestmark = pytest.mark.timeout(120)
VOCAB = 300
FACTORY = "enginecore.engines.transformers:TransformersEngine"


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_random_model(
        tmp_path_factory.mktemp("tiny-llama"), hidden_size=64, layers=2, vocab=VOCAB, seed=0
    )


@pytest.fixture(scope="session")
def engine(model_path: str) -> TransformersEngine:
    """One engine for the tests that leave it empty (every request finished or aborted)."""
    return TransformersEngine(model_path, max_batch=8)


@pytest.fixture(scope="session")
def reference(model_path: str) -> Callable[[tuple[int, ...], int], list[int]]:
    """``model.generate(do_sample=False)`` of one prompt alone: the tokens to match."""
    model: Any = AutoModelForCausalLM.from_pretrained(model_path)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in cache:
            ids = torch.tensor([list(prompt)])
            with torch.inference_mode():
                out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens)
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return generate


def drain(engine: TransformersEngine) -> dict[str, list[int]]:
    """Step *engine* until it has no work; each request's tokens."""
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for rid, payload, _ in engine.step():
            got.setdefault(rid, []).extend(payload["token_ids"])
    return got


# -- the loop, driven in process with a schedule of arrivals and aborts --------------------------


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int
    arrive: int  # the step before which it is added
    abort_at: int | None  # the step before which it is aborted, if any
    temperature: float = 0.0
    seed: int | None = None

    def data(self) -> dict[str, Any]:
        d: dict[str, Any] = {"prompt": list(self.prompt), "max_tokens": self.max_tokens}
        if self.temperature:
            d.update(temperature=self.temperature, seed=self.seed, top_p=0.9)
        return d


class Scripted:
    """*engine* in a loop, with Adds and Aborts submitted at given steps (as an IO thread
    would), and a shutdown when everything is done."""

    def __init__(self, engine: TransformersEngine, reqs: Sequence[Req]) -> None:
        self.engine = engine
        self.reqs = reqs
        self.steps = 0
        self.loop: EngineCoreLoop | None = None
        self.has_work_calls = 0

    def pending(self) -> bool:
        return any(r.arrive >= self.steps or (r.abort_at or -1) >= self.steps for r in self.reqs)

    def has_work(self) -> bool:
        return self.engine.has_work() or self.pending()

    def add(self, req_id: str, data: Any) -> None:
        self.engine.add(req_id, data)

    def abort(self, req_ids: Sequence[str]) -> None:
        self.engine.abort(req_ids)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        return self.engine.utility(name, args)

    def step(self) -> list[Any]:
        out = self.engine.step()
        self.steps += 1
        assert self.loop is not None
        for i, r in enumerate(self.reqs):  # applied before the next step
            if r.arrive == self.steps:
                self.loop.submit(Add(str(i), r.data()))
            if r.abort_at == self.steps:
                self.loop.submit(Abort([str(i)]))
        if not self.has_work():
            self.loop.request_shutdown()
        return out


def run_loop(engine: TransformersEngine, reqs: Sequence[Req]) -> dict[str, list[int]]:
    events: list[Event] = []
    scripted = Scripted(engine, reqs)
    loop = EngineCoreLoop(scripted, events.append)
    scripted.loop = loop
    loop.submit_many([Add(str(i), r.data()) for i, r in enumerate(reqs) if r.arrive == 0])
    loop.submit_many([Abort([str(i)]) for i, r in enumerate(reqs) if r.abort_at == 0])
    if not scripted.has_work():
        loop.request_shutdown()
    loop.run()
    assert events[-1] == ("shutdown",), events[-1]
    got: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    finished: set[str] = set()
    for ev in events[:-1]:
        assert ev[0] == "output"
        rid, payload, fin = ev[1]
        assert rid not in finished
        got[rid].extend(payload["token_ids"])
        if fin:
            assert payload["finish_reason"] in ("length", "stop")
            finished.add(rid)
    return got


prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=48).map(tuple)


@st.composite
def schedules(draw: st.DrawFn, sampled: bool = False, mixed: bool = False) -> list[Req]:
    n = draw(st.integers(1, 6))
    reqs = []
    for _ in range(n):
        arrive = draw(st.integers(0, 8))
        delay = draw(st.none() | st.integers(0, 12))
        abort_at = None if delay is None else arrive + delay
        reqs.append(
            Req(
                draw(prompts),
                draw(st.integers(1, 12)),
                arrive,
                abort_at,
                temperature=(
                    draw(st.sampled_from([0.0, 0.7] if mixed else [0.7, 1.3])) if sampled else 0.0
                ),
                seed=draw(st.integers(0, 2**32)) if sampled else None,
            )
        )
    return reqs


def check_against(
    got: dict[str, list[int]], reqs: Sequence[Req], alone: Callable[[Req], list[int]]
) -> None:
    for i, r in enumerate(reqs):
        want = alone(r)
        if r.abort_at is None:
            assert got[str(i)] == want, (i, r)
        else:  # aborted: what it got is where it would have gone
            assert got[str(i)] == want[: len(got[str(i)])], (i, r)


class TestBatchInvariance:
    @settings(
        max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(reqs=schedules())
    def test_greedy_equals_generate_alone_whatever_the_batch(
        self,
        engine: TransformersEngine,
        reference: Callable[[tuple[int, ...], int], list[int]],
        reqs: list[Req],
    ) -> None:
        got = run_loop(engine, reqs)
        check_against(got, reqs, lambda r: reference(r.prompt, r.max_tokens))
        assert engine.stats()["kv_usage"] == 0

    def test_a_full_batch_of_staggered_requests(
        self, engine: TransformersEngine, reference: Callable[[tuple[int, ...], int], list[int]]
    ) -> None:
        reqs = [
            Req(tuple(range(3 + i, 3 + i + 5 * i + 1)), 10 + i % 3, arrive=i % 4, abort_at=None)
            for i in range(12)
        ]
        got = run_loop(engine, reqs)
        check_against(got, reqs, lambda r: reference(r.prompt, r.max_tokens))

    @settings(
        max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(reqs=schedules(sampled=True))
    def test_seeded_sampling_is_the_same_whatever_the_batch(
        self, engine: TransformersEngine, reqs: list[Req]
    ) -> None:
        def alone(r: Req) -> list[int]:
            engine.add("alone", r.data())
            return drain(engine)["alone"]

        got = run_loop(engine, reqs)
        check_against(got, reqs, alone)

    def test_the_decode_runs_at_the_engines_thread_count(
        self,
        model_path: str,
        reference: Callable[[tuple[int, ...], int], list[int]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """No part of a decode step moves to another thread count: SDPA's rounding can
        depend on it (an AMD EPYC rounded a small row on one thread differently from the
        same row on two), and ``generate`` runs at the process's count."""
        calls: list[int] = []
        monkeypatch.setattr(torch, "set_num_threads", calls.append)
        eng = TransformersEngine(model_path)
        reqs = [Req(tuple(range(4 + i, 9 + 6 * i)), 7, arrive=i % 2, abort_at=None)
                for i in range(4)]  # fmt: skip
        got = run_loop(eng, reqs)
        assert calls == []
        check_against(got, reqs, lambda r: reference(r.prompt, r.max_tokens))

    def test_without_batch_invariance_the_logits_do_change(
        self, model_path: str, reference: Callable[[tuple[int, ...], int], list[int]]
    ) -> None:
        """The control: one batched GEMM per layer rounds differently from a batch of one
        (tokens may still agree on this tiny model; the logits do not)."""
        logits: dict[bool, list[Any]] = {}
        for invariant in (True, False):
            eng = TransformersEngine(model_path, batch_invariant=invariant)
            # Every row's logits computed alone (the certified head would take greedy tokens
            # from batched logits, and never show them: TestCertifiedHead covers it).
            eng._head = None
            seen: list[Any] = []
            sample = eng._sample

            def spy(req: Any, row: Any, sample: Any = sample, seen: list[Any] = seen) -> int:
                if req.rid == "a":
                    seen.append(row.clone())
                return int(sample(req, row))

            eng._sample = spy  # type: ignore[method-assign,assignment]
            for rid, n in (("a", 7), ("b", 20), ("c", 33)):
                eng.add(rid, {"prompt": list(range(3, 3 + n)), "max_tokens": 6})
            drain(eng)
            logits[invariant] = seen
        same = [torch.equal(x, y) for x, y in zip(logits[True], logits[False], strict=True)]
        assert same[0]  # the prefill is the same batch of one on both
        assert not all(same[1:])


def tied_head_model(src: str, dst: Path, ulps: int) -> str:
    """*src* with its output head's rows in pairs: row ``2j + 1`` is row ``2j`` moved by
    *ulps* units in the last place (0: an exact copy). Every logit then has a twin within
    rounding of it, so no greedy row can be certified and each goes through the exact head."""
    model: Any = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        w = model.lm_head.weight
        twin = w[0::2].clone()
        for _ in range(ulps):
            twin = torch.nextafter(twin, torch.full_like(twin, float("inf")))
        w[1::2] = twin[: w[1::2].shape[0]]
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return str(dst)


def generate_alone(path: str) -> Callable[[tuple[int, ...], int], list[int]]:
    model: Any = AutoModelForCausalLM.from_pretrained(path)

    def generate(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([list(prompt)]), do_sample=False,
                                 max_new_tokens=max_tokens)  # fmt: skip
        return list(out[0, len(prompt) :].tolist())

    return generate


#: Small configs of other architectures than Llama's, for ``tiny_model_of``.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Conv1D layers (a transposed linear layer of transformers' own), not nn.Linear.
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    # nn.Linear, but fc1/fc2 take the hidden states flattened to 2-D ([tokens, hidden]).
    "opt": {
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "word_embed_proj_dim": 64,
    },
    # Attention of their own, not through AttentionInterface.
    "gpt_neo": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "max_position_embeddings": 128,
        "attention_types": [[["global"], 2]],
    },
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
    # Soft-capped attention logits: transformers gives it no SDPA attention.
    "gemma2": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
    },
}


def tiny_model_of(path: Path, model_type: str) -> str:
    """A random-weight model of *model_type* (a key of ARCHITECTURES), saved to *path*."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        **ARCHITECTURES[model_type],
    )  # fmt: skip
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM  # from_config is untyped
    auto.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_other_linear_layers_are_row_by_row_too(tmp_path: Path, model_type: str) -> None:
    """GPT-2's Conv1D layers and OPT's flattened 2-D inputs to its linear layers ran as one
    batched GEMM in the decode step: a row's logits then depended on the batch (in the last
    bits, from four rows up), and a near-tie could flip a token. Each row's are now those of
    the same request alone, and its tokens those of ``generate``. (On an Intel Xeon it also
    caught the per-row ``bmm`` of their 300-wide heads, which ``eng._head = None`` runs
    through the per-row linear layer: see the test above.)"""
    path = tiny_model_of(tmp_path / model_type, model_type)

    def logits_of_a(prompts: dict[str, int]) -> list[Any]:
        eng = TransformersEngine(path)
        eng._head = None  # every row's logits computed (greedy rows' are not, batched)
        seen: list[Any] = []
        sample = eng._sample

        def spy(req: Any, row: Any) -> int:
            if req.rid == "a":
                seen.append(row.clone())
            return int(sample(req, row))

        eng._sample = spy  # type: ignore[method-assign,assignment]
        for rid, n in prompts.items():
            eng.add(rid, {"prompt": list(range(3, 3 + n)), "max_tokens": 6})
        drain(eng)
        return seen

    alone = logits_of_a({"a": 7})
    batched = logits_of_a({"a": 7, "b": 20, "c": 33, "d": 12, "e": 25})
    assert len(alone) == len(batched) == 6
    assert all(torch.equal(x, y) for x, y in zip(alone, batched, strict=True))
    eng = TransformersEngine(path)
    reqs = [Req(tuple(range(3 + i, 9 + 4 * i)), 10, arrive=i % 3, abort_at=None)
            for i in range(6)]  # fmt: skip
    want = generate_alone(path)
    check_against(run_loop(eng, reqs), reqs, lambda r: want(r.prompt, r.max_tokens))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_decode_steps_linear_rows_are_each_row_alone_at_any_thread_count(threads: int) -> None:
    """Each row of a per-row linear layer in a decode step has the bits of the same layer on
    that row alone (a batch of one, as ``generate`` runs it), at whatever thread count. The
    rows were one ``bmm`` by the broadcast weight: MKL computes each as on one thread, while
    one row alone at two or more threads has its output columns split among the threads,
    and on an Intel Xeon (AVX-512) the last columns of a block rounded otherwise where its
    width was not a multiple of 8 (300 wide at two threads, 130 at two, 4,096 at three)."""
    from transformers.pytorch_utils import Conv1D

    from enginecore.engines.transformers import _DECODE_ROWS, _Decode, _RowConv1D, _RowLinear

    before = torch.get_num_threads()
    torch.manual_seed(0)
    try:
        torch.set_num_threads(threads)
        for k, n in [(64, 130), (64, 300), (64, 4096), (48, 1001)]:
            layers: list[tuple[Any, Any]] = []
            for bias in (False, True):
                lin = torch.nn.Linear(k, n, bias=bias)
                alone = torch.nn.Linear(k, n, bias=bias)
                alone.load_state_dict(lin.state_dict())
                lin.__class__ = _RowLinear
                layers.append((lin, alone))
            conv = Conv1D(n, k)  # type: ignore[no-untyped-call]
            torch.nn.init.normal_(conv.bias)
            conv_alone = Conv1D(n, k)  # type: ignore[no-untyped-call]
            conv_alone.load_state_dict(conv.state_dict())
            conv.__class__ = _RowConv1D
            layers.append((conv, conv_alone))
            for rows in (2, 5, 9):
                x = torch.randn(rows, 1, k)
                for layer, alone in layers:
                    want = torch.cat([alone(x[i : i + 1]) for i in range(rows)])
                    _DECODE_ROWS.append(_Decode(rows=[None] * rows))  # type: ignore[list-item]
                    try:
                        with torch.inference_mode():
                            got = layer(x)
                            flat = layer(x.view(rows, k))  # as OPT's feed-forward takes it
                    finally:
                        _DECODE_ROWS.pop()
                    assert torch.equal(got, want), (type(layer).__name__, k, n, rows)
                    assert torch.equal(flat, want.view(rows, n)), (type(layer).__name__, k, n)
    finally:
        torch.set_num_threads(before)


class TestCertifiedHead:
    """The output head of a batch-invariant decode: one batched GEMM, a greedy token taken
    from it only where the error bound proves it is the exact logits' argmax, the row
    computed alone otherwise."""

    def test_the_batched_head_is_used_and_its_tokens_are_exact(
        self, model_path: str, reference: Callable[[tuple[int, ...], int], list[int]]
    ) -> None:
        eng = TransformersEngine(model_path)
        reqs = [Req(tuple(range(3 + i, 9 + 4 * i)), 12, arrive=i % 3, abort_at=None)
                for i in range(6)]  # fmt: skip
        got = run_loop(eng, reqs)
        check_against(got, reqs, lambda r: reference(r.prompt, r.max_tokens))
        assert eng._head is not None
        assert eng._head_certified > 0  # the batched logits gave tokens

    @pytest.mark.parametrize("ulps", [0, 1, 3])
    def test_near_ties_fall_back_to_the_exact_row(self, model_path: str, tmp_path: Path,
                                                  ulps: int) -> None:  # fmt: skip
        path = tied_head_model(model_path, tmp_path / "tied", ulps)
        alone = generate_alone(path)
        eng = TransformersEngine(path)
        reqs = [Req(tuple(range(5 + 2 * i, 12 + 5 * i)), 8, arrive=i % 2, abort_at=None)
                for i in range(5)]  # fmt: skip
        got = run_loop(eng, reqs)
        check_against(got, reqs, lambda r: alone(r.prompt, r.max_tokens))
        assert eng._head_certified == 0
        assert eng._head_exact > 0

    @settings(
        max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(reqs=schedules(sampled=True, mixed=True))
    def test_greedy_and_seeded_rows_in_one_batch(
        self,
        engine: TransformersEngine,
        reference: Callable[[tuple[int, ...], int], list[int]],
        reqs: list[Req],
    ) -> None:
        def alone(r: Req) -> list[int]:
            if r.temperature == 0:
                return reference(r.prompt, r.max_tokens)
            engine.add("alone", r.data())
            return drain(engine)["alone"]

        got = run_loop(engine, reqs)
        check_against(got, reqs, alone)
        assert engine.stats()["kv_usage"] == 0

    def test_a_model_that_changes_the_heads_output_turns_the_batched_head_off(
        self, model_path: str, reference: Callable[[tuple[int, ...], int], list[int]]
    ) -> None:
        """A model that scales or caps the head's output after it (here: a copy, equal):
        the bound does not cover that, so the step is run again with the exact head, and
        the engine keeps the exact head."""
        eng = TransformersEngine(model_path)
        forward = eng.model.forward

        def copying(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            out.logits = out.logits.clone()
            return out

        eng.model.forward = copying
        reqs = [Req(tuple(range(3 + i, 8 + 3 * i)), 6, arrive=0, abort_at=None)
                for i in range(3)]  # fmt: skip
        got = run_loop(eng, reqs)
        check_against(got, reqs, lambda r: reference(r.prompt, r.max_tokens))
        assert eng._head is None
        assert eng._head_certified == 0

    def test_batch_invariance_off_has_no_batched_head(self, model_path: str) -> None:
        assert TransformersEngine(model_path, batch_invariant=False)._head is None


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(2, 40),
    k=st.sampled_from([7, 64, 100, 384, 1000]),
    n=st.sampled_from([3, 50, 300, 2000]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_head_bound_covers_batched_against_alone(
    rows: int, k: int, n: int, scale: float, seed: int
) -> None:
    """The premise of the certified head, checked on this machine's BLAS: every logit of a
    batched GEMM is within the engine's bound of the same logit computed alone."""
    from enginecore.engines.transformers import _U32

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, k, generator=g) * scale
    w = torch.randn(n, k, generator=g) / k**0.5
    batched = torch.nn.functional.linear(x, w)
    alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(rows)])
    gamma = (k + 1) * _U32 / (1 - (k + 1) * _U32)
    bound = x.norm(dim=-1) * w.norm(dim=-1) * 4 * gamma + 1e-30
    assert bool(((batched - alone).abs() <= bound).all())


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 5),
    vocab=st.integers(2, 12),
)
def test_a_certified_argmax_survives_any_error_within_the_bound(
    data: st.DataObject, rows: int, vocab: int
) -> None:
    from enginecore.engines.transformers import _certified_argmax

    vals = st.floats(-4, 4, width=32) | st.sampled_from([float("nan"), float("inf")])
    logits = torch.tensor(data.draw(st.lists(st.lists(vals, min_size=vocab, max_size=vocab),
                                             min_size=rows, max_size=rows)))  # fmt: skip
    bound = torch.tensor(data.draw(st.lists(
        st.lists(st.floats(0, 1, width=32), min_size=vocab, max_size=vocab),
        min_size=rows, max_size=rows)))  # fmt: skip
    top, ok = _certified_argmax(logits, bound)
    for r in range(rows):
        if not ok[r]:
            continue
        assert bool(torch.isfinite(logits[r]).all())
        t = int(top[r])
        worst = logits[r] + bound[r]  # every other entry as high as it may be,
        worst[t] = logits[r, t] - bound[r, t]  # the top as low
        assert int(worst.argmax()) == t
        assert bool((worst[t] > worst[torch.arange(vocab) != t]).all())


# -- requests: checks, KV, stats -------------------------------------------------------------------


BAD: list[tuple[Any, str]] = [
    ("not a dict", "a dict"),
    ({"max_tokens": 3}, "no 'prompt'"),
    ({"prompt": [5], "nope": 1}, "unknown request parameter"),
    ({"prompt": []}, "empty"),
    ({"prompt": [5, VOCAB]}, "out of the vocabulary"),
    ({"prompt": [5, -1]}, "out of the vocabulary"),
    ({"prompt": [5, 1.5]}, "ints"),
    ({"prompt": 7}, "list of token ids or a str"),
    ({"prompt": [5], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5], "max_tokens": -3}, "max_tokens"),
    ({"prompt": [5], "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": [5], "max_tokens": True}, "max_tokens"),
    ({"prompt": [5] * 500, "max_tokens": 20}, "positions"),
    # Too long is said first, before the ids are walked one by one (a million of them).
    ({"prompt": [VOCAB] * 500, "max_tokens": 20}, "positions"),
    ({"prompt": [5], "temperature": -0.1}, "temperature"),
    ({"prompt": [5], "temperature": float("nan")}, "temperature"),
    # So small that logits / temperature overflows float32: NaN probabilities, and a fatal
    # error in step() had it been accepted.
    ({"prompt": [5], "temperature": 1e-45}, "temperature"),
    ({"prompt": [5], "temperature": 5e-6}, "temperature"),
    ({"prompt": [5], "top_p": 0}, "top_p"),
    ({"prompt": [5], "top_p": 1.5}, "top_p"),
    ({"prompt": [5], "seed": "x"}, "seed"),
    # Out of a C integer's range: a rejection, not an OverflowError or ValueError from float()
    # or torch (an exception other than RequestRejected from add would be fatal in a stage).
    ({"prompt": [5], "temperature": 10**400}, "temperature"),
    ({"prompt": [5], "top_p": -(10**400)}, "top_p"),
    ({"prompt": [5], "seed": 2**64, "temperature": 1.0}, "seed"),
    ({"prompt": [5], "seed": -(2**63) - 1}, "seed"),
    ({"prompt": [5], "stop_token_ids": 0}, "stop_token_ids"),
    # Too many digits for repr() (ValueError): the message still names the parameter.
    ({"prompt": [5], "max_tokens": 10**5000}, "max_tokens"),
    ({"prompt": [5, 10**5000]}, "out of the vocabulary"),
    ({"prompt": [5], "temperature": 10**5000}, "temperature"),
    ({"prompt": [5], "stop_token_ids": [VOCAB]}, "out of the vocabulary"),
    ({"prompt": [5], "stop_token_ids": 3}, "stop_token_ids"),
    # Text the tokenizer cannot take (a lone surrogate: JSON's "\ud800" decodes to one): a
    # rejection, not the tokenizer's TypeError (any other exception from add is fatal in a
    # stage).
    ({"prompt": "a\ud800b"}, "the tokenizer refused the prompt"),
]


class TestRequests:
    @pytest.mark.parametrize(("data", "match"), BAD)
    def test_bad_input_is_rejected_and_the_engine_goes_on(
        self, engine: TransformersEngine, data: Any, match: str, reference: Any
    ) -> None:
        with pytest.raises(RequestRejected, match=match):
            engine.add("bad", data)
        assert not engine.has_work()
        engine.add("bad", {"prompt": [5, 6], "max_tokens": 3})  # the id is free, all goes on
        assert drain(engine) == {"bad": reference((5, 6), 3)}

    def test_a_duplicate_live_id_is_rejected(self, engine: TransformersEngine) -> None:
        engine.add("dup", {"prompt": [5], "max_tokens": 3})
        with pytest.raises(RequestRejected, match="already live"):
            engine.add("dup", {"prompt": [6], "max_tokens": 3})
        assert len(drain(engine)["dup"]) == 3

    def test_text_without_a_tokenizer_is_rejected(self, model_path: str, tmp_path: Path) -> None:
        import shutil

        bare = tmp_path / "bare"
        bare.mkdir()
        for f in Path(model_path).iterdir():
            if f.name in ("config.json", "generation_config.json", "model.safetensors"):
                shutil.copy(f, bare / f.name)
        eng = TransformersEngine(str(bare))
        with pytest.raises(RequestRejected, match="needs a tokenizer"):
            eng.add("t", {"prompt": "hello"})

    def test_text_prompts_use_the_checkpoints_tokenizer(
        self, engine: TransformersEngine, model_path: str, reference: Any
    ) -> None:
        tok = AutoTokenizer.from_pretrained(model_path)
        ids = tuple(tok("hello world")["input_ids"])
        assert ids
        assert tok.decode(list(ids)) == "hello world"
        engine.add("t", {"prompt": "hello world", "max_tokens": 5})
        assert drain(engine) == {"t": reference(ids, 5)}
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert chat == "<|user|>hi\n"

    def test_stop_token_ids_and_eos_stop_with_their_token(
        self, engine: TransformersEngine, reference: Any
    ) -> None:
        want = reference((7, 8, 9), 8)
        stop = want[3]
        engine.add("s", {"prompt": [7, 8, 9], "max_tokens": 8, "stop_token_ids": [stop]})
        outs = []
        while engine.has_work():
            outs.extend(engine.step())
        tokens = [t for _, p, _ in outs for t in p["token_ids"]]
        assert tokens == want[: want.index(stop) + 1]
        assert outs[-1][1]["finish_reason"] == "stop"
        assert outs[-1][2] is True
        assert engine.eos_token_ids == {2}  # the checkpoint's EOS also stops a request

    def test_eos_counts_as_stop(self, engine: TransformersEngine, reference: Any) -> None:
        want = reference((7, 8, 9), 8)
        engine.eos_token_ids = frozenset({want[2]})
        try:
            engine.add("e", {"prompt": [7, 8, 9], "max_tokens": 8})
            outs = []
            while engine.has_work():
                outs.extend(engine.step())
        finally:
            engine.eos_token_ids = frozenset({2})
        assert [p["token_ids"][0] for _, p, _ in outs] == want[:3]
        assert outs[-1][1]["finish_reason"] == "stop"

    def test_length_is_the_finish_reason_at_max_tokens(self, engine: TransformersEngine) -> None:
        engine.add("l", {"prompt": [4], "max_tokens": 1})
        (out,) = engine.step()
        assert out[1]["finish_reason"] == "length"
        assert out[2] is True
        assert TransformersEngine.route_output(out) == ("l", True, out[1])
        assert TransformersEngine.route_outputs([out]) == (["l"], [True], [out[1]])

    def test_abort_frees_the_kv_before_the_next_step(self, engine: TransformersEngine) -> None:
        engine.add("a", {"prompt": [5] * 10, "max_tokens": 20})
        engine.add("b", {"prompt": [6] * 4, "max_tokens": 20})
        engine.step()
        stats = engine.stats()
        assert stats["running"] == 2
        assert stats["kv_tokens_reserved"] == 54
        assert stats["kv_tokens_used"] == 14
        req = engine._running["a"]
        engine.abort(["a", "unknown"])
        assert req.keys == []  # the KV tensors are dropped
        assert req.values == []
        assert engine.stats()["kv_tokens_reserved"] == 24
        engine.abort(["b"])
        assert engine.stats()["kv_usage"] == 0
        assert not engine.has_work()

    def test_a_waiting_request_can_be_aborted(self, model_path: str) -> None:
        eng = TransformersEngine(model_path, kv_budget_tokens=30)
        eng.add("a", {"prompt": [5] * 10, "max_tokens": 10})
        eng.add("b", {"prompt": [5] * 10, "max_tokens": 10})
        eng.step()
        assert (eng.stats()["running"], eng.stats()["waiting"]) == (1, 1)
        eng.abort(["b"])
        assert eng.stats()["waiting"] == 0
        assert set(drain(eng)) == {"a"}

    def test_the_kv_budget_makes_requests_wait_in_order(
        self, model_path: str, reference: Any
    ) -> None:
        eng = TransformersEngine(model_path, kv_budget_tokens=40)
        for rid in "abc":
            eng.add(rid, {"prompt": [ord(rid)] * 10, "max_tokens": 8})  # 18 tokens each
        with pytest.raises(RequestRejected, match="budget of 40"):
            eng.add("huge", {"prompt": [5] * 35, "max_tokens": 6})
        order: list[str] = []
        peak = 0.0
        while eng.has_work():
            for rid, _, _ in eng.step():
                if rid not in order:
                    order.append(rid)
            stats = eng.stats()
            peak = max(peak, stats["kv_usage"])
            assert stats["kv_tokens_reserved"] <= 40
            if len(order) == 2 and stats["running"]:
                assert stats["waiting"] == 1  # c waits for a KV budget that a or b frees
        assert order == ["a", "b", "c"]
        assert peak == 36 / 40
        assert eng.stats()["kv_usage"] == 0

    def test_max_batch_bounds_the_running_requests(self, model_path: str) -> None:
        eng = TransformersEngine(model_path, max_batch=2)
        for i in range(5):
            eng.add(str(i), {"prompt": [5, 6], "max_tokens": 4})
        eng.step()
        assert (eng.stats()["running"], eng.stats()["waiting"]) == (2, 3)
        assert len(drain(eng)) == 5

    def test_stats_fields(self, engine: TransformersEngine) -> None:
        before = engine.stats()
        assert {"running", "waiting", "kv_usage", "kv_tokens_reserved", "kv_tokens_used"} <= set(
            before
        )
        engine.add("s", {"prompt": [5, 6, 7], "max_tokens": 3})
        drain(engine)
        after = engine.stats()
        assert after["prefill_tokens"] - before["prefill_tokens"] == 3
        assert after["decode_tokens"] - before["decode_tokens"] == 2
        assert after["steps"] - before["steps"] == 3
        assert engine.utility("stats", ()) == engine.stats()
        info = engine.utility("model_info", ())
        assert info["vocab_size"] == VOCAB
        assert info["has_tokenizer"] is True
        with pytest.raises(ValueError, match="no utility"):
            engine.utility("nope", ())

    def test_a_missing_model_path_is_named(self, tmp_path: Path) -> None:
        missing = tmp_path / "no-such-model"
        with pytest.raises(FileNotFoundError, match="no-such-model"):
            TransformersEngine(str(missing))

    def test_a_sliding_window_model_is_served_within_its_window(self, tmp_path: Path) -> None:
        # The engine keeps every position's K/V and attends over all of them; a sliding
        # window's cache keeps the last window - 1 only. Past the window such a model decoded
        # other tokens than generate, and a prompt longer than the window raised a
        # RuntimeError in step() (fatal in a stage). Within it the two are the same
        # attention: the engine serves the model with its positions cut to the window, and
        # its tokens equal generate's there, in one batch.
        from transformers import MistralConfig, MistralForCausalLM

        window = 16
        config = MistralConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=window,
        )
        torch.manual_seed(0)
        path = tmp_path / "sliding"
        MistralForCausalLM(config).save_pretrained(path)
        engine = TransformersEngine(str(path), max_batch=8)
        assert engine.max_positions == window
        assert engine.utility("model_info", ())["max_positions"] == window
        with pytest.raises(RequestRejected, match="16 positions"):
            engine.add("long", {"prompt": [5] * 10, "max_tokens": window - 9})
        requests = {f"r{n}": (tuple(range(7, 7 + n)), window - n) for n in (1, 4, 9, 15)}
        for rid, (prompt, max_tokens) in requests.items():
            engine.add(rid, {"prompt": list(prompt), "max_tokens": max_tokens})
        got = drain(engine)
        alone = generate_alone(str(path))
        assert got == {rid: alone(*request) for rid, request in requests.items()}

    @pytest.mark.parametrize("model_type", ["gpt_neo", "bloom"])
    def test_a_model_whose_attention_bypasses_the_attention_interface_is_refused(
        self, tmp_path: Path, model_type: str
    ) -> None:
        # The decode step attends through the function it registers with AttentionInterface,
        # over each row's own K/V. A model with attention of its own (GPT-Neo, XGLM, MPT:
        # "does not support setting its attention implementation dynamically") attended over
        # the step's new token only, and was served wrong tokens, silently; Bloom's raised
        # a ValueError in the first decode step (fatal in a stage). Refused when built.
        path = tiny_model_of(tmp_path / model_type, model_type)
        with pytest.raises(ValueError, match="AttentionInterface"):
            TransformersEngine(path)

    @pytest.mark.parametrize("feature", ["position_bias", "softcap", "s_aux", "sinks"])
    def test_attention_the_decode_step_would_not_apply_is_refused(
        self, model_path: str, feature: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A model that passes its attention function a position bias, a soft cap or sinks
        # (through AttentionInterface, with SDPA) had them ignored by the decode step's
        # attention: wrong tokens, silently. Refused when the engine is built.
        from transformers.models.llama import modeling_llama

        attention = modeling_llama.LlamaAttention.forward

        def passing(self: Any, *args: Any, **kwargs: Any) -> Any:
            return attention(self, *args, **kwargs, **{feature: torch.zeros(1)})

        monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", passing)
        with pytest.raises(ValueError, match=f"AttentionInterface.*{feature}"):
            TransformersEngine(model_path)

    def test_gemma_2_is_refused_for_want_of_sdpa(self, tmp_path: Path) -> None:
        # docs/engines.md: transformers has no SDPA attention for Gemma 2 (the engine's
        # prefill runs the model's own SDPA path), and says so in a ValueError.
        path = tiny_model_of(tmp_path / "gemma2", "gemma2")
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            TransformersEngine(path)

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"max_batch": 0}, "max_batch"),
            ({"max_batch": 2.5}, "max_batch"),
            ({"max_batch": True}, "max_batch"),
            ({"max_prefill_tokens": -1}, "max_prefill_tokens"),
            ({"kv_budget_tokens": 0}, "kv_budget_tokens"),  # not the default budget
            ({"kv_budget_tokens": "100"}, "kv_budget_tokens"),
            ({"dtype": "bogus"}, "dtype"),
            ({"dtype": "Tensor"}, "dtype"),  # an attribute of torch, not a dtype
            ({"device": "nope"}, "device"),  # not a device name: torch's RuntimeError before
            ({"device": "cuda:99"}, "device"),  # no such device: torch's AssertionError before
        ],
    )
    def test_bad_constructor_arguments_are_named(
        self, model_path: str, kwargs: dict[str, Any], match: str
    ) -> None:
        # Checked before the model is loaded; a ValueError naming the argument (in a stage:
        # StageStartupError with that message), not a TypeError or AttributeError from inside.
        with pytest.raises(ValueError, match=match):
            TransformersEngine(model_path, **kwargs)


# -- a launched stage ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftovers")
class TestStage:
    def test_streams_tokens_equal_to_generate_alone(self, model_path: str, reference: Any) -> None:
        from enginecore.stage import RequestError, StageClient

        reqs = {f"r{i}": (tuple(range(3 + i, 10 + 3 * i)), 6 + i) for i in range(4)}
        with StageClient.launch(FACTORY, {"model": model_path}) as client:
            streams = {
                rid: client.add(rid, {"prompt": list(p), "max_tokens": n})
                for rid, (p, n) in reqs.items()
            }
            bad = client.add("bad", {"prompt": [1], "max_tokens": -1})
            text = client.add("text", {"prompt": "hi", "max_tokens": 2})
            for rid, stream in streams.items():
                payloads = list(stream)
                assert [t for p in payloads for t in p["token_ids"]] == reference(*reqs[rid])
                assert payloads[-1]["finish_reason"] in ("length", "stop")
            with pytest.raises(RequestError, match="max_tokens"):
                list(bad)
            assert len(list(text)) == 2
            stats = client.call_utility("stats")
            assert stats["kv_usage"] == 0

    def test_a_missing_model_path_is_a_startup_error_naming_it(self, tmp_path: Path) -> None:
        from enginecore.stage import StageClient, StageStartupError

        missing = str(tmp_path / "no-such-model")
        with pytest.raises(StageStartupError, match="no-such-model"):
            StageClient.launch(FACTORY, {"model": missing})


class TestRandomModel:
    def test_a_path_that_is_a_file_is_refused(self, tmp_path: Path) -> None:
        # save_pretrained only logs "should be a directory" and writes nothing: the path
        # came back as if a model were there.
        file = tmp_path / "a-file"
        file.write_text("not a model")
        with pytest.raises(NotADirectoryError, match="a-file"):
            make_random_model(file)
        assert file.read_text() == "not a model"

    def test_kv_heads_must_divide_heads(self, tmp_path: Path) -> None:
        # Written, such a model loaded and failed at its first forward pass (a RuntimeError
        # in step(): fatal in a stage).
        with pytest.raises(ValueError, match="kv_heads"):
            make_random_model(tmp_path / "m", heads=4, kv_heads=3)
        assert not (tmp_path / "m").exists()
