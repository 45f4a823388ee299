"""int8 weights with one scale per output channel, and int4 weights in groups of 32 input channels with
a scale and a minimum each, in the layouts the sparse kernel reads.

Why int8 at all: a decode step reads every weight it multiplies once, and on a CPU that read is
the step's cost, so a quarter of the bytes is up to four times the decode speed of fp32 weights,
and it composes with activation sparsity (the kernel reads only the int8 rows of active input
channels). Why per output channel: symmetric round-to-nearest with one scale per output keeps
each output's largest weight exact and costs out x 4 bytes, and the scale is applied once per
finished output instead of once per weight.

Why int4 as groups of 32 with a scale and a minimum (both fp16): that is GGUF's Q4_1 block, the format
models often ship in (SmolLM2's GGUF holds every projection as Q4_1). Quantizing the fp32 weights a
Q4_1 GGUF was dequantized into gives back its blocks exactly: each block's minimum is one of its values
and its maximum is minimum + 15 x scale, so the int4 engine multiplies by the very weights the fp32 one
does, at an eighth of their bytes plus the scales. Other weights get round-to-nearest Q4_1.
"""

from __future__ import annotations

import torch

from prunewatch.engine.settings import WeightFormat

__all__ = ["INT4_GROUP", "INT8_MAX", "WeightFormat", "dequantize_int4", "dequantize_int8", "int4_fits",
           "int8_by_output_fits", "pack_int4_by_output", "pack_int8_by_output", "quantize_int4", "quantize_int8"]

INT8_MAX = 127  # symmetric: -127..127, so negating a weight never overflows
INT4_GROUP = 32  # input channels per int4 scale and minimum (GGUF's Q4_0 / Q4_1 block size)
INT4_LEVELS = 15  # q in 0..15


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


OUTPUT_BLOCK = 16  # outputs whose weights the dense integer products (int8 and int4) read together


def int8_by_output_fits(in_features: int, out_features: int) -> bool:
    """Whether an int8 layer's dense decode product can read its weights laid out by output
    (pack_int8_by_output): whole groups of 32 inputs and outputs in blocks of 16. Other layers read the sparse
    kernel's rows."""
    return (in_features % INT4_GROUP == 0 and out_features % OUTPUT_BLOCK == 0 and in_features > 0
            and out_features > 0)


def _rounded_order() -> torch.Tensor:
    """The input order of the integer dense products' rounded inputs in a group of 32 (csrc/integer_dense.h):
    inputs 0-7, 16-23, 8-15, 24-31."""
    return torch.tensor([(0 if j % 16 < 8 else 16) + (0 if j < 16 else 8) + j % 8 for j in range(INT4_GROUP)])


