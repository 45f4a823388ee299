"""Run a transformers model under a per-request execution plan and count the work that really ran.

The count comes from what the plan decided and what the kernels report, never from a Python hook
on every linear layer per token (that hook cost 16% of the decode speed of a 30-block model):
- `BypassBlock` wraps each decoder block. When the active plan bypasses the block, it returns the
  residual stream unchanged *before* any of the block's work runs (packed as the block packs its
  own output: a tensor, or a tuple for families such as Falcon); otherwise it calls the block.
  Either way it adds the dense cost of that block for the tokens it saw to the ledger; when the
  block runs it also adds, as executed, the work of the linear layers the block really calls (seen
  once, at wrap time, by a dense pass with temporary hooks, so a linear that a family never calls
  is never counted).
- Modules inside a block that compute less than their dense linear layer (the sparse kernel of
  prunewatch.engine.sparse, gated heads of prunewatch.engine.heads) report the work they skipped with
  `record_skipped_work`: the kernel's count of the weight rows it did not read.
- one forward hook on the output head (one call per forward pass) adds the head's work.
- A packed pass (prunewatch.engine.batching.packed_pass) holds a prompt chunk's rows under its request's plan and
  other requests' decode rows under their step's: `packed_tail` marks the decode rows, and through `per_segment`
  the wrappers compute and count each part apart, blocks count each part's rows in its own ledger.
pruning_ratio = 1 - executed / dense. A block that ran and whose output was discarded still counts
as executed. The ratio is never clamped: a negative value means work was over-counted, and the
ledger logs a warning and says so (`overcounted`). An independent, hook-per-linear count is kept
as the tests' oracle (tests/engine/sparse_oracle.py).

The active plan and ledger live in a ContextVar, so concurrent requests on different threads never
see each other's plans or counts. No transformers forward code is copied: blocks are wrapped and
the head is hooked, nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from prunewatch.engine.errors import InvalidRequestError, UnsupportedArchitectureError

logger = logging.getLogger(__name__)

MAX_SPARSITY = 0.95  # highest per-layer target a family factor can lift a request to
_BLOCK_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")


@dataclass(frozen=True)
class ExecutionPlan:
    """What a request skips, fixed before its prefill so the KV cache stays consistent."""

    bypass: frozenset[int] = frozenset()  # decoder block indices returned as identity
    # Activation sparsity (prunewatch.engine.sparse): target share of each wrapped linear layer's input entries
    # zeroed per token row; 0 runs those layers dense. Only acts where prunewatch.engine.sparse is installed.
    activation_sparsity: float = 0.0
    # Per-layer targets overriding activation_sparsity when non-empty (one per decoder block), so a
    # plan can protect transition or blacklisted layers with 0.0.
    layer_sparsity: tuple[float, ...] = ()
    # "row": per-row calibrated thresholds; a batch reads the union of its rows' active channels.
    # "shared": at decode steps the batch shares the top-(1 - s) channels of its summed scores.
    sparsity_policy: str = "row"
    # Attention heads not computed, per decoder block (prunewatch.engine.heads); empty: every head runs.
    gated_heads: tuple[frozenset[int], ...] = ()
    # Per projection family (prunewatch.engine.sparse.targets.PROJECTION_FAMILIES), a factor on the layer's
    # target: small models tolerate very different sparsity on attention-output and MLP inputs.
    # Missing families keep factor 1; the product is capped at MAX_SPARSITY.
    family_scale: tuple[tuple[str, float], ...] = ()
    # Output head (prunewatch.engine.sparse.output_head): share of its input entries zeroed per token row for the
    # approximate logits, and how many of the highest are then computed exactly. 0 runs the head dense.
    output_head_sparsity: float = 0.0
    output_head_candidates: int = 1024
    # A call of the head with more rows than a decode step normally applies the same masks in one dense product
    # (teacher-forced scoring), which does more work than the dense head; True runs every row through the
    # kernel instead, as a decode step would: an echoed prompt's logprobs are the request's own prefill work.
    output_head_row_kernel: bool = False
    # Every row of a call with few rows is computed as it would be alone, whatever the other rows are: dense
    # products of wrapped layers and of the output head run through the engine's own products (csrc/fp32_dense.cpp
    # for fp32 weights: each row's sums in the same order at any row count) instead of BLAS (whose GEMM blocking,
    # and so its rounding, changes with the row count). Set for requests decoded together
    # (prunewatch.engine.batching), so a dense request's tokens do not depend on who shares its steps, and for
    # eager decoding on the CPU alone (PruningEngine._decode), so a request decodes the same tokens in process as
    # served.
    row_invariant: bool = False

    def __post_init__(self) -> None:
        targets = (self.activation_sparsity, *self.layer_sparsity)
        if any(not 0.0 <= float(t) < 1.0 for t in targets):
            raise InvalidRequestError(f"activation sparsity targets must be in [0, 1), got {targets}")
        if any(not 0.0 <= float(f) <= 4.0 for _, f in self.family_scale):
            raise InvalidRequestError(f"family sparsity factors must be in [0, 4], got {self.family_scale}")
        if self.sparsity_policy not in ("row", "shared"):
            raise InvalidRequestError(f"sparsity_policy must be 'row' or 'shared', got {self.sparsity_policy!r}")
        if not 0.0 <= float(self.output_head_sparsity) < 1.0:
            raise InvalidRequestError(f"output head sparsity must be in [0, 1), got {self.output_head_sparsity}")
        if int(self.output_head_candidates) < 1:
            raise InvalidRequestError(f"output head candidates must be >= 1, got {self.output_head_candidates}")

    @property
    def skips_work(self) -> bool:
        """Whether this plan can differ from the dense model (a bypass, or any sparsity target)."""
        return (bool(self.bypass) or self.activation_sparsity > 0 or any(t > 0 for t in self.layer_sparsity)
                or self.heads_gated > 0 or self.output_head_sparsity > 0)

    def heads_gated_in(self, layer: int) -> frozenset[int]:
        """Query heads of one decoder block this plan does not compute."""
        return self.gated_heads[layer] if layer < len(self.gated_heads) else frozenset()

    @property
    def heads_gated(self) -> int:
        """How many (block, head) pairs are gated in blocks that run (a bypassed block gates nothing)."""
        return sum(len(g) for i, g in enumerate(self.gated_heads) if i not in self.bypass)

    def sparsity_for(self, layer: int, family: str | None = None) -> float:
        """The activation sparsity target of one decoder block (and projection family) under this plan."""
        if self.layer_sparsity:
            target = float(self.layer_sparsity[layer]) if layer < len(self.layer_sparsity) else 0.0
        else:
            target = float(self.activation_sparsity)
        if family is not None and target > 0.0 and self.family_scale:
            target = min(MAX_SPARSITY, target * dict(self.family_scale).get(family, 1.0))
        return target


@dataclass
class ExecutionLedger:
    """Work counted while a request ran (FLOPs of linear layers)."""

    executed_flops: int = 0
    dense_flops: int = 0
    weight_bytes_read: int = 0  # weights of every executed linear call, once per call
    kv_bytes_read: int = 0  # KV cache bytes the executed attention layers read (model-level count)
    block_calls: dict[int, int] = field(default_factory=dict)  # block -> times it executed
    block_bypasses: dict[int, int] = field(default_factory=dict)  # block -> times it was skipped
    # Linear layers wrapped for activation sparsity (prunewatch.engine.sparse), counted while a plan asked for it:
    sparse_dense_flops: int = 0  # what those calls would have cost dense
    sparse_executed_flops: int = 0  # what they executed (kernel: 2 x active inputs x out x rows)
    sparse_input_entries: int = 0  # (row, input channel) entries they received
    sparse_kept_entries: int = 0  # ... of which survived the thresholds
    # Snapshot of the two totals when the prompt's forward pass (the prefill) ended; None before.
    prefill_executed_flops: int | None = None
    prefill_dense_flops: int | None = None
    prefill_sparse_dense_flops: int = 0  # ... and of the sparsity-wrapped subtotal
    prefill_sparse_executed_flops: int = 0
    prefill_bytes_read: int = 0  # weight_bytes_read + kv_bytes_read at the end of the prefill
    # Decode steps this request shared with others (prunewatch.engine.batching), and the rows of those steps.
    batched_steps: int = 0
    batch_rows: int = 0
    # Prompt positions whose keys and values were copied from the prefix cache (prunewatch.engine.prefix_cache).
    # A prompt's head is the cache's work, hit or miss, so it is in no count above either way.
    cached_prompt_tokens: int = 0
    # Set once the over-counting warning was logged, so reading the ratios again does not repeat it.
    _overcount_warned: bool = field(default=False, repr=False, compare=False)

    @property
    def overcounted(self) -> bool:
        """More work counted as executed than the dense model would do: a counting bug, never a saving.

        Executed work is counted by the linear layers (or kernels) that ran and dense work by the
        blocks that were entered, so executed <= dense must hold for every request and for the
        activation-sparsity subtotal; the ratios report the true, negative value when it does not.
        """
        return (self.executed_flops > self.dense_flops
                or self.sparse_executed_flops > self.sparse_dense_flops
                or self.sparse_kept_entries > self.sparse_input_entries)

    def _ratio(self, executed: int, dense: int) -> float:
        """1 - executed / dense, unclamped: a negative value exposes over-counting instead of hiding it."""
        if dense <= 0:
            return 0.0
        ratio = 1.0 - executed / dense
        if ratio < 0.0 and not self._overcount_warned:
            self._overcount_warned = True
            logger.warning("execution ledger over-counts: %d FLOPs executed against %d dense (ratio %.6f); "
                           "some work was counted twice, or counted outside a block that added its dense cost",
                           executed, dense, ratio)
        return ratio

    @property
    def mean_batch_size(self) -> float:
        """Rows per decode step this request ran in (1.0 when it never shared one)."""
        return self.batch_rows / self.batched_steps if self.batched_steps else 1.0

    @property
    def pruning_ratio(self) -> float:
        return self._ratio(self.executed_flops, self.dense_flops)

    def end_prefill(self) -> None:
        """Mark the end of the prefill: what was counted so far is the prompt's work."""
        self.prefill_executed_flops, self.prefill_dense_flops = self.executed_flops, self.dense_flops
        self.prefill_sparse_dense_flops, self.prefill_sparse_executed_flops = (
            self.sparse_dense_flops, self.sparse_executed_flops)
        self.prefill_bytes_read = self.weight_bytes_read + self.kv_bytes_read

    @property
    def decode_bytes_read(self) -> int:
        """Weight and KV cache bytes the decode steps read (everything counted after the prefill)."""
        if self.prefill_dense_flops is None:
            return 0
        return self.weight_bytes_read + self.kv_bytes_read - self.prefill_bytes_read

    @property
    def decode_sparse_dense_flops(self) -> int:
        """Dense cost of the decode steps' calls to sparsity-wrapped layers that ran under a target."""
        if self.prefill_dense_flops is None:
            return 0
        return self.sparse_dense_flops - self.prefill_sparse_dense_flops

    @property
    def prefill_pruning_ratio(self) -> float:
        """Ratio over the prompt's forward pass alone (many rows: compute-bound, rarely sparse)."""
        if self.prefill_dense_flops is None:
            return self.pruning_ratio
        return self._ratio(self.prefill_executed_flops or 0, self.prefill_dense_flops)

    @property
    def decode_pruning_ratio(self) -> float:
        """Ratio over the decode steps alone (one row each: memory-bound, where skipping saves time)."""
        if self.prefill_dense_flops is None:
            return 0.0
        return self._ratio(self.executed_flops - (self.prefill_executed_flops or 0),
                           self.dense_flops - self.prefill_dense_flops)

    @property
    def activation_sparsity(self) -> float:
        """Share of the sparsity-wrapped linears' work skipped (union over a batch's rows)."""
        return self._ratio(self.sparse_executed_flops, self.sparse_dense_flops)

    @property
    def decode_activation_sparsity(self) -> float:
        """Activation sparsity of the decode steps alone: the shape of one decode step, which is what a
        per-step measurement (Nsight Compute's, prunewatch.engine.dram_profile) describes."""
        if self.prefill_dense_flops is None:
            return 0.0
        return self._ratio(self.sparse_executed_flops - self.prefill_sparse_executed_flops,
                           self.sparse_dense_flops - self.prefill_sparse_dense_flops)

    @property
    def input_sparsity(self) -> float:
        """Share of input entries zeroed per row, what the thresholds were calibrated to reach."""
        if self.sparse_input_entries <= 0:
            return 0.0
        return 1.0 - self.sparse_kept_entries / self.sparse_input_entries


