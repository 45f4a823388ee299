"""int8 weights with one scale per output channel, in the layout the sparse kernel reads.

Why int8 at all: a decode step reads every weight it multiplies once, and on a CPU that read is
the step's cost, so a quarter of the bytes is up to four times the decode speed of fp32 weights,
and it composes with activation sparsity (the kernel reads only the int8 rows of active input
channels). Why per output channel: symmetric round-to-nearest with one scale per output keeps
each output's largest weight exact and costs out x 4 bytes, and the scale is applied once per
finished output instead of once per weight.
"""

from __future__ import annotations

import torch

from prunewatch.engine.settings import WeightFormat

__all__ = ["INT8_MAX", "WeightFormat", "dequantize_int8", "quantize_int8"]

INT8_MAX = 127  # symmetric: -127..127, so negating a weight never overflows


def quantize_int8(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with weight_t ~ q * scale: q int8 of weight_t's shape (in, out), scale float32 (out,).

    An output channel whose weights are all zero gets scale 1 (q is zero there), never a division by 0.
    """
    if weight_t.dim() != 2:
        raise ValueError(f"weight_t must be a 2-D (in, out) tensor, got shape {tuple(weight_t.shape)}")
    if not weight_t.is_floating_point():
        raise ValueError(f"weight_t must hold floating-point weights to quantize, got {weight_t.dtype}")
    wide = weight_t.detach().float()
    peak = wide.abs().amax(dim=0)  # (out,)
    scale = torch.where(peak > 0, peak / INT8_MAX, torch.ones_like(peak))
    q = torch.round(wide / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 (in, out) weights q * scale stands for: what the int8 kernel multiplies by."""
    return q.float() * scale
