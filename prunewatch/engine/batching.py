"""Continuous batching: concurrent requests share decode steps, each keeping its own cache, plan and counts.

Why: a decode step is memory-bound, so one step of b rows reads each weight once for b tokens. Requests keep
their own generator on their own thread (streaming, stop sequences, logprobs and stats are untouched); only the
forward passes move to one stepper thread, which holds the cores:
- a request's prefill runs there in chunks of prunewatch.engine.kv_cache.PREFILL_CHUNK tokens (as in process), each
  in one packed pass (`packed_pass`) with the decode rows due at that moment: the requests already decoding take
  their step in the chunk's pass instead of waiting for it, and a long prompt's chunks are taken in turn with decode
  steps. The pass runs each product on the chunk's rows and on the decode rows apart
  (prunewatch.engine.execution.per_segment), or in one call where both parts run the same row-invariant product
  (prunewatch.engine.sparse.module.ROW_INVARIANT_CHUNK_ROWS), so neither gets other bits or counts than alone; a chunk
  runs alone when no row that may share its pass is due;
- its decode steps wait at a rendezvous: the stepper runs one forward pass for every request whose next token is
  due (it waits up to `gather_s` for the requests still detokenizing their last one), at most `max_batch` rows;
  a request joins at the step after its prefill and leaves when its generator closes (end, stop, cancellation).

Each request keeps its own cache, reserved for its whole length (prompt plus max new tokens,
prunewatch.engine.kv_cache): a batched step calls the model without a cache and the attention function registered
here (`RAGGED_ATTENTION`) writes each row's key and value into that row's cache, in place, and attends over it
alone, as the request would alone (no padding, no mask; on the CPU one compiled operator per layer for every row,
prunewatch/engine/sparse/csrc/ragged_attention.cpp, whose per-row sums do not depend on the other rows; eager
decoding in process runs its steps the same way, `ragged_decode_step`). Under `ExecutionPlan.row_invariant` the
dense products of few rows run through products whose per-row sums do not depend on the other rows either
(csrc/fp32_dense.cpp for fp32 weights, csrc/int8_dense.cpp and csrc/int4_dense.cpp for quantized ones), so a dense
request decodes the same tokens alone, in any batch, or in process.

A batch runs one plan, the members' common denominator (`batch_plan`): requests whose plans differ in what
changes the KV cache's shape or content (bypassed blocks, gated heads, sparsity policy, family factors) never
share a step; the others run each layer at the lowest activation-sparsity target among them (no request is
pruned more than it asked), with the kernel reading the union of the rows' active channels, and the output-head
shortlist only while it reads fewer bytes than the dense head (each row reads its own shortlist rows: b rows at
sparsity s read b x (1 - s) of the head). The batch's counted work is split among its rows in equal shares (each
row is one token; a shared weight read is paid 1/b by each), so the members' counts add up to what the step
executed.

Memory: the batcher holds a KV budget (`kv_budget_bytes`). A request reserves, when it joins, what its cache can
reach (prompt plus max new tokens, every layer's key and value: the size of the buffers it holds) and gives it back
when it leaves; one that does not fit waits until enough is given back, so admitted requests never hold more cache
than the budget. One that alone needs more than the whole budget fails at once (KVBudgetError).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from prunewatch.engine.errors import KVBudgetError
from prunewatch.engine.execution import (
    ExecutionLedger,
    ExecutionPlan,
    InstrumentedModel,
    PackedTail,
    executing,
    packed_tail,
)
from prunewatch.engine.kv_cache import ReservedLayer
from prunewatch.engine.threads import start_generation_thread

logger = logging.getLogger("prunewatch.engine")

T = TypeVar("T")

RAGGED_ATTENTION = "prunewatch_ragged"
# ExecutionLedger fields that add up over calls: a batch's totals are split among its rows.
_ADDITIVE = ("executed_flops", "dense_flops", "weight_bytes_read", "kv_bytes_read", "sparse_dense_flops",
             "sparse_executed_flops", "sparse_input_entries", "sparse_kept_entries")
# Attention arguments that make a call more than softmax(q k^T * scaling) v: such calls keep transformers' function.
_UNPLAIN_ATTENTION_KWARGS = ("softcap", "position_bias", "sliding_window", "s_aux", "sinks")


class BatcherClosedError(RuntimeError):
    """The batcher stopped (the server is shutting down) while a request waited for a forward pass."""


@dataclass
class RaggedStep:
    """The per-row caches of one decode step, read by the attention function from `_CURRENT_STEP` (a context
    variable, not a keyword argument: some families' decoder layers do not pass extra arguments on to attention).

    A packed pass (`packed_pass`) also holds a prompt chunk: its `prefill_rows` positions come first in the pass's
    one sequence, their keys and values go into `prefill_cache`, and the decode rows of `caches` follow, one position
    each."""

    caches: list[Any]  # one transformers cache per row (prunewatch.engine.kv_cache.reserved_cache)
    calls: int = 0  # attention calls that served this step
    prefill_cache: Any = None  # the prompt chunk's cache (a packed pass), else None
    prefill_rows: int = 0  # the prompt chunk's positions at the start of the sequence
    prefill_mask: torch.Tensor | None = None  # the chunk's causal mask over its cache, built by its first layer


_CURRENT_STEP: contextvars.ContextVar[RaggedStep | None] = contextvars.ContextVar("prunewatch_ragged_step",
                                                                                  default=None)


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, ragged_step: RaggedStep | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except in a batched decode step: there each row's new key and value go
    into its own cache and the row attends over that cache alone, exactly as a batch of one would."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if ragged_step is None and not torch.compiler.is_compiling():  # a compiled graph is never a ragged step
        ragged_step = _CURRENT_STEP.get()
    if ragged_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    ragged_step.calls += 1
    layer: int = module.layer_idx  # type: ignore[assignment]  # every attention module of transformers 5 has it
    if ragged_step.prefill_rows:
        return _packed_attention(module, query, key, value, ragged_step, layer, **kwargs)
    return _decode_rows_attention(module, query, key, value, ragged_step.caches, layer, **kwargs)


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      step: RaggedStep, layer: int, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A packed pass's attention: the prompt chunk's positions (the first `step.prefill_rows` of the one sequence)
    append to their cache and attend causally over it, as transformers' SDPA attention would with the cache it
    updates; each decode row after them attends over its own cache (`_decode_rows_attention`). Returns
    (1, positions, heads, dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = step.prefill_rows
    keys, values = step.prefill_cache.update(key[:, :, :rows], value[:, :, :rows], layer)
    past = keys.shape[2] - rows
    # Position i of the chunk sees the cached positions and its own chunk's up to itself; with nothing cached that
    # is the plain causal mask, which SDPA takes as is_causal (transformers' own choice for that case).
    mask = None
    if past > 0:  # every layer's cache holds as many positions: one mask serves the pass
        mask = step.prefill_mask
        if mask is None or mask.shape[-1] != past + rows:
            mask = step.prefill_mask = torch.ones((rows, past + rows), dtype=torch.bool,
                                                  device=query.device).tril(past)[None, None]
    chunk, _ = sdpa_attention_forward(module, query[:, :, :rows], keys, values, mask, **kwargs)  # (1, rows, H, D)
    if not step.caches:
        return chunk, None
    # The decode rows as a step's batch: (rows, heads, 1, dim), each over its own cache.
    def as_rows(states: torch.Tensor) -> torch.Tensor:
        return states[0, :, rows:].transpose(0, 1).unsqueeze(2)

    decoded, _ = _decode_rows_attention(module, as_rows(query), as_rows(key), as_rows(value), step.caches, layer,
                                        **kwargs)  # (rows, 1, H, D)
    return torch.cat((chunk, decoded.transpose(0, 1)), dim=1), None


def _decode_rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           caches: list[Any], layer: int, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Decode rows (rows, heads, 1, dim): each row's key and value into its own cache, and its attention over that
    cache alone. Returns (rows, 1, heads, dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # A plain decode row: one query, no mask, no extra terms (what transformers' own function does for it is
    # softmax(q k^T * scaling) v, the key/value heads shared among the query heads).
    plain = (query.shape[2] == 1 and not module.training
             and all(kwargs.get(name) is None for name in _UNPLAIN_ATTENTION_KWARGS))
    scaling = kwargs.get("scaling")
    if plain and query.device.type == "cpu" and query.dtype == torch.float32:
        cache_layers = _reserved_layers(caches, layer)
        operator = _ragged_operator() if cache_layers is not None else None
        if cache_layers is not None and operator is not None:
            # Every row, one row alone included, writes in place and attends in csrc/ragged_attention.cpp: a row's
            # sums there do not depend on the step's other rows, so alone and batched decode the same tokens.
            output = operator(query, key, value, [c.key_buffer for c in cache_layers],
                              [c.value_buffer for c in cache_layers], [c.length for c in cache_layers],
                              query.shape[-1] ** -0.5 if scaling is None else scaling, torch.get_num_threads())
            for cache_layer in cache_layers:
                cache_layer.advance()
            return output, None
    grouped = query.shape[1] != key.shape[1]
    outputs = []
    for row, cache in enumerate(caches):
        row_key, row_value = cache.update(key[row:row + 1], value[row:row + 1], layer)
        if plain:
            output = torch.nn.functional.scaled_dot_product_attention(
                query[row:row + 1], row_key, row_value, scale=scaling, enable_gqa=grouped).transpose(1, 2)
        else:
            output, _ = sdpa_attention_forward(module, query[row:row + 1], row_key, row_value, None, **kwargs)
        outputs.append(output)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), None


def _reserved_layers(caches: list[Any], layer: int) -> list[ReservedLayer] | None:
    """Each row's cache layer `layer` when every one is a filled ReservedLayer with room for one more position
    (reserved_cache makes them so; the operator writes in place), else None."""
    found = []
    for cache in caches:
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) <= layer:
            return None
        cache_layer = layers[layer]
        if type(cache_layer) is not ReservedLayer or not cache_layer.is_initialized:
            return None
        cache_layer.reserve(cache_layer.length + 1)
        found.append(cache_layer)
    return found


_OPERATOR_UNRESOLVED: Any = object()
_operator: Any = _OPERATOR_UNRESOLVED


def _ragged_operator() -> Callable[..., Any] | None:
    """csrc/ragged_attention.cpp's `reserved_decode_attention`, built with the sparse kernel; None where that cannot
    be built, and decode steps attend row by row with torch's SDPA instead (the same arithmetic up to rounding,
    slower)."""
    global _operator
    if _operator is _OPERATOR_UNRESOLVED:
        from prunewatch.engine.sparse.kernel import SparseKernelUnavailableError, build

        try:
            _operator = build().reserved_decode_attention
        except SparseKernelUnavailableError as exc:
            logger.info("decode steps attend row by row with torch's SDPA: %s", exc)
            _operator = None
    return _operator


def ragged_decode_step(model: Any, tokens: list[int], positions: list[int], caches: list[Any]) -> torch.Tensor:
    """One decode step of `len(tokens)` rows, row b at `positions[b]` over its own cache `caches[b]` (the model's
    attention must be RAGGED_ATTENTION: install_ragged_attention); returns the logits (rows, vocab). The batcher's
    steps and an eager decode in process both run this, so a request gets the same sums either way."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([[token] for token in tokens], device=device)  # (B, 1)
    position_ids = torch.tensor([[position] for position in positions], device=device)  # (B, 1)
    no_mask = torch.ones((len(tokens), 1, 1, 1), dtype=torch.bool, device=device)  # 4D: taken as prepared
    step = RaggedStep(caches)
    reset = _CURRENT_STEP.set(step)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=no_mask, use_cache=False,
                    logits_to_keep=1)
    finally:
        _CURRENT_STEP.reset(reset)
    # Every layer that holds a cache must have attended through ragged_attention; one that did not attended over
    # its new position alone, and its logits are wrong: fail rather than serve them.
    expected = sum(1 for layer in getattr(caches[0], "layers", ()) if layer.is_initialized)
    if step.calls != expected:
        raise RuntimeError(f"{expected} attention layers hold this request's cache but {step.calls} attended through "
                           f"the ragged attention: this model's attention does not use transformers' attention "
                           f"interface, so it cannot decode with per-request caches")
    return out.logits[:, -1]


