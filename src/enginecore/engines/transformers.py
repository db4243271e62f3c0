"""``TransformersEngine``: a continuous-batching engine for a local causal LM checkpoint.

Needs the ``transformers`` extra (``pip install 'enginecore[transformers]'``: torch and
transformers). ``docs/engines.md``, "A real model: TransformersEngine", is the guide; in short:

- ``add`` checks the request and queues it (FIFO); a bad request is a
  :class:`~enginecore.RequestRejected`, and nothing changes.
- ``step`` admits waiting requests while the KV budget and ``max_batch`` allow, prefills each
  one alone (its first token), then decodes every request that was already running in **one**
  batched forward pass (one token each).
- ``abort`` drops a request's KV tensors at once (its memory is freed before the next step).
- Batch invariance: with ``batch_invariant=True`` (the default) a request's tokens are bit for
  bit those of ``model.generate`` of its prompt alone, whatever else is in the batch. See the
  guide for how (per-row attention over exact lengths, and per-row products in the linear
  layers, because a batched GEMM on the CPU rounds differently from a batch of one; the
  output head alone is batched, a greedy token taken from it only where an error bound
  proves it is the exact logits' argmax, the row computed alone otherwise).

Requests are dicts::

    {"prompt": [token ids] or "text", "max_tokens": 16, "temperature": 0.0, "top_p": 1.0,
     "seed": None, "stop_token_ids": []}

(``temperature`` 0 is greedy; a positive one is at least ``MIN_TEMPERATURE``, 1e-5.)

and each output is ``(req_id, payload, finished)``, routed by :meth:`route_outputs`; the
payload is ``{"token_ids": [new ids]}``, plus ``"finish_reason": "length" | "stop"`` on the
last one.
"""

from __future__ import annotations

import math
import os
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    DynamicLayer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.generation.logits_process import TopPLogitsWarper
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
from transformers.modeling_utils import AttentionInterface
from transformers.pytorch_utils import Conv1D

from .._exceptions import RequestRejected

__all__ = ["TransformersEngine", "make_random_model"]

#: Keys a request dict may have.
REQUEST_KEYS = frozenset({"prompt", "max_tokens", "temperature", "top_p", "seed", "stop_token_ids"})
_ATTN_NAME = "enginecore_rows"
#: The least positive temperature: below it, logits / temperature can overflow float32 (the
#: softmax then gives NaN probabilities); 0 is greedy.
MIN_TEMPERATURE = 1e-5
#: The seeds ``torch.Generator.manual_seed`` takes.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

Output = tuple[str, dict[str, Any], bool]


@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: frozenset[int]
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [1, kv_heads, cap, d]
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0  # tokens in the KV tensors

    @property
    def reserve(self) -> int:
        """KV tokens reserved at admission: prompt + max_tokens (an upper bound)."""
        return len(self.prompt) + self.max_tokens


# -- the decode step's per-row attention and per-row linear layers -------------------------------
#
# One engine steps at a time per process in practice, but the state is per engine: the rows of
# the decode in progress are set on the model's attention function through this holder, only
# for the duration of one forward pass, on the loop's thread.


@dataclass(eq=False)
class _Decode:
    """The decode pass in progress: its rows, and whether the output head runs batched
    (:class:`_HeadLinear`), in which case it leaves its input and output here."""

    rows: list[_Request]
    batched_head: bool = False
    head_in: torch.Tensor | None = None
    head_out: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # the model's output logits
    attention_calls: int = 0  # layers whose attention went through _rows_attention


_DECODE_ROWS: list[_Decode] = []  # a stack; the top is the decode running now


#: What a model may pass to its attention function that the decode step's attention does not
#: apply (an additive position bias, soft-capped logits, attention sinks): such a model is
#: refused when the engine is built (its tokens would be wrong), not served.
_UNSUPPORTED_ATTENTION = ("position_bias", "softcap", "s_aux", "sinks")


