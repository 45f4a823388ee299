"""Every CPU kernel operator on fixed inputs, for comparing the kernel's builds for different instruction sets.

Run as `python -m tests.engine.kernel_outputs INPUTS OUTPUTS` under an ATEN_CPU_CAPABILITY (which picks the build,
prunewatch/engine/sparse/kernel.py): the inputs come from a file, not from torch's generator, whose normal and
uniform draws themselves differ between instruction sets.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SHAPES = ((576, 1536), (1536, 576), (576, 6144), (96, 40))  # SmolLM2-135M's projections, a head slice, odd sizes
ROWS = (1, 3, 8, 17)
THRESHOLDS = (-1.0, 0.3, 0.8)  # -1: every row read
ATTENTION = ((1, 10), (1, 130), (4, 10), (4, 130))  # (rows, filled positions); SmolLM2's 9 heads over 3, dim 64


def make_inputs(path: Path, seed: int = 0) -> None:
    """Draw every tensor the operators take, once, and save them."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for n_in, n_out in SHAPES:
        tensors[f"wt {n_in}x{n_out}"] = torch.randn(n_in, n_out, generator=g) * 0.05
        tensors[f"bias {n_out}"] = torch.randn(n_out, generator=g)
        tensors[f"scale {n_in}"] = torch.rand(n_in, generator=g) + 0.5
        for rows in ROWS:
            tensors[f"x {n_in} r{rows}"] = torch.randn(rows, n_in, generator=g)
    for rows, filled in ATTENTION:
        for name, shape in (("q", (rows, 9, 1, 64)), ("k", (rows, 3, 1, 64)), ("v", (rows, 3, 1, 64)),
                            ("kc", (rows, 1, 3, 300, 64)), ("vc", (rows, 1, 3, 300, 64))):
            tensors[f"{name} r{rows} L{filled}"] = torch.randn(*shape, generator=g)
    torch.save(tensors, path)


def outputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each operator's output on the inputs, keyed "operator shape rows [threshold]"."""
    from prunewatch.engine.sparse.kernel import build, int4_dense_kernel, int8_dense_kernel
    from prunewatch.engine.sparse.quantize import (
        pack_int4_by_output,
        pack_int8_by_output,
        quantize_int4,
        quantize_int8,
    )

    kernel = build()
    int8, int4 = int8_dense_kernel("cpu"), int4_dense_kernel("cpu")
    out: dict[str, torch.Tensor] = {}
    for n_in, n_out in SHAPES:
        wt, bias, scale = inputs[f"wt {n_in}x{n_out}"], inputs[f"bias {n_out}"], inputs[f"scale {n_in}"]
        integer = n_in % 32 == 0 and n_out % 16 == 0
        if integer:
            q8, s8 = quantize_int8(wt)
            q4, s4 = quantize_int4(wt)
            by8, by4 = pack_int8_by_output(q8), pack_int4_by_output(q4)
        for rows in ROWS:
            x = inputs[f"x {n_in} r{rows}"]
            key = f"{n_in}x{n_out} r{rows}"
            out[f"fp32_dense {key}"] = kernel.fp32_dense_linear(x, wt, bias, 2)
            for threshold in THRESHOLDS:
                out[f"sparse {key} t{threshold}"] = kernel.sparse_linear(x, wt, bias, scale, threshold, -1, 2)[0]
            out[f"threshold_mask {key}"] = kernel.threshold_mask(x, scale, 0.5)[0]
            if integer:
                out[f"int8_dense {key}"] = int8(x, by8, s8, bias, 2)
                out[f"int4_dense {key}"] = int4(x, by4, s4, bias, 2)
    for rows, filled in ATTENTION:
        key = f"r{rows} L{filled}"
        out[f"attention {key}"] = kernel.reserved_decode_attention(
            inputs[f"q {key}"], inputs[f"k {key}"], inputs[f"v {key}"], list(inputs[f"kc {key}"].unbind()),
            list(inputs[f"vc {key}"].unbind()), [filled] * rows, 0.125, 2)
    return out


if __name__ == "__main__":
    torch.save(outputs(torch.load(sys.argv[1])), sys.argv[2])