@dataclass
class _Active:
    plan: ExecutionPlan
    ledger: ExecutionLedger


_ACTIVE: ContextVar[_Active | None] = ContextVar("prunewatch_active_execution", default=None)


@dataclass
class CompiledStepMode:
    """What the wrapped modules compute while torch.compile traces a decode step (prunewatch.engine.compiled_decode).

    A compiled graph cannot read the request's plan from a context variable or write to its ledger, so
    the wrappers read these switches instead; each combination is one graph (Dynamo guards on them, and on
    nothing of the model's modules: prunewatch.engine.compiled_decode drops those guards).
    Per-request values that would otherwise recompile (thresholds, the head's top-k size) are tensors.
    """

    sparse: bool = False  # activation-sparsity wrappers call the counted kernel (prunewatch.engine.sparse.module)
    output_head: bool = False  # the shortlist head runs sparse (prunewatch.engine.sparse.output_head)
    shortlist: int = 1  # logits the sparse head recomputes exactly: a setting, so a constant of its graph


COMPILED_STEP = CompiledStepMode()


@contextlib.contextmanager
def executing(plan: ExecutionPlan, ledger: ExecutionLedger) -> Iterator[ExecutionLedger]:
    """Make `plan` govern, and `ledger` count, every forward pass in this context."""
    token = _ACTIVE.set(_Active(plan, ledger))
    try:
        yield ledger
    finally:
        _ACTIVE.reset(token)