def packed_pass(model: Any, chunk_ids: Sequence[int], start: int, cache: Any, tokens: Sequence[int] = (),
                positions: Sequence[int] = (), caches: Sequence[Any] = (), *,
                keep_all: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass of a prompt chunk (`chunk_ids` at positions from `start`, into `cache`) with decode rows
    riding along (`tokens[b]` at `positions[b]` over `caches[b]`, as in `ragged_decode_step`), packed in one
    sequence: the chunk's positions first, then one per decode row. Returns the chunk's logits (its last row, or
    every row with `keep_all`, which takes no decode rows), and the decode rows' (rows, vocab) or None.

    Why: a prefill chunk run alone stalls the decoding requests for as long as it runs, and reads every weight for
    its rows only; packed, the decode rows take their step in the same pass, their products on the weights the
    chunk's just brought into the caches. Under a packed tail (prunewatch.engine.execution.per_segment) every
    wrapped product runs each part on its own rows, so the chunk's bits are those of its pass alone and each decode
    row's those of a step of the same rows (`ragged_decode_step`). The model's attention must be RAGGED_ATTENTION
    (install_ragged_attention), and a pass with decode rows must run under `packed_tail`."""
    rows = len(chunk_ids)
    if rows == 0 or len(tokens) != len(positions) or len(tokens) != len(caches) or (keep_all and tokens):
        raise ValueError(f"a packed pass takes a non-empty chunk and one position and cache per decode row (none "
                         f"when every chunk row is kept), got {rows} chunk positions, {len(tokens)} tokens, "
                         f"{len(positions)} positions, {len(caches)} caches")
    device = next(model.parameters()).device
    input_ids = torch.tensor([[*chunk_ids, *tokens]], device=device)  # (1, rows + decode rows)
    position_ids = torch.tensor([[*range(start, start + rows), *positions]], device=device)
    no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)  # 4D: taken as prepared
    # The chunk's last row (or all of it) and every decode row; an int keeps the last rows as a prefill does.
    keep: int | torch.Tensor = (0 if keep_all else 1) if not tokens else torch.arange(rows - 1, rows + len(tokens),
                                                                                       device=device)
    step = RaggedStep(list(caches), prefill_cache=cache, prefill_rows=rows)
    reset = _CURRENT_STEP.set(step)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=no_mask, use_cache=False,
                    logits_to_keep=keep)
    finally:
        _CURRENT_STEP.reset(reset)
    expected = sum(1 for layer in getattr(cache, "layers", ()) if layer.is_initialized)
    if step.calls != expected:
        raise RuntimeError(f"{expected} attention layers hold the prompt's cache but {step.calls} attended through "
                           f"the ragged attention: this model's attention does not use transformers' attention "
                           f"interface, so it cannot prefill into a reserved cache")
    logits = out.logits[0]  # (kept, vocab)
    if not tokens:
        return logits, None
    return logits[:1], logits[1:]


def install_ragged_attention(model: torch.nn.Module) -> None:
    """Register the ragged attention (with SDPA's masks for every call that is not a batched step) and make it
    the model's attention implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config: Any = model.config
    if config._attn_implementation == RAGGED_ATTENTION:
        return
    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    config._attn_implementation = RAGGED_ATTENTION


def packable(instrumented: InstrumentedModel) -> bool:
    """Whether a prompt chunk and decode rows may share a pass (`packed_pass`) without changing a bit of either:
    every linear layer of the decoder blocks, and the output head, is computed by one of the engine's wrappers
    (prunewatch.engine.sparse), which run each part of a packed pass on its own rows. A plain layer would multiply
    all of them in one BLAS product, whose rounding changes with the rows."""
    from prunewatch.engine.sparse.targets import LinearWrapper

    model: Any = instrumented.model
    wrapped = {id(module.linear) for module in model.modules() if isinstance(module, LinearWrapper)}
    if not isinstance(model.get_output_embeddings(), LinearWrapper):
        return False
    return all(id(module) in wrapped for block in instrumented.blocks for module in block.modules()
               if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D")


def batch_key(plan: ExecutionPlan) -> tuple:
    """What requests must agree on to share a step: everything that shapes the KV cache or a kernel's layout."""
    return (plan.bypass, plan.gated_heads, plan.sparsity_policy, plan.family_scale, plan.output_head_candidates)


def batch_plan(plans: list[ExecutionPlan], num_layers: int, sparse_rows: int = 1) -> ExecutionPlan:
    """The plan a step of these rows runs (they share `batch_key`). Up to `sparse_rows` rows: per layer the lowest
    activation-sparsity target among them, and the output-head shortlist only while its rows read fewer bytes than
    the dense head; more rows: dense (the union of b rows' active channels keeps 1 - s^b of them, so a per-row
    target s skips little once b > 1; the bypass and gated heads, fixed at the prefill, stay)."""
    first = plans[0]
    rows = len(plans)
    if rows == 1 and sparse_rows >= 1:
        return first
    if rows > sparse_rows:
        return replace(first, activation_sparsity=0.0, layer_sparsity=(), output_head_sparsity=0.0,
                       output_head_row_kernel=False, row_invariant=True)
    layers = tuple(min(p.sparsity_for(i) for p in plans) for i in range(num_layers))
    head = min(p.output_head_sparsity for p in plans)
    if rows * (1.0 - head) >= 1.0:
        head = 0.0
    return replace(first, activation_sparsity=0.0, layer_sparsity=layers, output_head_sparsity=head,
                   output_head_row_kernel=False, row_invariant=True)


def split_ledger(total: ExecutionLedger, ledgers: list[ExecutionLedger]) -> None:
    """Add `total` (one batched step's counts) to the rows' ledgers in equal shares that add up exactly: row i gets
    n // b, plus one of the n % b left over for the first rows. Block call counts go to every row whole."""
    rows = len(ledgers)
    for name in _ADDITIVE:
        amount = int(getattr(total, name))
        share, left = divmod(amount, rows)
        for index, ledger in enumerate(ledgers):
            setattr(ledger, name, getattr(ledger, name) + share + (1 if index < left else 0))
    for ledger in ledgers:
        for block, calls in total.block_calls.items():
            ledger.block_calls[block] = ledger.block_calls.get(block, 0) + calls
        for block, calls in total.block_bypasses.items():
            ledger.block_bypasses[block] = ledger.block_bypasses.get(block, 0) + calls
        ledger.batched_steps += 1
        ledger.batch_rows += rows


STEPPER_ACTIVITIES = ("decode", "packed", "jobs", "gather", "idle")  # what the stepper's wall time is split into


@dataclass(frozen=True)
class StepperTime:
    """Where the stepper's wall time went since it started, in seconds (measured with a monotonic clock): what
    says why b requests decoding together get less than b times one request's throughput.

    decode: batched decode steps; packed: prefill chunks with the due decode rows riding along (`packed_pass`);
    jobs: work run alone between steps (prefill chunks with no row to take along, quality passes); gather: waiting,
    with rows due, for the other decoding requests' next rows (they detokenize and stream their last token
    meanwhile); idle: nothing to run."""

    jobs_s: float = 0.0
    packed_s: float = 0.0
    packed: int = 0  # packed passes run
    packed_rows: int = 0  # decode rows they took along
    gather_s: float = 0.0
    idle_s: float = 0.0
    jobs: int = 0
    step_s_by_rows: dict[int, float] = field(default_factory=dict)  # rows -> seconds of the steps of that many
    steps_by_rows: dict[int, int] = field(default_factory=dict)  # rows -> decode steps run with that many

    @property
    def decode_s(self) -> float:
        return sum(self.step_s_by_rows.values())

    def seconds_by_activity(self) -> dict[str, float]:
        """Seconds per activity of STEPPER_ACTIVITIES, in that order."""
        return {"decode": self.decode_s, "packed": self.packed_s, "jobs": self.jobs_s, "gather": self.gather_s,
                "idle": self.idle_s}


@dataclass
class _Row:
    """One request's next decode step, waiting for the stepper."""

    sequence: BatchedSequence
    token: int
    position: int
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class _Chunk:
    """A prompt chunk to prefill (`packed_pass`): its token ids, its first position and the request's cache."""

    sequence: BatchedSequence
    ids: tuple[int, ...]
    start: int
    keep_all: bool  # every row's logits (an echoed prompt): run alone


@dataclass
class _Job:
    """Work that runs on the stepper (a prefill chunk, a quality pass), in its submitter's context: alone, or for a
    prefill chunk packed with the decode rows due (`chunk`)."""

    context: contextvars.Context
    fn: Callable[[], Any]
    chunk: _Chunk | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class BatchedSequence:
    """One request in the batcher: its plan, ledger and cache; `run` for its prefill, `step` per token."""

    def __init__(self, batcher: DecodeBatcher, plan: ExecutionPlan, ledger: ExecutionLedger, cache: Any) -> None:
        self.batcher = batcher
        self.plan = plan
        self.ledger = ledger
        self.cache = cache
        self.key = batch_key(plan)
        self.decoding = False  # joined the decode steps (after its prefill)

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the stepper, between decode steps, in this thread's context (its plan and ledger)."""
        return self.batcher.run(fn)

    def prefill(self, ids: Sequence[int], start: int, keep_all: bool = False) -> torch.Tensor:
        """Prefill the prompt positions `ids` from `start` into this request's cache, on the stepper, in this thread's
        context: the chunk's logits (its last row, or every row with `keep_all`). The due decode rows that may share
        its pass ride along (`packed_pass`)."""
        chunk = _Chunk(self, tuple(ids), start, keep_all)
        return self.batcher._submit(_Job(contextvars.copy_context(),
                                         lambda: packed_pass(self.batcher.instrumented.model, chunk.ids, start,
                                                             self.cache, keep_all=keep_all)[0], chunk))

    def step(self, token: int, position: int) -> torch.Tensor:
        """The logits (vocab,) after `token` at `position`, from a decode step shared with the other requests."""
        return self.batcher._step(self, token, position)


class DecodeBatcher:
    """Runs every forward pass of the requests it holds on one stepper thread with `threads` intra-op threads,
    decode steps batched up to `max_batch` rows."""

    def __init__(self, instrumented: InstrumentedModel, max_batch: int, threads: int | None = None, *,
                 gather_s: float = 0.05, sparse_rows: int = 1,
                 kv_bytes_per_token: int = 0, kv_budget_bytes: int | None = None) -> None:
        if max_batch < 1 or gather_s < 0 or sparse_rows < 0 or kv_bytes_per_token < 0:
            raise ValueError(f"max_batch must be >= 1, gather_s, sparse_rows and kv_bytes_per_token >= 0, got "
                             f"{max_batch}, {gather_s}, {sparse_rows}, {kv_bytes_per_token}")
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1 or None (no bound), got {kv_budget_bytes}")
        self.instrumented = instrumented
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.sparse_rows = sparse_rows
        self.kv_bytes_per_token = kv_bytes_per_token  # every layer's key and value of one token
        self.kv_budget_bytes = kv_budget_bytes  # None: no bound
        self.kv_reserved_bytes = 0  # held by the requests in the batcher now
        self.kv_peak_bytes = 0  # the most held at once
        self.kv_waits = 0  # requests that waited for cache room
        self._time = StepperTime()  # replaced whole under the lock (readers take a consistent copy)
        install_ragged_attention(instrumented.model)
        self._cond = threading.Condition()
        self._rows: list[_Row] = []
        self._jobs: deque[_Job] = deque()
        self._decoding = 0  # sequences between their prefill and their end
        self._closed = False
        self.packs = packable(instrumented)  # prefill chunks take the due decode rows along
        self._stepper = start_generation_thread(self._loop, threads, name="prunewatch-step")

    @property
    def decoding(self) -> int:
        """Requests between their prefill and their end: those a decode step waits for."""
        return self._decoding

    @property
    def batch_sizes(self) -> dict[int, int]:
        """Rows -> decode steps run with that many, so far."""
        return self.stepper_time().steps_by_rows

    def stepper_time(self) -> StepperTime:
        """Where the stepper's time went so far (a snapshot; safe to call from any thread)."""
        with self._cond:
            return self._time

    # -- request side ----------------------------------------------------------------------------------
    def kv_bytes_for(self, tokens: int) -> int:
        """The KV cache `tokens` positions can fill: what a request of that length reserves."""
        return max(0, tokens) * self.kv_bytes_per_token

    def check_fits(self, tokens: int) -> None:
        """Raise KVBudgetError when a request of `tokens` positions could never fit in the budget."""
        need = self.kv_bytes_for(tokens)
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise KVBudgetError(
                f"the prompt plus max new tokens ({tokens} positions) need {need / 2**20:.1f} MiB of KV cache, more "
                f"than the server's whole KV budget of {self.kv_budget_bytes / 2**20:.1f} MiB; shorten the prompt or "
                f"max_tokens, or raise the budget")

    @contextlib.contextmanager
    def sequence(self, plan: ExecutionPlan, ledger: ExecutionLedger, cache: Any,
                 kv_tokens: int = 0) -> Iterator[BatchedSequence]:
        """Hold one request in the batcher for the length of the block, with the KV cache of `kv_tokens` positions
        reserved (waiting for room first); it leaves the decode steps and gives the room back on exit."""
        self.check_fits(kv_tokens)
        need = self.kv_bytes_for(kv_tokens)
        with self._cond:
            waited = False
            while (not self._closed and self.kv_budget_bytes is not None
                   and self.kv_reserved_bytes + need > self.kv_budget_bytes):
                waited = True
                self._cond.wait()
            if self._closed:
                raise BatcherClosedError("the decode batcher is closed")
            self.kv_waits += waited
            self.kv_reserved_bytes += need
            self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_reserved_bytes)
        sequence = BatchedSequence(self, plan, ledger, cache)
        try:
            yield sequence
        finally:
            with self._cond:
                self.kv_reserved_bytes -= need
                if sequence.decoding:
                    sequence.decoding = False
                    self._decoding -= 1
                self._cond.notify_all()

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the stepper alone, in the caller's context; its exception is raised here."""
        return self._submit(_Job(contextvars.copy_context(), fn))

    def _submit(self, job: _Job) -> Any:
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the decode batcher is closed")
            self._jobs.append(job)
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _step(self, sequence: BatchedSequence, token: int, position: int) -> torch.Tensor:
        row = _Row(sequence, token, position)
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the decode batcher is closed")
            if not sequence.decoding:
                sequence.decoding = True
                self._decoding += 1
            self._rows.append(row)
            self._cond.notify_all()
        row.done.wait()
        if row.error is not None:
            raise row.error
        assert row.logits is not None
        return row.logits

    def close(self) -> None:
        """Stop the stepper; requests waiting on it fail with BatcherClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- stepper side ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_was_step = False
        while True:
            with self._cond:
                started = time.perf_counter()
                while not self._closed and not self._rows and not self._jobs:
                    self._cond.wait()
                waited = time.perf_counter()
                if self._closed:
                    self._fail_waiting()
                    return
                along: list[_Row] = []
                if self._jobs and (not self._rows or last_was_step):
                    job = self._jobs.popleft()
                    work: _Job | list[_Row] = job
                    chunk = job.chunk
                    if chunk is not None and self.packs and not chunk.keep_all and self._decoding:
                        self._gather()
                        along = self._take_rows(chunk.sequence.key) if self._rows else []
                else:
                    self._gather()
                    work = self._take_rows()
                ran = time.perf_counter()
                self._time = replace(self._time, idle_s=self._time.idle_s + waited - started,
                                     gather_s=self._time.gather_s + ran - waited)
            if isinstance(work, _Job) and along:
                self._run_packed(work, along)
                last_was_step = True  # the rows took their step: a job waiting next runs before the next step
            elif isinstance(work, _Job):
                self._run_job(work)
                last_was_step = False
            else:
                self._run_rows(work)
                last_was_step = True

    def _record(self, rows: int, seconds: float, packed: bool = False) -> None:
        """Add one step of `rows` rows (0: a job; `packed`: a packed pass taking `rows` rows along) that took
        `seconds` to the stepper's time (lock held)."""
        t = self._time
        if packed:
            self._time = replace(t, packed_s=t.packed_s + seconds, packed=t.packed + 1,
                                 packed_rows=t.packed_rows + rows)
            return
        if rows == 0:
            self._time = replace(t, jobs_s=t.jobs_s + seconds, jobs=t.jobs + 1)
            return
        self._time = replace(t, step_s_by_rows={**t.step_s_by_rows, rows: t.step_s_by_rows.get(rows, 0.0) + seconds},
                             steps_by_rows={**t.steps_by_rows, rows: t.steps_by_rows.get(rows, 0) + 1})

    def _gather(self) -> None:
        """Wait (lock held) up to gather_s for every decoding request to have its next step due."""
        deadline = time.monotonic() + self.gather_s
        while not self._closed and len(self._rows) < min(self._decoding, self.max_batch):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)

    def _take_rows(self, key: tuple | None = None) -> list[_Row]:
        """The due rows that may share a step with the oldest (or that have batch key `key`), up to max_batch."""
        key = self._rows[0].sequence.key if key is None else key
        taken = [r for r in self._rows if r.sequence.key == key][:self.max_batch]
        chosen = {id(r) for r in taken}
        self._rows = [r for r in self._rows if id(r) not in chosen]
        return taken

    def _fail_waiting(self) -> None:
        error = BatcherClosedError("the decode batcher closed while the request waited")
        waiting: list[_Row | _Job] = [*self._rows, *self._jobs]
        for item in waiting:
            item.error = error
            item.done.set()
        self._rows, self._jobs = [], deque()

    def _run_job(self, job: _Job) -> None:
        started = time.perf_counter()
        try:
            job.result = job.context.run(job.fn)
        except BaseException as exc:  # handed to the submitter, which raises it in its request
            job.error = exc
        finally:
            with self._cond:
                self._record(0, time.perf_counter() - started)
            job.done.set()

    @torch.no_grad()
    def _run_packed(self, job: _Job, rows: list[_Row]) -> None:
        """A prefill chunk and the decode rows `rows` in one packed pass (`packed_pass`), in the chunk's request's
        context; the rows' counts are split among them as a step's are."""
        assert job.chunk is not None
        chunk = job.chunk
        model: Any = self.instrumented.model
        started = time.perf_counter()
        plan = batch_plan([r.sequence.plan for r in rows], self.instrumented.num_layers, self.sparse_rows)
        total = ExecutionLedger()

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            with packed_tail(PackedTail(len(rows), plan, total)):
                return packed_pass(model, chunk.ids, chunk.start, chunk.sequence.cache, [r.token for r in rows],
                                   [r.position for r in rows], [r.sequence.cache for r in rows])

        try:
            job.result, logits = job.context.run(run)
            assert logits is not None
            split_ledger(total, [r.sequence.ledger for r in rows])
            for index, row in enumerate(rows):
                row.logits = logits[index]
        except BaseException as exc:  # the chunk and every row of the pass fail with it
            logger.exception("packed pass of a prefill chunk and %d decode rows failed", len(rows))
            job.error = exc
            for row in rows:
                row.error = exc
        finally:
            with self._cond:
                self._record(len(rows), time.perf_counter() - started, packed=True)
            job.done.set()
            for row in rows:
                row.done.set()

    @torch.no_grad()
    def _run_rows(self, rows: list[_Row]) -> None:
        model: Any = self.instrumented.model
        started = time.perf_counter()
        try:
            plan = batch_plan([r.sequence.plan for r in rows], self.instrumented.num_layers, self.sparse_rows)
            total = ExecutionLedger()
            with executing(plan, total):
                logits = ragged_decode_step(model, [r.token for r in rows], [r.position for r in rows],
                                            [r.sequence.cache for r in rows])
            split_ledger(total, [r.sequence.ledger for r in rows])
            for index, row in enumerate(rows):
                row.logits = logits[index]
        except BaseException as exc:  # every row of the step fails with it
            logger.exception("batched decode step of %d rows failed", len(rows))
            for row in rows:
                row.error = exc
        finally:
            with self._cond:  # before the rows go on: a request that reads the counts sees its own step
                self._record(len(rows), time.perf_counter() - started)
            for row in rows:
                row.done.set()