def _rows_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a decode step, one row at a time over that row's exact length.

    *key*/*value* are the step's new K/V (already written into each row's tensors by
    :class:`_RowCache`); each row attends to its own ``[:length]`` with the SDPA call that
    ``generate`` makes for a batch of one (through ``sdpa_attention_forward``: no mask, not
    causal for one query, ``enable_gqa`` for grouped K/V heads), so no padded length enters
    any reduction. The call is made directly, and the rows' outputs are transposed
    together, rather than through ``sdpa_attention_forward`` once per row: the same kernel
    on the same arguments, less Python per row. Where ``sdpa_attention_forward`` would take
    another path (grouped heads it cannot pass to SDPA as such), it is called per row.
    """
    for feature in _UNSUPPORTED_ATTENTION:
        if kwargs.get(feature) is not None:  # found by the engine's first decode step
            raise ValueError(
                f"the model's attention passes {feature!r}, which the decode step's "
                "attention (plain SDPA over each row's K/V) would not apply"
            )
    decode = _DECODE_ROWS[-1]
    decode.attention_calls += 1
    rows = decode.rows
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1 and not use_gqa_in_sdpa(None, key, value):
        outs = []
        for i, req in enumerate(rows):
            n = req.length + 1
            out, _ = sdpa_attention_forward(
                module,
                query[i : i + 1],
                req.keys[layer][:, :, :n],
                req.values[layer][:, :, :n],
                None,
                dropout=dropout,
                scaling=scaling,
            )
            outs.append(out)
        return torch.cat(outs), None
    sdpa = F.scaled_dot_product_attention
    gqa = groups > 1
    # At the engine's thread count, as generate runs it: SDPA's rounding can depend on the
    # thread count (on an AMD EPYC a small row on one thread differs from the same row on
    # two, where an Intel Xeon gave the same bits), so a row is never moved to one thread.
    outs = [
        sdpa(
            q,
            req.keys[layer].narrow(2, 0, req.length + 1),
            req.values[layer].narrow(2, 0, req.length + 1),
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        for q, req in zip(torch.split(query, 1), rows, strict=True)
    ]
    return torch.cat(outs).transpose(1, 2).contiguous(), None


AttentionInterface.register(_ATTN_NAME, _rows_attention)


class _RowCache:
    """The ``cache`` a decode step passes to the model: writes each row's new K/V at that
    row's own position in its own tensors (no padding, no copy of the past)."""

    def __init__(self, rows: list[_Request]) -> None:
        self.rows = rows

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows
        # One multi-tensor copy for the layer: each row's K and V at its own position.
        torch._foreach_copy_(
            [r.keys[layer_idx].narrow(2, r.length, 1) for r in rows]
            + [r.values[layer_idx].narrow(2, r.length, 1) for r in rows],
            [*torch.split(key_states, 1), *torch.split(value_states, 1)],
        )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # not used: positions are given
        return 0


class _RowLinear(nn.Linear):
    """``nn.Linear`` that, inside a batch-invariant decode step, multiplies each row on its
    own: ``F.linear`` of ``[1, 1, in]``, the very call that ``generate`` makes for a batch of
    one. On the CPU, MKL's GEMM rounds a row of a batch differently from the same row alone
    (a different kernel and reduction order for each batch size below 16), so a batched
    product would change the tokens. Not ``bmm`` of ``[B, 1, in]`` by the weight broadcast
    over B either, though that is one call: MKL's batched GEMM computes each row as one
    thread would, while ``F.linear`` of one row at two or more threads splits the output
    columns among the threads, and on an Intel Xeon (AVX-512) rounds some of the last
    columns of a thread's block otherwise than one thread does where the block's width is
    not a multiple of 8 (GPT-2's and OPT's tiny test heads, 300 wide, at two threads; a
    4,096-wide layer at three). Outside a decode step it is ``nn.Linear``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = _decode_rows(input)
        if rows is not None:  # [B, 1, in]: one token of each row
            weight, bias = self.weight, self.bias
            out = torch.cat([F.linear(row, weight, bias) for row in torch.split(rows, 1)])
            return out.view(*input.shape[:-1], out.shape[-1])
        return super().forward(input)


def _decode_rows(input: torch.Tensor) -> torch.Tensor | None:
    """Inside a batch-invariant decode step, *input* (one token of each of several rows, as
    ``[B, 1, in]`` or flattened to ``[B, in]``, as OPT's feed-forward layers take it) as
    ``[B, 1, in]``; ``None`` elsewhere (a prefill, a batch of one)."""
    if not _DECODE_ROWS or input.dim() < 2:
        return None
    tokens = input.numel() // max(1, input.shape[-1])
    if tokens <= 1 or tokens != len(_DECODE_ROWS[-1].rows):
        return None
    return input.reshape(tokens, 1, input.shape[-1])


class _RowConv1D(Conv1D):
    """transformers' ``Conv1D`` (GPT-2's linear layers, weight ``[in, out]``) that, inside a
    batch-invariant decode step, runs each row's ``addmm`` on its own: the very call that
    ``generate`` makes for a batch of one (as :class:`_RowLinear`, for the same reason)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _decode_rows(x)
        if rows is None:
            return cast(torch.Tensor, super().forward(x))  # type: ignore[no-untyped-call]
        out = torch.cat([torch.addmm(self.bias, rows[i], self.weight) for i in range(len(rows))])
        return out.view(*x.shape[:-1], self.nf)


class _HeadLinear(_RowLinear):
    """The output head (``lm_head``) of a batch-invariant model. When the decode pass asks
    for it (:attr:`_Decode.batched_head`), it computes the logits of all rows in one batched
    GEMM, which rounds differently from a batch of one, and leaves its input and output on
    the :class:`_Decode`: the engine then takes a greedy row's token from these logits only
    where an error bound proves it is the token of the exact logits
    (:func:`_certified_argmax`), and computes the exact row (a batch of one) otherwise."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _DECODE_ROWS and _DECODE_ROWS[-1].batched_head and input.dim() == 3:
            decode = _DECODE_ROWS[-1]
            out = F.linear(input, self.weight, self.bias)
            decode.head_in, decode.head_out = input, out
            return out
        return super().forward(input)


#: Unit roundoff of float32 (round to nearest).
_U32 = 2.0**-24


def _certified_argmax(
    logits: torch.Tensor, bound: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of *logits* ``[B, V]`` (computed in any rounding order), the argmax and whether
    it is certainly the argmax of the exactly rounded logits of the same row computed in any
    other order: *bound* ``[B, V]`` bounds ``|computed - exact|`` for each entry, and a row is
    certified when its top entry minus its bound is above every other entry plus its bound
    (then the exact logits have that entry as their strict, unique maximum). NaN or
    infinities are never certified."""
    top = logits.argmax(-1, keepdim=True)
    lo = logits.gather(-1, top) - bound.gather(-1, top)
    hi = (logits + bound).scatter_(-1, top, float("-inf"))
    return top[:, 0], (lo[:, 0] > hi.amax(-1)) & torch.isfinite(lo[:, 0])


@contextmanager
def _decoding(model: Any, decode: _Decode) -> Iterator[None]:
    config = model.config
    before = config._attn_implementation
    _DECODE_ROWS.append(decode)
    config._attn_implementation = _ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = before
        _DECODE_ROWS.pop()


# -- the engine ----------------------------------------------------------------------------------


class TransformersEngine:
    """A continuous-batching :class:`~enginecore.Engine` over a local causal LM checkpoint.

    Parameters:
        model: a folder written by ``save_pretrained`` (config, weights, and optionally a
            tokenizer). A path that does not exist raises :class:`FileNotFoundError` naming it.
            Every layer must attend to all positions (a model with sliding-window layers is
            served within its smallest window): a model with chunked or linear-attention
            layers is a :class:`ValueError` naming its cache's layers, and so is one whose
            attention does not go through transformers' ``AttentionInterface`` (GPT-Neo,
            XGLM, MPT, Bloom) or passes it a position bias, a soft cap or attention sinks,
            found by one decode step run when the engine is built.
        device: ``"cpu"``, ``"cuda"``, ...; default: CUDA when available, else the CPU.
        dtype: a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``); default float32
            on the CPU, the checkpoint's own dtype elsewhere.
        kv_budget_tokens: KV tokens that running requests may reserve together. A request
            reserves ``len(prompt) + max_tokens`` when it is admitted and frees it when it
            ends or is aborted; one that needs more than the whole budget is rejected.
            Default: ``max_batch * min(max_position_embeddings, 65536)``.
        max_batch: most requests running at once (decoded together in one forward pass).
        max_prefill_tokens: prompt tokens prefilled per step at most (at least one request is
            always prefilled when one can be admitted), so that long prompts arriving
            together do not stall the running requests' decode for long.
        batch_invariant: per-row products in the decode step, and a batched output head
            whose greedy tokens are certified by an error bound (see the module docstring).
            ``False`` uses one batched GEMM per linear layer: faster, and equal to
            ``generate`` alone only up to rounding (tokens may differ on near-ties).

    ``max_batch``, ``max_prefill_tokens`` and ``kv_budget_tokens`` are ints >= 1, a
    ``dtype`` name must name a torch dtype, and ``device`` must be one this torch can use:
    anything else is a :class:`ValueError` naming the argument, before the model is loaded.
    """

    def __init__(
        self,
        model: str,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        kv_budget_tokens: int | None = None,
        max_batch: int = 32,
        max_prefill_tokens: int = 512,
        batch_invariant: bool = True,
    ) -> None:
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model path {path!r} does not exist (or is not a folder)")
        for name, value in (
            ("max_batch", max_batch),
            ("max_prefill_tokens", max_prefill_tokens),
            ("kv_budget_tokens", 1 if kv_budget_tokens is None else kv_budget_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {_show(value)}")
        if isinstance(dtype, str):
            named = getattr(torch, dtype, None)
            if not isinstance(named, torch.dtype):
                raise ValueError(f"dtype {dtype!r:.100} is not a torch dtype (e.g. 'float32')")
            dtype = named
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
            torch.empty(0, device=self.device)  # a device this torch has, and can reach
        except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
            # torch's RuntimeError for a bad name, AssertionError for CUDA without it.
            raise ValueError(f"device {device!r:.100} is not usable here: {exc}") from exc
        if dtype is None and self.device.type == "cpu":
            dtype = torch.float32
        # Typed Any: the model's config and cache attributes are dynamic in transformers.
        self.model: Any = cast(
            Any,
            AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype if dtype is not None else "auto", local_files_only=True
            ),
        )
        # Full attention: the prefill keeps every position's K/V and the decode attends over
        # all of them. A sliding-window layer's cache keeps the last window - 1 positions,
        # so its query sees the last `window` ones: within a window that is all of them,
        # and the model is served with its positions cut to its smallest window (tested
        # equal to generate, batched). Beyond it the tokens would differ from generate's,
        # and a prompt longer than the window would fail in step(). A chunked or linear
        # attention layer (another cache, or no K/V) is refused.
        windows: list[int] = []
        other: set[str] = set()
        for layer in DynamicCache(config=self.model.config).layers:
            if type(layer) is DynamicSlidingWindowLayer:
                windows.append(int(layer.sliding_window))
            elif type(layer) is not DynamicLayer:
                other.add(type(layer).__name__)
        if other:
            raise ValueError(
                f"model {path!r:.200} has attention layers that TransformersEngine does not "
                f"support (their cache: {', '.join(sorted(other))}; chunked or linear "
                "attention): it serves models whose every layer attends to all positions, "
                "or to a sliding window"
            )
        self.model.to(self.device)
        self.model.eval()
        if self.model.config._attn_implementation != "sdpa":
            self.model.set_attn_implementation("sdpa")
        self.batch_invariant = batch_invariant
        # The output head batched with a certified argmax (see _decode): float32 on the CPU,
        # where the error bound below holds (IEEE float32 products and sums, no TF32).
        self._head: _HeadLinear | None = None
        self._head_certified = 0  # greedy rows whose token came from the batched head
        self._head_exact = 0  # rows whose logits were computed alone (a batch of one)
        if batch_invariant:
            for mod in self.model.modules():
                if type(mod) is nn.Linear:
                    mod.__class__ = _RowLinear
                elif type(mod) is Conv1D:
                    mod.__class__ = _RowConv1D
            head = self.model.get_output_embeddings()
            if (
                type(head) is _RowLinear
                and head.weight.dtype == torch.float32
                and self.device.type == "cpu"
            ):
                head.__class__ = _HeadLinear
                self._head = cast(_HeadLinear, head)
                with torch.no_grad():
                    w = head.weight.detach().double()
                    # |x . w_j| rounding error <= gamma * sum_i |x_i w_ji| (any summation
                    # order, with or without FMA) <= gamma * |x| |w_j| (Cauchy-Schwarz).
                    self._head_norms = (w.norm(dim=-1) * (1 + 1e-6)).float()
                    self._head_bias = None if head.bias is None else head.bias.detach().abs()
                n = head.in_features + 1  # + 1: the bias's addition
                gamma = n * _U32 / (1 - n * _U32)
                # Two computations of one logit each lie within gamma * S of the exact sum,
                # so within 2 * gamma * S of each other; x2 more for the rounding of S itself.
                self._head_scale = 4 * gamma
        self.tokenizer: Any = None
        if any(
            os.path.exists(os.path.join(path, f))
            for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 2**31)
        if windows:  # within the smallest window, sliding attention is full attention
            self.max_positions = min(self.max_positions, *windows)
        self.num_layers = int(config.num_hidden_layers)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_budget = (
            kv_budget_tokens
            if kv_budget_tokens is not None
            else max_batch * min(self.max_positions, 1 << 16)
        )
        # FIFO, by request id: an abort takes one out in O(1) (a rebuild per aborted id
        # made aborting n waiting requests O(n^2): 5,000 took 1 s of the loop's thread).
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._running: dict[str, _Request] = {}
        self._live: set[str] = set()
        self._reserved = 0
        self._steps = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._decode_steps = 0
        self._check_attention(path)

    # -- the Engine protocol ----------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def add(self, req_id: str, data: Any) -> None:
        if req_id in self._live:
            raise RequestRejected(f"request {req_id!r} is already live in the engine")
        self._waiting[req_id] = self._parse(req_id, data)
        self._live.add(req_id)

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            if rid not in self._live:
                continue
            self._live.discard(rid)
            req = self._running.pop(rid, None)
            if req is not None:
                self._release(req)
            else:
                self._waiting.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "stats":
            return self.stats()
        if name == "model_info":
            return {
                "vocab_size": self.vocab_size,
                "max_positions": self.max_positions,
                "eos_token_ids": sorted(self.eos_token_ids),
                "has_tokenizer": self.tokenizer is not None,
                "kv_budget_tokens": self.kv_budget,
                "max_batch": self.max_batch,
            }
        raise ValueError(
            f"TransformersEngine has no utility {name!r}; known: 'stats', 'model_info'"
        )

    def stats(self) -> dict[str, float]:
        """``running``, ``waiting``, ``kv_usage`` (reserved / budget, 0-1), and
        ``kv_tokens_reserved``, ``kv_tokens_used`` (tokens in the KV tensors), ``steps``,
        ``decode_steps``, ``prefill_tokens``, ``decode_tokens`` (totals)."""
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "kv_usage": self._reserved / self.kv_budget,
            "kv_tokens_reserved": self._reserved,
            "kv_tokens_used": sum(r.length for r in self._running.values()),
            "steps": self._steps,
            "decode_steps": self._decode_steps,
            "prefill_tokens": self._prefill_tokens,
            "decode_tokens": self._decode_tokens,
        }

    def step(self) -> list[Output]:
        self._steps += 1
        outputs: list[Output] = []
        decoding = list(self._running.values())
        prefilled = 0
        waiting = self._waiting
        while waiting and len(self._running) < self.max_batch:
            head = next(iter(waiting.values()))
            if self._reserved + head.reserve > self.kv_budget:
                break  # FIFO: nothing overtakes the head
            if prefilled and prefilled + len(head.prompt) > self.max_prefill_tokens:
                break
            waiting.popitem(last=False)
            self._reserved += head.reserve
            prefilled += len(head.prompt)
            outputs.append(self._prefill(head))
        if decoding:
            outputs.extend(self._decode(decoding))
        return outputs

    # -- routing (docs/stage.md) --------------------------------------------------------------

    @staticmethod
    def route_outputs(
        outputs: list[Output],
    ) -> tuple[list[str], list[bool], list[dict[str, Any]]]:
        """The stage runtime's batch routing hook: ``(req_ids, finished, payloads)``."""
        return [o[0] for o in outputs], [o[2] for o in outputs], [o[1] for o in outputs]

    @staticmethod
    def route_output(output: Output) -> tuple[str, bool, dict[str, Any]]:
        """The stage runtime's routing hook: ``(req_id, finished, payload)``."""
        rid, payload, finished = output
        return rid, finished, payload

    # -- internals ----------------------------------------------------------------------------

    def _parse(self, rid: str, data: Any) -> _Request:
        if not isinstance(data, dict):
            raise RequestRejected(f"a request is a dict with a 'prompt', got {_show(data)}")
        unknown = set(data) - REQUEST_KEYS
        if unknown:
            raise RequestRejected(
                f"unknown request parameter(s) {sorted(map(str, unknown))}; "
                f"known: {sorted(REQUEST_KEYS)}"
            )
        if "prompt" not in data:
            raise RequestRejected("the request has no 'prompt'")
        prompt = data["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(
                    "a text prompt needs a tokenizer, and this checkpoint has none: send token ids"
                )
            try:
                ids = list(self.tokenizer(prompt)["input_ids"])
            except Exception as exc:  # e.g. a lone surrogate (JSON's "\ud800"): TypeError
                raise RequestRejected(
                    f"the tokenizer refused the prompt: {type(exc).__name__}: {exc}"[:300]
                ) from exc
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
        else:
            raise RequestRejected(
                f"'prompt' must be a list of token ids or a str, got {_show(prompt)}"
            )
        if not ids:
            raise RequestRejected("the prompt is empty")
        max_tokens = data.get("max_tokens", 16)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestRejected(f"'max_tokens' must be an int >= 1, got {_show(max_tokens)}")
        if len(ids) + max_tokens > self.max_positions:
            # Before the ids are checked one by one: a prompt of a million ids is refused
            # at once, not after a walk over them on the loop's thread.
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({_show(max_tokens)}) exceeds the "
                f"model's {self.max_positions} positions"
            )
        _check_ids(ids, self.vocab_size, "prompt")
        temperature = _number(data.get("temperature", 0.0), "temperature")
        if temperature < 0:
            raise RequestRejected(f"'temperature' must be >= 0, got {temperature!r}")
        if 0 < temperature < MIN_TEMPERATURE:
            raise RequestRejected(
                f"'temperature' must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature!r}: "
                "below, logits / temperature can overflow float32"
            )
        top_p = _number(data.get("top_p", 1.0), "top_p")
        if not 0 < top_p <= 1:
            raise RequestRejected(f"'top_p' must be in (0, 1], got {top_p!r}")
        seed = data.get("seed")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX
        ):
            raise RequestRejected(
                f"'seed' must be an int in [-2**63, 2**64 - 1] or None, got {_show(seed)}"
            )
        stop_ids = data.get("stop_token_ids")
        if stop_ids is None:
            stop_ids = []
        if not isinstance(stop_ids, list | tuple):
            raise RequestRejected(f"'stop_token_ids' must be a list of ints, got {_show(stop_ids)}")
        _check_ids(list(stop_ids), self.vocab_size, "stop_token_ids")
        reserve = len(ids) + max_tokens
        if reserve > self.kv_budget:
            raise RequestRejected(
                f"the request needs {reserve} KV tokens (prompt + max_tokens), more than the "
                f"engine's whole budget of {self.kv_budget}"
            )
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        return _Request(
            rid,
            ids,
            max_tokens,
            temperature,
            top_p,
            frozenset(stop_ids) | self.eos_token_ids,
            generator,
        )

    @torch.inference_mode()
    def _prefill(self, req: _Request) -> Output:
        """Run *req*'s prompt alone (a batch of one, as ``generate`` does), keep its KV in
        tensors sized for the whole request, and return its first token."""
        logits = self._prefill_kv(req)
        self._prefill_tokens += len(req.prompt)
        self._running[req.rid] = req
        return self._emit(req, self._sample(req, logits))

    def _prefill_kv(self, req: _Request) -> torch.Tensor:
        """*req*'s prompt through the model: its K/V into *req*'s tensors; the last logits."""
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([req.prompt], device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        n = len(req.prompt)
        cap = n + req.max_tokens - 1  # the last token is never fed back
        layers: list[Any] = list(cache.layers)
        for layer in layers:
            k, v = layer.keys, layer.values
            shape = (1, k.shape[1], cap, k.shape[3])
            kt = torch.empty(shape, dtype=k.dtype, device=k.device)
            vt = torch.empty(shape, dtype=v.dtype, device=v.device)
            kt[:, :, :n] = k
            vt[:, :, :n] = v
            req.keys.append(kt)
            req.values.append(vt)
        req.length = n
        return cast(torch.Tensor, out.logits[0, -1])

    @torch.inference_mode()
    def _check_attention(self, path: str) -> None:
        """Run one decode step of a two-token request, and check that every attention layer
        went through :func:`_rows_attention` (registered with ``AttentionInterface``), which
        attends over each row's own K/V. A model with attention of its own (GPT-Neo, XGLM,
        MPT, Bloom) would attend over the step's new token only: wrong tokens, silently, or
        an exception in ``step()``, fatal; so would one that passes its attention function
        what the decode step's attention does not apply (``_UNSUPPORTED_ATTENTION``: that
        function raises). :class:`ValueError` for such a model."""
        req = _Request("", [0, 0], 2, 0.0, 1.0, frozenset(), None)
        calls, error = -1, None
        try:
            self._prefill_kv(req)
            req.generated.append(0)
            calls = self._forward([req], batched_head=False).attention_calls
        except Exception as exc:  # e.g. Bloom's ALiBi, built from a 2-D mask: ValueError
            error = exc
        layers = len(req.keys)
        self._release_kv(req)
        if error is None and layers and calls == layers:
            return
        if error is not None:
            detail = f"a first step of it (a prefill, a decode) raised {type(error).__name__}: "
            detail = (detail + str(error))[:300]
        else:
            detail = (
                f"{max(calls, 0)} of its {layers} attention layers went through it (its "
                "attention is its own, as GPT-Neo's, XGLM's, MPT's or Bloom's)"
            )
        raise ValueError(
            f"model {path!r:.200} ({type(self.model).__name__}) cannot be served: "
            "TransformersEngine's decode step attends through a function registered with "
            "transformers' AttentionInterface (plain SDPA over each request's own K/V), and "
            f"{detail}"
        )

    @torch.inference_mode()
    def _decode(self, rows: list[_Request]) -> list[Output]:
        """One token for every row, in one forward pass."""
        self._decode_steps += 1
        self._decode_tokens += len(rows)
        head = self._head
        decode = self._forward(rows, batched_head=head is not None and len(rows) > 1)
        if decode.batched_head and decode.head_out is not decode.logits:
            # The model changed the head's output (a soft cap, a scale): the bound does not
            # cover that. Run the step again with the exact head, from now on (the rows' new
            # K/V are written again, to the same places, with the same values).
            self._head = head = None
            decode = self._forward(rows, batched_head=False)
        logits = cast(torch.Tensor, decode.logits)[:, -1]
        tokens: list[int | None] = [None] * len(rows)
        if decode.batched_head and head is not None and decode.head_in is not None:
            # A greedy row's token is the argmax of its exact logits (those of a batch of
            # one). The batched logits differ from them by rounding only, by at most the
            # bound; where the bound proves their argmax is the exact one, take it, and
            # compute the row alone otherwise (a near-tie, a sampled row).
            h = decode.head_in[:, -1]
            bound = torch.linalg.vector_norm(h, dim=-1, keepdim=True) * self._head_norms
            if self._head_bias is not None:
                bound = bound + self._head_bias
            top, ok = _certified_argmax(logits, bound * self._head_scale + 1e-30)
            for i, (t, sure) in enumerate(zip(top.tolist(), ok.tolist(), strict=True)):
                if sure and rows[i].generator is None:
                    tokens[i] = t
            exact = [i for i, t in enumerate(tokens) if t is None]
            self._head_certified += len(rows) - len(exact)
            self._head_exact += len(exact)
            for i in exact:
                row = F.linear(decode.head_in[i : i + 1], head.weight, head.bias)
                tokens[i] = self._sample(rows[i], row[0, -1])
        outputs = []
        for i, req in enumerate(rows):
            req.length += 1
            t = tokens[i]
            outputs.append(self._emit(req, self._sample(req, logits[i]) if t is None else t))
        return outputs

    def _forward(self, rows: list[_Request], batched_head: bool) -> _Decode:
        """The decode step's forward pass over *rows*; the logits are on the result."""
        ids = torch.tensor([[r.generated[-1]] for r in rows], device=self.device)
        pos = torch.tensor([[r.length] for r in rows], device=self.device)
        # A 4-D mask is passed through as is (no mask is built); the attention ignores it.
        mask = torch.zeros((len(rows), 1, 1, 1), device=self.device)
        decode = _Decode(rows, batched_head)
        with _decoding(self.model, decode):
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                cache=_RowCache(rows),
                use_cache=True,
            )
        decode.logits = out.logits
        return decode

    def _sample(self, req: _Request, logits: torch.Tensor) -> int:
        """Greedy at temperature 0; else temperature, top-p and a draw from the request's own
        generator: nothing depends on the other rows."""
        logits = logits.float()
        if req.generator is None:
            return int(torch.argmax(logits))
        scores = (logits / req.temperature)[None]
        if req.top_p < 1:
            scores = TopPLogitsWarper(req.top_p)(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _emit(self, req: _Request, token: int) -> Output:
        req.generated.append(token)
        payload: dict[str, Any] = {"token_ids": [token]}
        if token in req.stop:
            payload["finish_reason"] = "stop"
        elif len(req.generated) >= req.max_tokens:
            payload["finish_reason"] = "length"
        else:
            return req.rid, payload, False
        self._running.pop(req.rid, None)
        self._live.discard(req.rid)
        self._release(req)
        return req.rid, payload, True

    def _release(self, req: _Request) -> None:
        self._reserved -= req.reserve
        self._release_kv(req)

    @staticmethod
    def _release_kv(req: _Request) -> None:
        req.keys.clear()  # the KV tensors' last references: freed now
        req.values.clear()
        req.length = 0


def _check_ids(ids: list[Any], vocab: int, what: str) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestRejected(f"'{what}' must hold ints (token ids), got {_show(t)}")
        if not 0 <= t < vocab:
            raise RequestRejected(
                f"token id {_show(t)} in '{what}' is out of the vocabulary [0, {vocab})"
            )


def _show(value: Any) -> str:
    """*value*'s repr for a message, cut at 100 characters; an int too long for ``repr`` (over
    ``sys.get_int_max_str_digits()`` digits: ``ValueError``) is shown by its size."""
    try:
        return f"{value!r:.100}"
    except ValueError:
        return f"<{type(value).__name__} too large to show>"


def _number(value: Any, name: str) -> float:
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)  # an int too large for a float raises OverflowError
        except OverflowError:
            pass
        else:
            if math.isfinite(number):
                return number
    raise RequestRejected(f"'{name}' must be a finite number, got {_show(value)}")


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The EOS ids of the generation config, the model config and the tokenizer: any of them
    ends a request with ``finish_reason="stop"``, as it ends ``generate``."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


# -- a random-weight model, for tests, examples and benchmarks ----------------------------------

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_random_model(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab: int = 512,
    max_positions: int = 512,
    seed: int = 0,
    chat_template: bool = True,
) -> str:
    """Write a random-weight Llama-shaped model and its tokenizer to *path* with
    ``save_pretrained``, and return the path. No hub access.

    The tokenizer is byte-level with no merges (any text encodes, one token per byte), ids
    0-2 being ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS), then the 256 bytes, then filler
    tokens ``<extra_i>`` up to *vocab* (>= 259+). With *chat_template*, a minimal chat
    template (``<|role|>content`` lines) is saved with it. *kv_heads* must divide *heads*
    (``ValueError``), and a *path* that exists must be a folder (``NotADirectoryError``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab < 259:
        raise ValueError("vocab must be >= 259 (3 special tokens and 256 bytes)")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    out = os.fspath(path)
    if os.path.exists(out) and not os.path.isdir(out):
        # save_pretrained would only log it, write nothing, and the path would come back.
        raise NotADirectoryError(f"{out!r} exists and is not a folder")
    specials = ["<unk>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = specials + sorted(alphabet)
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    if chat_template:
        fast.chat_template = _CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out
