"""An independent count of what one activation-sparse kernel call had to read, for tests to compare
with the engine's ledger: the union over the call's rows of the input channels above threshold."""

from __future__ import annotations

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