@dataclass(frozen=True)
class PackedTail:
    """The last `rows` token rows of a packed forward pass (prunewatch.engine.batching.packed_pass): decode rows of
    other requests riding along a prompt's prefill chunk, under their step's plan and counted in its ledger. The rows
    before them are the chunk's, under the active execution (the prompt's request)."""

    rows: int
    plan: ExecutionPlan
    ledger: ExecutionLedger


_TAIL: ContextVar[PackedTail | None] = ContextVar("prunewatch_packed_tail", default=None)


@contextlib.contextmanager
def packed_tail(tail: PackedTail) -> Iterator[None]:
    """Make the forward passes in this context packed ones whose last `tail.rows` rows are `tail`'s."""
    token = _TAIL.set(tail)
    try:
        yield
    finally:
        _TAIL.reset(token)


Segment = tuple[torch.Tensor, ExecutionPlan, ExecutionLedger]  # one part's rows, and the plan and ledger it runs under


def per_segment(x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
                joined: Callable[[Segment, Segment], torch.Tensor | None] | None = None) -> torch.Tensor | None:
    """In a packed pass: `forward` on the chunk's rows of `x` (..., rows, features) under the active execution, then
    on the tail's under the tail's, joined along the rows; None outside one (the caller computes `x` whole).

    Why per segment: each part then runs the products it runs alone, with the same shapes and kernels (the chunk's
    rows through BLAS or the kernel as its prefill would, the decode rows through the row-invariant products of a
    decode step), so sharing a pass changes no bit of either, and each part is counted in its own ledger.

    `joined`, where given, is tried first: both parts in one call, counted per part, or None where that call would
    not give each part the bits of its own (a product whose rows' sums depend on their row alone, run by both parts
    alone, can take them in one call: SparseLinear's fp32 row-invariant product)."""
    tail = _TAIL.get()
    if tail is None or torch.compiler.is_compiling():
        return None
    cut = x.shape[-2] - tail.rows
    active = _ACTIVE.get()
    if joined is not None and active is not None:
        both = joined((x[..., :cut, :], active.plan, active.ledger), (x[..., cut:, :], tail.plan, tail.ledger))
        if both is not None:
            return both
    token = _TAIL.set(None)  # the parts are plain calls: `forward` does not split them again
    try:
        chunk = forward(x[..., :cut, :])
        with executing(tail.plan, tail.ledger):
            rest = forward(x[..., cut:, :])
    finally:
        _TAIL.reset(token)
    return torch.cat((chunk, rest), dim=-2)


