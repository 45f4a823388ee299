"""Sparse linear layer for activation sparsity on CUDA, in Triton: y = masked(x) @ W^T + b.

Same contract as the CPU kernel (csrc/sparse_linear.cpp): the weight is stored transposed and
contiguous per input channel, wt = W^T with shape (in, out), so the weights an input channel
multiplies are one contiguous row wt[i, :]. The channels a call reads are decided once for the
whole call (the union over rows of the entries above the threshold, or the `keep` channels of
largest summed score shared by the rows) and compacted into an ascending index list with torch
ops that need no host sync. The Triton kernel then gathers only the rows of wt named in that list,
so the row of an inactive channel is never addressed; at decode time a linear layer is bound by
the bytes of weight it reads, which is where skipping them saves time.

Unlike a kernel that takes one row's mask for the whole batch, every row keeps its own mask: a
channel active in any row is read once, and each row multiplies it by its own masked value (zero
where that row's entry did not pass). Rows are tiled by 16 (tensor-core dots) or handled as one
row (a reduction, exact in fp32); the active list is split over program instances (split-K) so a
decode step fills the GPU, and the fp32 partial sums are added by torch.

This module imports triton; prunewatch.engine.sparse.kernel imports it only when a CUDA tensor arrives, so
the package works without triton. Under TRITON_INTERPRET=1 the kernel also runs on CPU tensors,
which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

_SINGLE_ROW = (1, 128, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K) for one row: a reduction, no padded rows
_MULTI_ROW = (16, 64, 64)  # for 2+ rows: 16 is the smallest M of a tensor-core dot
_MAX_SPLIT_K = 16  # more partial sums cost more to add than the parallelism they buy


@triton.jit
def _sparse_gemm_kernel(
    x_ptr,  # (rows, in) fp32: the masked input (zero where a row's entry did not pass)
    idx_ptr,  # (>= n_active,) int32: active input channels, ascending
    n_ptr,  # (1,) int32 on the device: how many entries of idx_ptr are active
    w_ptr,  # (in, out) contiguous: W transposed
    part_ptr,  # (SPLIT_K, rows, out) fp32: one partial sum per split of the active list
    rows,
    n_in,
    n_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < n_out
    rws = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rws < rows
    n_active = tl.load(n_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(pid_k * BLOCK_K, n_active, SPLIT_K * BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)  # (BLOCK_K,) positions in the active list
        j_ok = j < n_active
        channel = tl.load(idx_ptr + j, mask=j_ok, other=0).to(tl.int64)  # (BLOCK_K,)
        # Only rows of wt named in the active list are addressed; lanes past its end load nothing.
        w = tl.load(w_ptr + channel[:, None] * n_out + cols[None, :],
                    mask=j_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        xk = tl.load(x_ptr + rws[:, None].to(tl.int64) * n_in + channel[None, :],
                     mask=row_ok[:, None] & j_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        if USE_DOT:
            acc = tl.dot(xk, w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc += tl.sum(xk[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    out_offsets = (pid_k * rows + rws[:, None]).to(tl.int64) * n_out + cols[None, :]
    tl.store(part_ptr + out_offsets, acc, mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class _Selection:
    """What one call reads: the masked input, the active channel list, and the work counters."""

    coef: torch.Tensor  # (rows, in) fp32, zero where a row's entry is masked
    channels: torch.Tensor  # (>= n_active,) int32, active channels first, ascending
    n_active: torch.Tensor  # (1,) int32 on the device
    counts: torch.Tensor  # (2,) int64 on the device: active channels, kept entries


def _select_by_threshold(xf: torch.Tensor, scale: torch.Tensor, threshold: float) -> _Selection:
    """Row policy: entry (b, i) is kept when |x[b, i]| * scale[i] > threshold; channels are the union."""
    n_in = xf.shape[1]
    mask = xf.abs() * scale > threshold  # (rows, in)
    active = mask.any(dim=0)  # (in,)
    position = torch.cumsum(active, dim=0, dtype=torch.int32)  # (in,) 1-based slot of each active channel
    slot = torch.where(active, position - 1, n_in)  # inactive channels all go to the spare last slot
    channels = torch.zeros(n_in + 1, dtype=torch.int32, device=xf.device)
    channels.scatter_(0, slot.long(), torch.arange(n_in, dtype=torch.int32, device=xf.device))
    counts = torch.stack((active.sum(), mask.sum()))
    return _Selection(coef=torch.where(mask, xf, 0.0), channels=channels, n_active=position[-1:], counts=counts)


def _select_top_k(xf: torch.Tensor, scale: torch.Tensor, keep: int) -> _Selection:
    """Shared policy: the `keep` channels of largest summed score, the lower index first on a tie."""
    n_in = xf.shape[1]
    keep = max(0, min(keep, n_in))
    summed = (xf.abs() * scale).sum(dim=0)  # (in,)
    ranked = torch.sort(summed, descending=True, stable=True).indices[:keep]
    channels = torch.sort(ranked).values.to(torch.int32)  # ascending, so memory is read in order
    kept = (xf.index_select(1, channels) != 0).sum()
    counts = torch.stack((torch.tensor(keep, device=xf.device), kept))
    n_active = torch.full((1,), keep, dtype=torch.int32, device=xf.device)
    if keep == 0:
        channels = torch.zeros(1, dtype=torch.int32, device=xf.device)
    return _Selection(coef=xf, channels=channels, n_active=n_active, counts=counts)


def _dot_precision(weight_dtype: torch.dtype) -> str:
    """tf32 tensor cores for 16-bit weights, where they are exact: fp16 and bf16 values, and inputs
    of the same dtype, fit in tf32's 10-bit mantissa and 8-bit exponent (an fp32 input beside 16-bit
    weights is rounded to tf32). fp32 weights get "ieee", as exact as the CPU kernel. Triton's
    interpreter has no bf16 dot, so one fp32 dot serves both the GPU and the tests."""
    return "ieee" if weight_dtype == torch.float32 else "tf32"


@lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(device: torch.device, programs: int, n_in: int, block_k: int) -> int:
    """Splits of the active list so about two programs run per multiprocessor, each with >= 4 blocks."""
    wanted = triton.cdiv(2 * _multiprocessors(device), max(programs, 1))
    return max(1, min(wanted, triton.cdiv(n_in, 4 * block_k), _MAX_SPLIT_K))


def _check_inputs(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor) -> None:
    """The CPU kernel's checks, with its messages, plus one device for every tensor."""
    if x.dim() != 2:
        raise RuntimeError(f"sparse_linear: x must be (rows, in), got {tuple(x.shape)}")
    if weight_t.dim() != 2 or not weight_t.is_contiguous():
        raise RuntimeError("sparse_linear: wt must be a contiguous (in, out) tensor")
    if x.shape[1] != weight_t.shape[0]:
        raise RuntimeError(f"sparse_linear: x has {x.shape[1]} input channels, wt has {weight_t.shape[0]}")
    if scale.dim() != 1 or scale.shape[0] != weight_t.shape[0] or scale.dtype != torch.float32:
        raise RuntimeError("sparse_linear: scale must be a float32 vector of length in")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight_t.shape[1]):
        raise RuntimeError("sparse_linear: bias must have length out")
    devices = {t.device for t in (x, weight_t, scale, bias) if t is not None}
    if len(devices) != 1:
        raise RuntimeError(f"sparse_linear: all tensors must be on one device, got {sorted(map(str, devices))}")


