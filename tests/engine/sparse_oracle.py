"""Independent counts for tests to compare with the engine's ledger: what one activation-sparse kernel
call had to read (the union over the call's rows of the input channels above threshold), and the
whole model's executed and dense work counted by a Python hook on every linear layer per call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def count_kernel_call(module, x: torch.Tensor, target: float, oracle: dict[str, int]) -> torch.Tensor:
    """Add one SparseLinear call's kept/total input entries and skipped FLOPs to `oracle`; return the
    (rows, in) keep mask. Calls longer than max_kernel_rows run masked-then-dense: nothing skipped."""
    rows = x.reshape(-1, module.in_features)  # (rows, in)
    keep = rows.abs().float() * module.scale > torch.tensor(module.thresholds.at(target), dtype=torch.float32)
    oracle["kept"] = oracle.get("kept", 0) + int(keep.sum())
    oracle["entries"] = oracle.get("entries", 0) + keep.numel()
    if rows.shape[0] <= module.max_kernel_rows:  # decode-shaped: the kernel reads only active weight rows
        active = int(keep.any(dim=0).sum())
        oracle["skipped"] = oracle.get("skipped", 0) + 2 * module.out_features * (module.in_features - active) * rows.shape[0]
        oracle["kernel_calls"] = oracle.get("kernel_calls", 0) + 1
    return keep


def _linear_work(module) -> int | None:
    """2 x in x out from the weight's shape, for nn.Linear and GPT-2's Conv1D; None otherwise."""
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
        return 2 * module.weight.numel()
    return None


def _kernel_dense(module, plan, rows: int) -> bool:
    """Whether a wrapper computes a dense call through its kernel (every weight row read) rather than its inner
    layer: quantized weights, or a row-invariant plan (eager CPU decoding and batched steps), at few rows; and under a
    row-invariant plan an fp32 decoder layer's prefill chunk of up to ROW_INVARIANT_CHUNK_ROWS rows, dense or masked
    (SparseLinear's row-invariant product)."""
    from prunewatch.engine.sparse import SparseLinear
    from prunewatch.engine.sparse.module import ROW_INVARIANT_CHUNK_ROWS

    if rows <= module.max_kernel_rows and (module.quantized or plan.row_invariant):
        return True
    return (isinstance(module, SparseLinear) and plan.row_invariant and not module.quantized
            and rows <= ROW_INVARIANT_CHUNK_ROWS)


@contextlib.contextmanager
def hook_count(instrumented) -> Iterator[dict[str, int]]:
    """An independent count of one model's work: a forward hook on every linear layer that runs (the way
    the engine used to count, at a Python hook per linear per token), a pre-hook on each sparse kernel
    call (the union of its rows' active channels, recomputed here) and on each head-gated projection
    (its kept slices) and on the shortlist output head (its kept inputs and shortlist). Yields {"executed": ..., "dense": ...} filled while the context is open.

    Dense work: every linear inside each decoder block the plan entered, plus the head, from weight
    shapes. Nothing is read from the engine's ledger.
    """
    from prunewatch.engine.execution import current_execution
    from prunewatch.engine.heads import HeadGatedProjection
    from prunewatch.engine.sparse import SparseLinear
    from prunewatch.engine.sparse.output_head import ShortlistHead

    count = {"executed": 0, "dense": 0}
    handles = []

    def rows_of(x: torch.Tensor) -> int:
        return x.numel() // x.shape[-1]

    def on_linear(module, args, output) -> None:
        count["executed"] += _linear_work(module) * rows_of(args[0])

    def on_sparse(module, args) -> None:
        plan = current_execution()[0] if current_execution() is not None else None
        target = module.target_under(plan) if plan is not None else 0.0
        rows = rows_of(args[0])
        if target > 0.0 and rows <= module.max_kernel_rows:  # kernel path: the inner layer is not called
            flat = args[0].reshape(-1, module.in_features)
            threshold = torch.tensor(module.thresholds.at(target), dtype=torch.float32)
            active = int((flat.abs().float() * module.scale > threshold).any(dim=0).sum())
            count["executed"] += 2 * module.out_features * active * rows
        elif plan is not None and _kernel_dense(module, plan, rows):  # every row through the kernel
            count["executed"] += 2 * module.out_features * module.in_features * rows

    def on_gated(module, args) -> None:
        plan = current_execution()[0] if current_execution() is not None else None
        gated = plan.heads_gated_in(module.layer) if plan is not None else frozenset()
        sparse = isinstance(module.inner, SparseLinear) and module.inner.target_under(plan) > 0.0
        if not gated or sparse:
            return  # the inner layer runs and its own hooks count it
        in_features = args[0].shape[-1]
        out_features = module.dense_layer().weight.numel() // in_features
        kept = sum(end - start for start, end in module.kept(gated))
        # output role: kept output features x every input; input role: kept inputs x every output
        per_row = kept * in_features if module.role == "output" else kept * out_features
        count["executed"] += 2 * per_row * rows_of(args[0])

    def on_block(block_work: int):
        def hook(module, args, kwargs) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            if current_execution() is not None:
                count["dense"] += block_work * rows_of(hidden)
        return hook

    def on_head(module, args, output) -> None:  # the plain head ran: dense work
        if current_execution() is None:
            return
        work = _linear_work(module) * rows_of(args[0])
        count["executed"] += work
        count["dense"] += work

    def on_shortlist(module, args) -> None:
        """The shortlist head: with an output-head target it never calls its inner layer (no on_head)."""
        plan = current_execution()[0] if current_execution() is not None else None
        rows = rows_of(args[0])
        n_in, vocab = module.linear.in_features, module.linear.out_features
        if plan is not None and plan.output_head_sparsity <= 0.0 and _kernel_dense(module, plan, rows):
            count["executed"] += 2 * vocab * n_in * rows  # dense, through the kernel: no inner call for on_head
            count["dense"] += 2 * vocab * n_in * rows
        if plan is None or plan.output_head_sparsity <= 0.0:
            return
        keep = max(1, round((1.0 - plan.output_head_sparsity) * n_in))
        approximate = 2 * vocab * keep if rows <= module.max_kernel_rows else 2 * vocab * n_in
        shortlist = min(plan.output_head_candidates, vocab)
        count["executed"] += (approximate + 2 * shortlist * n_in) * rows
        count["dense"] += 2 * vocab * n_in * rows

    for wrapper in instrumented.blocks:
        block_work = 0
        for module in wrapper.block.modules():
            work = _linear_work(module)
            if work is not None:
                block_work += work
                handles.append(module.register_forward_hook(on_linear))
            elif isinstance(module, SparseLinear):
                handles.append(module.register_forward_pre_hook(on_sparse))
            elif isinstance(module, HeadGatedProjection):
                handles.append(module.register_forward_pre_hook(on_gated))
        handles.append(wrapper.register_forward_pre_hook(on_block(block_work), with_kwargs=True))
    head = instrumented.model.get_output_embeddings()
    if isinstance(head, ShortlistHead):
        handles.append(head.register_forward_pre_hook(on_shortlist))
        head = head.linear
    handles.append(head.register_forward_hook(on_head))
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


def oracle_ratio(count: dict[str, int]) -> float:
    """1 - executed / dense of a hook_count."""
    return 1.0 - count["executed"] / count["dense"] if count["dense"] else 0.0