@contextlib.contextmanager
def outside_execution() -> Iterator[None]:
    """Run forward passes with no plan in force and nothing counted (a compiled step counts itself)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_execution() -> tuple[ExecutionPlan, ExecutionLedger] | None:
    """The plan and ledger of the forward pass running in this context, if any.

    For modules that wrap a linear layer and compute it themselves (prunewatch.engine.sparse): they read the
    plan to decide, and take what they did not execute off the block's count with `record_skipped_work`.
    """
    active = _ACTIVE.get()
    return None if active is None else (active.plan, active.ledger)


def record_skipped_work(skipped_flops: int, skipped_bytes: int, ledger: ExecutionLedger | None = None) -> None:
    """Take work that a module inside a running block did not do off that block's executed count.

    A running block counts its linear layers' dense work as executed; a module that computed less
    (the sparse kernel: weight rows of inactive channels never read; gated heads: their slices)
    reports the difference here, from what it really ran. `ledger`: the one in hand, if the caller
    already looked the active execution up.
    """
    if ledger is None:
        active = _ACTIVE.get()
        if active is None:
            return
        ledger = active.ledger
    ledger.executed_flops -= int(skipped_flops)
    ledger.weight_bytes_read -= int(skipped_bytes)


def _linear_flops_per_row(module: nn.Module) -> int | None:
    """2 x in x out for nn.Linear and GPT-2's Conv1D (weight stored transposed); None otherwise."""
    if isinstance(module, nn.Linear):
        return 2 * module.in_features * module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        n_in, n_out = module.weight.shape
        return 2 * int(n_in) * int(n_out)
    return None