def sparse_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    threshold: float,
    keep: int = -1,
    threads: int = 0,
    weight_scale: torch.Tensor | None = None,
    split_k: int | None = None,
) -> tuple[torch.Tensor, int, int]:
    """(y = masked(x) @ weight_t + bias in x's dtype, active channels read, kept entries).

    The arguments and results are the CPU kernel's; `threads` is accepted for that signature and
    unused (the GPU schedules itself). weight_scale: int8 weights' scales, which this kernel does not
    take (int8 weights have a CPU kernel only). split_k: splits of the active list (None: sized to the GPU).
    The two counts are read back once per call, after the kernel is queued.
    """
    if weight_scale is not None:
        raise ValueError("the Triton kernel takes floating-point weights only; int8 weights have a CPU kernel")
    _check_inputs(x, weight_t, bias, scale)
    rows, n_in = x.shape
    n_out = weight_t.shape[1]
    xf = x.to(torch.float32).contiguous()
    selection = (_select_by_threshold(xf, scale, float(threshold)) if keep < 0
                 else _select_top_k(xf, scale, int(keep)))
    block_m, block_n, block_k = _SINGLE_ROW if rows == 1 else _MULTI_ROW
    grid_n, grid_m = triton.cdiv(n_out, block_n), triton.cdiv(max(rows, 1), block_m)
    splits = split_k if split_k is not None else _split_k(x.device, grid_n * grid_m, n_in, block_k)
    partial = torch.empty((splits, rows, n_out), dtype=torch.float32, device=x.device)
    if rows > 0 and n_out > 0:
        _sparse_gemm_kernel[(grid_n, splits, grid_m)](
            selection.coef, selection.channels, selection.n_active, weight_t, partial, rows, n_in, n_out,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits, USE_DOT=rows > 1,
            PRECISION=_dot_precision(weight_t.dtype))
    y = partial[0] if splits == 1 else partial.sum(dim=0)  # (rows, out) fp32
    if bias is not None:
        y = y + bias.to(torch.float32)
    active, kept = selection.counts.tolist()
    return y.to(x.dtype), int(active), int(kept)
