"""A compiled decode step: one token through the whole model as one torch.compile graph.

Why: at one token per step the eager model pays Python and per-operator dispatch for every norm,
rotary embedding, cache update and residual add of every block; on SmolLM2-135M at one thread that
is a quarter to a third of a step, time in which no weight byte is read. Compiled, the step is one
graph of fused C++ loops around the matrix products and the sparse kernel (registered as the operator
`prunewatch::sparse_linear_counted`), so the step's time goes to reading weights.

What compiles: dense plans, and plans with activation sparsity (row policy) and/or the output-head
shortlist. Plans that bypass blocks, gate heads or use the shared top-k policy run eagerly: their
structure changes per request and each structure would be a graph of its own. At most four graphs
exist per engine (sparse layers on/off x sparse head on/off); per-request targets are tensors.

Counting: a graph cannot write to the request's Python ledger, so the kernel adds its active channels,
kept entries and calls per layer into one int64 tensor, and after each step `CompiledDecode.account`
turns them and the plan into exactly the ledger entries the eager wrappers would have written
(tests/engine/test_compiled_decode.py compares the two field by field). The step runs outside the
request's execution context, so should torch ever run the model eagerly instead of the graph (a
recompile limit reached), the wrappers compute and nothing is counted twice; the calls column shows
it (no kernel call where the plan asked for some), and the step is then counted as the dense step it
was and compilation is turned off.

The first step of each graph compiles it (tens of seconds for a 135M-parameter model on two cores);
`warm_up` does that before serving. A graph that fails to compile turns compilation off for the engine
with a warning and the step runs eagerly: a request never fails because of it.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prunewatch.engine.execution import (
    COMPILED_STEP,
    ExecutionLedger,
    ExecutionPlan,
    InstrumentedModel,
    _linear_flops_per_row,
    outside_execution,
)

logger = logging.getLogger("prunewatch.engine.compiled")

_STEP_LOCK = threading.Lock()
"""Requests decoding at once (server workers, engines of one process) share the graph switches, and per
engine the thresholds and counters: one compiled step at a time holds them, from setting them to counting."""

NO_THRESHOLD = -1.0
"""Threshold of a layer whose target is 0 in a sparse graph: every score (>= 0) passes, all rows are read."""


@dataclass(frozen=True)
class _StepCounts:
    """What one compiled step of one plan adds to the ledger, apart from what the kernels report."""

    dense_flops: int
    executed_flops: int  # everything run dense (blocks' linears, a dense head); kernels' skips come off
    weight_bytes: int
    sparse_dense_flops: int
    sparse_input_entries: int
    head_sparse: bool
    head_flops_per_row_read: int  # 2 x vocab: one input row of the head read by the kernel
    head_bytes_per_row_read: int
    head_shortlist_flops: int  # 2 x shortlist x hidden
    head_shortlist_bytes: int
    head_scale_bytes: int  # an int8 head's scales, read by every kernel call of the head
    head_shortlist: int  # logits the sparse head recomputes exactly (0: the head is not sparse)


class CompiledDecode:
    """The compiled decode step of one engine's model (CPU)."""

    def __init__(self, instrumented: InstrumentedModel, sparse_layers: list, output_head=None) -> None:
        self.model = instrumented.model
        self.blocks = instrumented.blocks
        self.layers = list(sparse_layers)  # prunewatch.engine.sparse.SparseLinear, in a fixed order: their stats rows
        self.output_head = output_head  # prunewatch.engine.sparse.output_head.ShortlistHead or None
        self.failure: str | None = None  # why compilation was turned off, once it was
        slots = len(self.layers) + 1
        self.stats = torch.zeros(slots, 3, dtype=torch.long)  # (active channels, kept entries, calls) per call site
        # What each call site's kernel applies, set per plan (`prepare`): a layer's threshold (NO_THRESHOLD
        # while its target is 0) with no top-k; the head's top-k per row (its threshold unused).
        self.thresholds = torch.full((slots,), NO_THRESHOLD, dtype=torch.float32)
        self.keeps = torch.full((slots,), -1, dtype=torch.long)
        for slot, layer in enumerate(self.layers):
            layer.attach_counter(self.stats, self.thresholds, self.keeps, slot)
        self._head_slot = len(self.layers)
        if output_head is not None:
            output_head.attach_counter(self.stats, self.thresholds, self.keeps, self._head_slot)
        self._in = torch.tensor([m.in_features for m in self.layers], dtype=torch.long)
        self._flops_per_channel = torch.tensor([2 * m.out_features for m in self.layers], dtype=torch.long)
        self._bytes_per_channel = torch.tensor([m.weight_t.shape[1] * m.weight_t.element_size() for m in self.layers],
                                               dtype=torch.long)  # one row of the kernel's weights (int4: out / 2 bytes)
        head = self.model.get_output_embeddings()
        self._head_linear = getattr(head, "linear", head)
        self._head_flops = _linear_flops_per_row(self._head_linear) or 0
        self._head_bytes = self._head_linear.weight.numel() * self._head_linear.weight.element_size()
        self._head_element = self._head_linear.weight.element_size()  # of a head input row read by the kernel
        if output_head is not None and output_head.quantized:  # its int8 copy and scales are what a step reads
            self._head_bytes = output_head.dense_read_bytes
            self._head_element = output_head.weight_t.element_size()
        # Every block runs in a compiled step (no bypass): what they count, summed once.
        self._blocks_dense_flops = sum(b.dense_flops_per_row for b in self.blocks)
        self._blocks_executed_flops = sum(b.executed_flops_per_row for b in self.blocks)
        # int8 layers read their int8 rows and scales, not the fp32 bytes their blocks count
        self._blocks_bytes = sum(b.weight_bytes for b in self.blocks) - sum(
            m.counted_bytes - m.dense_read_bytes for m in self.layers if m.quantized)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
        # No guards on the model's modules: evaluating them took ~4 ms of a ~25 ms SmolLM2 step (torch profiler,
        # "TorchDynamo Cache Lookup"), 0.5 ms without. Safe because the graphs are this step's alone (a code object
        # of its own, `_own_entry`: another engine's model, of the same family, never matches them) and nothing a
        # graph depends on changes on this model's modules while the step exists: new wrappers make a new
        # CompiledDecode (PruningEngine.compiled_decode), and what changes per request is in tensors or in
        # COMPILED_STEP, which stays guarded.
        self._forward = torch.compile(_own_entry(self.model), dynamic=True, fullgraph=True,
                                      options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self._plan: ExecutionPlan | None = None
        self._counts: _StepCounts | None = None
        self._sparse_mask = torch.zeros(len(self.layers), dtype=torch.long)

    @property
    def enabled(self) -> bool:
        return self.failure is None

    def supports(self, plan: ExecutionPlan) -> bool:
        """Whether `plan` runs as a compiled graph (see the module docstring)."""
        if not self.enabled or plan.bypass or plan.heads_gated or plan.sparsity_policy != "row":
            return False
        if plan.output_head_sparsity > 0.0 and self.output_head is None:
            return False
        sparse_asked = plan.activation_sparsity > 0.0 or any(t > 0.0 for t in plan.layer_sparsity)
        return not sparse_asked or bool(self.layers)

    def prepare(self, plan: ExecutionPlan) -> None:
        """Set the thresholds, head size and graph switches of `plan`, and what a step of it counts."""
        if plan is self._plan:
            return
        targets = [layer.target_under(plan) for layer in self.layers]
        if self.layers:
            self.thresholds[:len(self.layers)] = torch.tensor(
                [layer.thresholds.at(target) if target > 0.0 else NO_THRESHOLD
                 for layer, target in zip(self.layers, targets)], dtype=torch.float32)
        self._sparse_mask = torch.tensor([1 if t > 0.0 else 0 for t in targets], dtype=torch.long)
        sparse_layers = [m for m, t in zip(self.layers, targets) if t > 0.0]
        head_sparse = self.output_head is not None and plan.output_head_sparsity > 0.0
        head = self.output_head
        if head_sparse:
            self.keeps[self._head_slot] = head.kept_inputs(plan.output_head_sparsity)
        else:  # an int8 head still runs the kernel in a dense graph: every input row
            self.keeps[self._head_slot] = -1
        hidden = head.in_features if head is not None else 0
        shortlist = head.shortlist_size(plan.output_head_candidates) if head_sparse else 0
        element = self._head_linear.weight.element_size()  # the shortlist's exact rows come from the head's own weight
        self._counts = _StepCounts(
            dense_flops=self._blocks_dense_flops + self._head_flops,
            executed_flops=self._blocks_executed_flops + (0 if head_sparse else self._head_flops),
            weight_bytes=self._blocks_bytes + (0 if head_sparse else self._head_bytes),
            sparse_dense_flops=sum(2 * m.in_features * m.out_features for m in sparse_layers),
            sparse_input_entries=sum(m.in_features for m in sparse_layers),
            head_sparse=head_sparse,
            head_flops_per_row_read=2 * head.out_features if head is not None else 0,
            head_bytes_per_row_read=head.out_features * self._head_element if head is not None else 0,
            head_shortlist_flops=2 * shortlist * hidden,
            head_shortlist_bytes=shortlist * hidden * element,
            head_scale_bytes=head.scale_bytes if head is not None else 0,
            head_shortlist=shortlist,
        )
        self._plan = plan

    def step(self, plan: ExecutionPlan, ledger: ExecutionLedger, **model_inputs):
        """One decode step (one token row) under `plan`, counted on `ledger`; None when compilation failed
        (then turned off with a warning: the caller runs the step eagerly)."""
        with _STEP_LOCK:
            return self._step(plan, ledger, model_inputs)

    def _step(self, plan: ExecutionPlan, ledger: ExecutionLedger, model_inputs: dict):
        if not self.enabled:
            return None
        self.prepare(plan)
        COMPILED_STEP.sparse = self._counts.sparse_input_entries > 0
        COMPILED_STEP.output_head = self._counts.head_sparse
        COMPILED_STEP.shortlist = max(1, self._counts.head_shortlist)
        self.stats.zero_()
        try:
            with outside_execution():
                output = self._forward(**model_inputs)
        except Exception as exc:  # any compiler failure: run eagerly, never fail the request
            if not _is_compile_failure(exc):
                raise
            self.failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            logger.warning("compiled decode turned off for this engine, decoding eagerly: %s", self.failure)
            return None
        finally:
            COMPILED_STEP.sparse = COMPILED_STEP.output_head = False
            COMPILED_STEP.shortlist = 1
        kernels_expected = self._counts.sparse_input_entries > 0 or self._counts.head_sparse
        if kernels_expected and int(self.stats[:, 2].sum()) == 0:  # torch ran the model eagerly: a dense step
            self.failure = "the model ran eagerly instead of the compiled graph"
            logger.warning("compiled decode turned off for this engine: %s", self.failure)
            self._count_dense(ledger)
            return output
        self.account(ledger)
        return output

    def _count_dense(self, ledger: ExecutionLedger) -> None:
        """What the eager wrappers count for a dense step (no plan in force: every layer ran dense)."""
        ledger.dense_flops += self._blocks_dense_flops + self._head_flops
        ledger.executed_flops += self._blocks_executed_flops + self._head_flops
        ledger.weight_bytes_read += self._blocks_bytes + self._head_bytes
        self._count_block_calls(ledger)

    def _count_block_calls(self, ledger: ExecutionLedger) -> None:
        for block in self.blocks:
            ledger.block_calls[block.index] = ledger.block_calls.get(block.index, 0) + 1

    def account(self, ledger: ExecutionLedger) -> None:
        """Add the step just run to `ledger`: the plan's fixed work, less what the kernels skipped."""
        counts = self._counts
        ledger.dense_flops += counts.dense_flops
        self._count_block_calls(ledger)
        executed, read = counts.executed_flops, counts.weight_bytes
        if self.layers and counts.sparse_input_entries:
            active = self.stats[:-1, 0]
            skipped = (self._in - active) * self._sparse_mask
            skipped_flops, skipped_bytes, kernel_flops, kept = torch.stack([
                (skipped * self._flops_per_channel).sum(), (skipped * self._bytes_per_channel).sum(),
                (active * self._sparse_mask * self._flops_per_channel).sum(),
                (self.stats[:-1, 1] * self._sparse_mask).sum()]).tolist()
            executed -= skipped_flops
            read -= skipped_bytes
            ledger.sparse_dense_flops += counts.sparse_dense_flops
            ledger.sparse_input_entries += counts.sparse_input_entries
            ledger.sparse_executed_flops += kernel_flops
            ledger.sparse_kept_entries += kept
        if counts.head_sparse:
            rows_read = int(self.stats[self._head_slot, 0])
            executed += counts.head_flops_per_row_read * rows_read + counts.head_shortlist_flops
            read += counts.head_bytes_per_row_read * rows_read + counts.head_shortlist_bytes + counts.head_scale_bytes
        ledger.executed_flops += executed
        ledger.weight_bytes_read += read


def _own_entry(model: nn.Module) -> Callable[..., Any]:
    """`model.forward` behind a function whose code object belongs to this call alone.

    Dynamo keeps compiled graphs per code object; compiling `model.forward` itself would share them with every
    model of the family in the process, and with module guards dropped one model could run another's graph."""
    def step(**inputs: Any) -> Any:
        return model.forward(**inputs)

    code = step.__code__.replace(co_name=f"decode_step_{id(model):x}")
    return types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)


def _is_compile_failure(exc: Exception) -> bool:
    """Errors raised while Dynamo traces or Inductor compiles, as opposed to errors of the inputs."""
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses")) or \
        type(exc).__name__ in ("BackendCompilerFailed", "Unsupported", "InternalTorchDynamoError")