def _rows(tensor: torch.Tensor) -> int:
    return int(tensor.numel() // tensor.shape[-1])


def _count_head(flops_per_row: int) -> Callable:
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            return  # a compiled decode step is counted from its plan (prunewatch.engine.compiled_decode)
        active = _ACTIVE.get()
        if active is not None:
            work = flops_per_row * _rows(inputs[0])
            active.ledger.executed_flops += work
            active.ledger.dense_flops += work  # a dense call of the head (the shortlist head counts its own pruned calls)
            active.ledger.weight_bytes_read += module.weight.numel() * module.weight.element_size()

    return hook


class BypassBlock(nn.Module):
    """A decoder block that the active plan can turn into the identity on the residual stream.

    The identity has the shape of the wrapped block's own output, because the family's decoder loop
    unpacks it: Llama-like blocks of transformers 5.x return the hidden states (B, T, C), Falcon's
    return a tuple (hidden states, attention weights). The shape is learned from the block's real
    output on every call it makes (`instrument` makes one dense call at wrap time), never from the
    family's code; a bypass returns (hidden states, None, ...) for a tuple of n: nothing was computed.
    """

    def __init__(self, block: nn.Module, index: int, dense_flops_per_row: int, weight_bytes: int = 0) -> None:
        super().__init__()
        self.block = block
        self.index = index
        self.dense_flops_per_row = dense_flops_per_row  # every linear layer inside, one token row
        # What a call of the block executes when nothing inside skips work: its linear layers that the
        # family's forward really calls (`_learn_block_outputs` finds them; until then, all of them).
        self.executed_flops_per_row = dense_flops_per_row
        self.weight_bytes = weight_bytes  # bytes of those layers' weights, read once per call
        # None: the block has not run yet; 0: it returns a bare tensor; n >= 1: a tuple of n items
        # whose first is the hidden states.
        self.output_arity: int | None = None

    def __getattr__(self, name: str):
        # transformers reads attributes such as `attention_type` off its decoder layers.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():  # compiled decode steps never bypass; counted from the plan
            return self.block(hidden_states, *args, **kwargs)
        active = _ACTIVE.get()
        if active is None:
            return self._run(hidden_states, *args, **kwargs)
        rows = _rows(hidden_states)
        tail = _TAIL.get()
        # A packed pass (the batcher runs one only for plans that bypass the same blocks): each part counts its rows,
        # and the weights once, in its own ledger, as its pass alone would.
        parts = ([(active.ledger, rows)] if tail is None else
                 [(active.ledger, rows - tail.rows), (tail.ledger, tail.rows)])
        bypass = self.index in active.plan.bypass
        for ledger, part_rows in parts:
            ledger.dense_flops += self.dense_flops_per_row * part_rows
            if bypass:
                ledger.block_bypasses[self.index] = ledger.block_bypasses.get(self.index, 0) + 1
                continue
            ledger.block_calls[self.index] = ledger.block_calls.get(self.index, 0) + 1
            # Counted before the call: modules inside that skip work take it off (record_skipped_work).
            ledger.executed_flops += self.executed_flops_per_row * part_rows
            ledger.weight_bytes_read += self.weight_bytes
        if bypass:
            return self._identity(hidden_states)  # this block's KV cache is never written
        return self._run(hidden_states, *args, **kwargs)

    def _run(self, hidden_states: torch.Tensor, *args, **kwargs):
        output = self.block(hidden_states, *args, **kwargs)
        self.output_arity = len(output) if isinstance(output, tuple) else 0
        return output

    def _identity(self, hidden_states: torch.Tensor):
        """The residual stream unchanged, packed the way the wrapped block packs its output."""
        arity = self.output_arity
        if arity is None:
            raise UnsupportedArchitectureError(
                f"decoder block {self.index} ({type(self.block).__name__}) has not run yet, so the shape of its "
                "output is unknown and it cannot be bypassed; run one dense forward pass first (instrument() "
                "and calibration do)")
        if arity == 0:
            return hidden_states  # (B, T, C)
        return (hidden_states,) + (None,) * (arity - 1)  # e.g. Falcon: (hidden states, attention weights)


def find_decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """Locate the decoder block list of a causal LM (Llama, Qwen2, Mistral, Phi-3, Gemma, StableLM, GPT-2,
    GPT-NeoX, OPT, Falcon)."""
    for path in _BLOCK_PATHS:
        node: object = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList) and len(node) > 0:
            return node
    raise UnsupportedArchitectureError(
        f"cannot find the decoder blocks of {type(model).__name__} (looked for {', '.join(_BLOCK_PATHS)}); "
        "prunewatch prunes decoder-only transformers such as Llama, Mistral, Qwen2, Gemma, Phi-3, StableLM, "
        "GPT-2, GPT-NeoX, OPT and Falcon: serve one of those"
    )