def _by_block(codes: torch.Tensor, pieces: int) -> torch.Tensor:
    """(out, groups, pieces, 2) values per output to (out / 16, groups, pieces, 32): per block of 16 outputs, group
    and piece, the 16 outputs' two values side by side, output k at 2k and 2k + 1."""
    out, groups = codes.shape[:2]
    return codes.reshape(out // OUTPUT_BLOCK, OUTPUT_BLOCK, groups, pieces, 2).permute(0, 2, 3, 1, 4).reshape(
        out // OUTPUT_BLOCK, groups, pieces, 2 * OUTPUT_BLOCK).contiguous()


def pack_int8_by_output(q: torch.Tensor) -> torch.Tensor:
    """The same int8 weights laid out by output for the dense decode product (csrc/int8_dense.cpp):
    int8 (out / 16, in / 32, 16, 32), where [ob, g, j, 2k + t] is the weight of output 16 * ob + k for the input at
    position 2j + t of the order the product rounds the inputs in (_rounded_order). Widened to int16, a piece holds
    each of 16 outputs' weights for one pair of inputs in a 32-bit lane of its own. A block of 16 outputs is one
    contiguous run per group, read in order."""
    if q.dim() != 2 or q.dtype != torch.int8 or not int8_by_output_fits(*q.shape):
        raise ValueError(f"q must be quantize_int8's int8 (in, out) weights with in a multiple of {INT4_GROUP} and "
                         f"out of {OUTPUT_BLOCK}, got {tuple(q.shape)} {q.dtype}")
    rows, out = q.shape
    grouped = q.t().reshape(out, rows // INT4_GROUP, INT4_GROUP)[:, :, _rounded_order()]  # (out, groups, 32)
    return _by_block(grouped.reshape(out, rows // INT4_GROUP, INT4_GROUP // 2, 2), INT4_GROUP // 2)


def int4_fits(in_features: int, out_features: int) -> bool:
    """Whether a layer can hold int4 weights: whole groups of input channels, outputs in runs of 32 (the
    kernel widens 16 bytes into 32 outputs). A layer that cannot keeps int8 weights."""
    return in_features % INT4_GROUP == 0 and out_features % INT4_GROUP == 0 and in_features > 0 and out_features > 0


def quantize_int4(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) with weight_t[i, o] ~ d[i // 32, o] * q[i, o] + m[i // 32, o], q in 0..15.

    weight_t: (in, out), in and out multiples of 32 (int4_fits). packed: uint8 (in, out / 2); in each run of
    32 outputs byte k holds q of output k (low nibble) and of output k + 16 (high nibble). scales: float16
    (in / 32, 2, out), d then m per group. Like llama.cpp's Q4_1: m is the group's minimum and d spans it to
    the maximum in 15 steps (both rounded to fp16 first, so q is chosen for the values the kernel uses).
    """
    if weight_t.dim() != 2 or not weight_t.is_floating_point():
        raise ValueError(f"weight_t must be a 2-D floating-point (in, out) tensor, got {tuple(weight_t.shape)} "
                         f"{weight_t.dtype}")
    rows, out = weight_t.shape
    if not int4_fits(rows, out):
        raise ValueError(f"int4 weights need in and out to be multiples of {INT4_GROUP}, got ({rows}, {out})")
    groups = weight_t.detach().float().reshape(rows // INT4_GROUP, INT4_GROUP, out)
    low, high = groups.amin(dim=1), groups.amax(dim=1)  # (groups, out)
    minimum = low.half()
    step = ((high - minimum.float()) / INT4_LEVELS).half()
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(low))
    q = torch.round((groups - minimum.float()[:, None, :]) / safe[:, None, :]).clamp_(0, INT4_LEVELS).to(torch.uint8)
    q = q.reshape(rows, out // INT4_GROUP, 2, INT4_GROUP // 2)  # per run of 32: outputs 0-15, then 16-31
    packed = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(rows, out // 2)
    return packed.contiguous(), torch.stack((step, minimum), dim=1).contiguous()


def _int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """q (in, out) in 0..15 from quantize_int4's packed (in, out / 2) bytes."""
    rows = packed.shape[0]
    out = packed.shape[1] * 2
    runs = packed.reshape(rows, out // INT4_GROUP, INT4_GROUP // 2)
    return torch.stack((runs & 0xF, runs >> 4), dim=2).reshape(rows, out)


def pack_int4_by_output(packed: torch.Tensor) -> torch.Tensor:
    """The same int4 weights laid out by output for the dense decode product (csrc/int4_dense.cpp):
    uint8 (out / 16, in / 32, 8, 32), where byte [ob, g, j, 2k + t] holds output 16 * ob + k's weights for the
    inputs at positions 4j + t (low nibble) and 4j + 2 + t (high nibble) of the rounded order (_rounded_order).
    Widened to int16, a piece's low nibbles hold each of 16 outputs' weights for the pair of inputs 4j, 4j + 1 in a
    32-bit lane of its own, and its high nibbles those for 4j + 2, 4j + 3. A block of 16 outputs is one contiguous
    run per group, read in order."""
    rows, half = packed.shape
    out = half * 2
    if packed.dtype != torch.uint8 or not int4_fits(rows, out):
        raise ValueError(f"packed must be quantize_int4's uint8 (in, out / 2) bytes, got {tuple(packed.shape)} "
                         f"{packed.dtype}")
    q = _int4_codes(packed).t().reshape(out, rows // INT4_GROUP, INT4_GROUP)[:, :, _rounded_order()]
    quads = q.reshape(out, rows // INT4_GROUP, INT4_GROUP // 4, 4)  # positions 4j .. 4j + 3
    return _by_block(quads[..., :2] | (quads[..., 2:] << 4), INT4_GROUP // 4)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 (in, out) weights an int4 layer stands for: what the int4 kernel multiplies by."""
    rows = packed.shape[0]
    q = _int4_codes(packed).reshape(rows // INT4_GROUP, INT4_GROUP, -1).float()
    step, minimum = scales[:, 0, :].float(), scales[:, 1, :].float()
    return (q * step[:, None, :] + minimum[:, None, :]).reshape(rows, -1)