@dataclass(frozen=True)
class InstrumentedModel:
    """A model whose blocks are wrapped (and counted) and whose output head is counted."""

    model: nn.Module
    blocks: list[BypassBlock]
    dense_flops_per_token: int  # all blocks + head, one token row each

    @property
    def num_layers(self) -> int:
        return len(self.blocks)


def instrument(model: nn.Module) -> InstrumentedModel:
    """Wrap every decoder block and hook the output head; idempotent for an instrumented model."""
    block_list = find_decoder_blocks(model)
    if all(isinstance(b, BypassBlock) for b in block_list):
        wrapped = list(block_list)
    else:
        wrapped = []
        for index, block in enumerate(block_list):
            per_row = weight_bytes = 0
            for module in block.modules():
                flops = _linear_flops_per_row(module)
                if flops is not None:
                    per_row += flops
                    weight_bytes += module.weight.numel() * module.weight.element_size()
            if per_row == 0:
                raise UnsupportedArchitectureError(
                    f"decoder block {index} of {type(model).__name__} has no linear layers to count"
                )
            wrapper = BypassBlock(block, index, per_row, weight_bytes)
            block_list[index] = wrapper
            wrapped.append(wrapper)
        head = model.get_output_embeddings()
        head_flops = _linear_flops_per_row(head) if head is not None else None
        if head_flops is None:
            raise UnsupportedArchitectureError(f"{type(model).__name__} has no linear output head")
        head.register_forward_hook(_count_head(head_flops))
    if any(b.output_arity is None for b in wrapped):
        _learn_block_outputs(model, wrapped)
    head = model.get_output_embeddings()
    if head is not None and not isinstance(head, nn.Linear) and isinstance(getattr(head, "linear", None), nn.Linear):
        head = head.linear  # the shortlist head (prunewatch.engine.sparse.output_head) wraps the model's own
    per_token = sum(b.dense_flops_per_row for b in wrapped) + (_linear_flops_per_row(head) or 0)
    return InstrumentedModel(model=model, blocks=wrapped, dense_flops_per_token=per_token)


def _learn_block_outputs(model: nn.Module, blocks: list[BypassBlock]) -> None:
    """One dense, cache-less forward pass of a single token, outside any plan (so nothing is counted),
    for every block to show the shape of its output before any request can bypass it, and which of
    its linear layers its forward really calls (temporary hooks, removed after this one pass)."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type == "meta":
        return  # nothing to run yet: the blocks learn on their first real call
    called: dict[int, list[tuple[int, int]]] = {b.index: [] for b in blocks}
    handles = []
    for b in blocks:
        for module in b.block.modules():
            flops = _linear_flops_per_row(module)
            if flops is not None:
                work = (flops, module.weight.numel() * module.weight.element_size())
                handles.append(module.register_forward_hook(
                    lambda _m, _i, _o, index=b.index, work=work: called[index].append(work)))
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=parameter.device), use_cache=False)  # (1, 1)
    finally:
        for handle in handles:
            handle.remove()
    unseen = [b.index for b in blocks if b.output_arity is None]
    if unseen:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}'s forward pass did not call decoder blocks {unseen}; they cannot be "
            "wrapped for bypass")
    for b in blocks:
        b.executed_flops_per_row = sum(flops for flops, _ in called[b.index])
        b.weight_bytes = sum(nbytes for _, nbytes in called[b.index])
