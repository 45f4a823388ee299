"""Quantized weight products at one token: torch's own CPU kernels against the engine's, on a model's layer shapes
(`prunewatch bench kernels`, or `python -m prunewatch.bench.weight_kernels`).

Why: where PyTorch already has a fast kernel for a product, the engine should use it rather than its own. torch
ships CPU weight-only kernels for int8 (`aten._weight_int8pack_mm`, one scale per output channel) and int4
(`aten._weight_int4pack_mm_for_cpu`, groups with a scale and zero point). This times them against fp32 `F.linear`
and the engine's sparse kernel reading every row (int8 per output channel, int4 in Q4_1 groups of 32), and the
engine's dense int4 product (weights laid out by output: what an int4 layer's dense decode call runs), on every
distinct (in, out) shape of the model's projections, one token row, the configurations interleaved in rotating
order; each product is first checked against the fp32 product of the weights it stands for (the dense int4 product
rounds its inputs to int16 per group of 32, so it differs by that rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from prunewatch.bench._common import RESULTS_DIR, invocation, machine_info
from prunewatch.engine.model_store import DEFAULT_MODEL, models_root

KERNELS = ("fp32 F.linear", "torch int8pack", "torch int4pack", "engine int8", "engine int4", "engine int8 dense",
           "engine int4 dense")
SPARSE_LEVELS = (0.5, 0.7, 0.85)
"""Input sparsities at which the sparse kernel is timed on quantized weights, to find where it overtakes the dense
integer product."""
SPARSE_KERNELS = tuple(f"engine {fmt} sparse {level:.2f}" for fmt in ("int8", "int4") for level in SPARSE_LEVELS)
TIMED = KERNELS + SPARSE_KERNELS
ROUNDED_INPUTS = ("engine int8 dense", "engine int4 dense")
"""Products whose inputs are rounded to int16 per group of 32: their error against fp32 is that rounding's."""
METHOD = {
    "us": "measured: microseconds per product of one token row, median over repetitions in rotating order",
    "vs_fp32": "measured: the fp32 product's median time over this kernel's (above 1: faster than fp32)",
    "max_abs_error": "measured: largest difference from the fp32 product of the dequantized weights, one input "
                     "(engine int8 dense and int4 dense: their inputs rounded to int16 per group of 32)",
    "sparse": "measured: the sparse kernel on the quantized weights with the input's smallest entries zeroed to "
              "each sparsity (us and vs_fp32 as above; error against the fp32 product of the same masked input)",
    "head": "measured: the int8 output head, one token row, median ms of its dense integer product and of its "
            "shortlist at each input sparsity (1024 exact candidates), each call under an execution plan as in a "
            "decode step; vs_dense above 1: faster than the dense head",
    "step": "measured: ms per decode step's worth of products from DRAM (every projection of every block of the "
            "model's shape, each with random weights of its own, called once per step in order), at 1, 4 and 8 token "
            "rows, median over repetitions in rotating order; gb_per_s: the weights' and scales' bytes over that "
            "time; vs_fp32: the fp32 step's median time over this one's",
    "break_even": "computed from the medians: the input sparsity at which the sparse kernel's time falls to the "
                  "dense integer product's, linear between the timed sparsities (0: the whole row kernel); None: not "
                  "reached by 0.85",
}


def block_shapes(model_dir: Path) -> list[tuple[int, int]]:
    """(in, out) of a Llama-style block's seven projections in call order (q, k, v, o, gate, up, down), from its
    config."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inner), (hidden, inner),
            (inner, hidden)]


def layer_shapes(model_dir: Path) -> list[tuple[int, int]]:
    """Distinct (in, out) shapes of a Llama-style model's seven projections per block."""
    return sorted(set(block_shapes(model_dir)))


def _products(n_in: int, n_out: int, seed: int) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """The products of one random layer of this shape, and each one's largest error against fp32."""
    import torch
    import torch.nn.functional as F

    from prunewatch.engine.sparse.kernel import int4_dense_kernel, int8_dense_kernel, sparse_linear
    from prunewatch.engine.sparse.quantize import (
        dequantize_int4,
        dequantize_int8,
        pack_int4_by_output,
        pack_int8_by_output,
        quantize_int4,
        quantize_int8,
    )

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
    x = torch.randn(1, n_in, generator=g)
    ones = torch.ones(n_in)
    q8, s8 = quantize_int8(weight.t().contiguous())
    q4, s4 = quantize_int4(weight.t().contiguous())
    q4_by_output, int4_dense = pack_int4_by_output(q4), int4_dense_kernel("cpu")
    q8_by_output, int8_dense = pack_int8_by_output(q8), int8_dense_kernel("cpu")
    q8_rows = q8.t().contiguous()  # torch's int8 kernel takes (out, in)
    # torch's int4 layout: (out, in) values 0..15 with w = (q - 8) * scale + zero per group; the same Q4_1 blocks
    deq4 = dequantize_int4(q4, s4)
    step, minimum = s4[:, 0, :].float(), s4[:, 1, :].float()  # (groups, out)
    q4_rows = torch.round((deq4 - minimum.repeat_interleave(32, 0)) / torch.where(step > 0, step, 1).repeat_interleave(
        32, 0)).clamp(0, 15).to(torch.int32).t().contiguous()
    torch_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4_rows, 1)
    scales_zeros = torch.stack((step, minimum + 8 * step), dim=-1).contiguous()  # (groups, out, 2)
    products: dict[str, Callable[[], object]] = {
        "fp32 F.linear": lambda: F.linear(x, weight),
        "torch int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, q8_rows, s8),
        "torch int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_int4, 32, scales_zeros),
        "engine int8": lambda: sparse_linear(x, q8, None, ones, -1.0, weight_scale=s8).output,
        "engine int4": lambda: sparse_linear(x, q4, None, ones, -1.0, weight_scale=s4).output,
        "engine int8 dense": lambda: int8_dense(x, q8_by_output, s8, None, 0),
        "engine int4 dense": lambda: int4_dense(x, q4_by_output, s4, None, 0),
    }
    references = {"fp32 F.linear": x @ weight.t(), "torch int8pack": x @ dequantize_int8(q8, s8),
                  "engine int8": x @ dequantize_int8(q8, s8), "torch int4pack": x @ deq4, "engine int4": x @ deq4,
                  "engine int8 dense": x @ dequantize_int8(q8, s8), "engine int4 dense": x @ deq4}
    quantized = {"int8": (q8, s8, dequantize_int8(q8, s8)), "int4": (q4, s4, deq4)}
    for fmt in ("int8", "int4"):
        for level in SPARSE_LEVELS:
            threshold = float(x.abs().quantile(level))
            name = f"engine {fmt} sparse {level:.2f}"
            wt, scales, deq = quantized[fmt]
            products[name] = partial(_sparse_product, x, wt, ones, threshold, scales)
            references[name] = torch.where(x.abs() > threshold, x, 0.0) @ deq
    errors = {name: float((products[name]() - references[name]).abs().max()) for name in TIMED}
    return products, errors


def _sparse_product(x, wt, ones, threshold: float, scales) -> object:
    from prunewatch.engine.sparse.kernel import sparse_linear

    return sparse_linear(x, wt, None, ones, threshold, weight_scale=scales).output


def break_even(medians: dict[str, float], fmt: str) -> float | None:
    """The input sparsity at which the sparse kernel on `fmt` weights takes the dense integer product's time,
    linear between the timed sparsities; None where it is still slower at the sparsest."""
    dense = medians[f"engine {fmt} dense"]
    points = [(0.0, medians[f"engine {fmt}"])] + [(level, medians[f"engine {fmt} sparse {level:.2f}"])
                                                  for level in SPARSE_LEVELS]
    if points[0][1] <= dense:
        return 0.0
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if t1 <= dense:
            return round(s0 + (s1 - s0) * (t0 - dense) / (t0 - t1), 3)
    return None


STEP_KERNELS = ("fp32 F.linear", "engine int8 dense", "engine int4 dense")
"""The products a decode step's dense plan runs, timed over a whole step's weights."""
STEP_ROWS = (1, 4, 8)


def step_times(model_dir: Path, reps: int) -> dict:
    """A decode step's worth of weight products: every projection of every block, each with weights of its own.

    Why: the per-shape rows above repeat one layer, whose weights stay in cache; in a decode step every weight
    comes from DRAM once, so a product's speed there is how fast it streams its weights, which the cached rows
    do not show (a call's stream is one layer, short for the hardware prefetcher)."""
    import torch
    import torch.nn.functional as F

    from prunewatch.engine.sparse.kernel import int4_dense_kernel, int8_dense_kernel
    from prunewatch.engine.sparse.quantize import (
        pack_int4_by_output,
        pack_int8_by_output,
        quantize_int4,
        quantize_int8,
    )

    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    shapes = block_shapes(model_dir) * layers
    g = torch.Generator().manual_seed(len(shapes))
    fp32, int8, int4 = [], [], []
    for n_in, n_out in shapes:
        weight = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
        q8, s8 = quantize_int8(weight.t().contiguous())
        q4, s4 = quantize_int4(weight.t().contiguous())
        fp32.append(weight)
        int8.append((pack_int8_by_output(q8), s8))
        int4.append((pack_int4_by_output(q4), s4))
    int8_dense, int4_dense = int8_dense_kernel("cpu"), int4_dense_kernel("cpu")
    read_bytes = {"fp32 F.linear": sum(w.numel() * 4 for w in fp32),
                  "engine int8 dense": sum(q.numel() + s.numel() * 4 for q, s in int8),
                  "engine int4 dense": sum(q.numel() + s.numel() * 2 for q, s in int4)}
    steps: dict[str, Callable[[dict], object]] = {
        "fp32 F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in fp32],
        "engine int8 dense": lambda xs: [int8_dense(xs[q.shape[1] * 32], q, s, None, 0) for q, s in int8],
        "engine int4 dense": lambda xs: [int4_dense(xs[q.shape[1] * 32], q, s, None, 0) for q, s in int4]}
    by_rows: dict[str, dict] = {}
    for rows in STEP_ROWS:
        inputs = {n: torch.randn(rows, n, generator=g) for n in {n_in for n_in, _ in shapes}}
        times: dict[str, list[float]] = {name: [] for name in STEP_KERNELS}
        for r in range(reps + 1):  # the first round warms up
            for name in STEP_KERNELS[r % len(STEP_KERNELS):] + STEP_KERNELS[:r % len(STEP_KERNELS)]:
                started = time.perf_counter()
                steps[name](inputs)
                if r > 0:
                    times[name].append((time.perf_counter() - started) * 1e3)
        medians = {name: statistics.median(values) for name, values in times.items()}
        by_rows[str(rows)] = {name: {"ms": round(ms, 3), "gb_per_s": round(read_bytes[name] / ms / 1e6, 2),
                                     "vs_fp32": round(medians["fp32 F.linear"] / ms, 3)}
                              for name, ms in medians.items()}
    return {"layers": layers, "projections": len(shapes),
            "mb": {name: round(value / 1e6, 1) for name, value in read_bytes.items()}, "rows": by_rows}


HEAD_LEVELS = (0.5, 0.7, 0.9)
"""Input sparsities at which the int8 output head's shortlist is timed against its dense integer product."""


def head_times(model_dir: Path, reps: int, candidates: int = 1024) -> dict:
    """The int8 output head (prunewatch.engine.sparse.output_head) on a random (hidden, vocab) layer of the model's
    shape, one token row: median ms of its dense integer product and of its shortlist at each HEAD_LEVELS sparsity
    with `candidates` exact logits, each call as a decode step makes it (under an execution plan)."""
    import torch
    from torch import nn

    from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
    from prunewatch.engine.sparse.output_head import ShortlistHead

    config = json.loads((model_dir / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    g = torch.Generator().manual_seed(hidden + vocab)
    linear = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden ** 0.5)
    head = ShortlistHead(linear, weights="int8")
    x = torch.randn(1, 1, hidden, generator=g)
    plans = {"dense": ExecutionPlan(), **{f"shortlist {level:.2f}": ExecutionPlan(
        output_head_sparsity=level, output_head_candidates=candidates) for level in HEAD_LEVELS}}
    times: dict[str, list[float]] = {name: [] for name in plans}
    with torch.no_grad():
        for r in range(reps + 1):  # the first round warms up
            names = list(plans)[r % len(plans):] + list(plans)[:r % len(plans)]
            for name in names:
                started = time.perf_counter()
                for _ in range(5):
                    with executing(plans[name], ExecutionLedger()):
                        head(x)
                if r > 0:
                    times[name].append((time.perf_counter() - started) / 5 * 1e3)
    medians = {name: round(statistics.median(values), 3) for name, values in times.items()}
    return {"in": hidden, "out": vocab, "candidates": candidates, "ms": medians,
            "vs_dense": {name: round(medians["dense"] / value, 3) for name, value in medians.items()}}


def run(model_dir: Path, reps: int, threads: int | None, out: Path) -> dict:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    for n_in, n_out in layer_shapes(model_dir):
        products, errors = _products(n_in, n_out, seed=n_in * 31 + n_out)
        times: dict[str, list[float]] = {name: [] for name in TIMED}
        for product in products.values():  # warm-up
            for _ in range(10):
                product()
        for r in range(reps):
            for name in TIMED[r % len(TIMED):] + TIMED[:r % len(TIMED)]:
                started = time.perf_counter()
                for _ in range(20):
                    products[name]()
                times[name].append((time.perf_counter() - started) / 20 * 1e6)
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append({"in": n_in, "out": n_out, "kernels": {
            name: {"us": round(medians[name], 2), "vs_fp32": round(medians["fp32 F.linear"] / medians[name], 3),
                   "max_abs_error": errors[name]} for name in TIMED},
                     "break_even": {fmt: break_even(medians, fmt) for fmt in ("int8", "int4")}})
    result = {"created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": invocation("kernels"),
              "machine": machine_info("cpu"), "model": model_dir.name, "reps": reps, "method": METHOD, "rows": rows,
              "head": head_times(model_dir, reps), "step": step_times(model_dir, reps)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def format_table(result: dict) -> str:
    lines = [f"{'in x out':<12}" + "".join(f"{name:>18}" for name in KERNELS) + "   (us per token; vs fp32)"]
    for row in result["rows"]:
        cells = "".join(f"{row['kernels'][n]['us']:>10.1f} ({row['kernels'][n]['vs_fp32']:.2f}x)" for n in KERNELS)
        lines.append(f"{row['in']}x{row['out']:<8}" + cells)
    lines.append(f"{'in x out':<12}" + "".join(f"{name.removeprefix('engine '):>18}" for name in SPARSE_KERNELS)
                 + "   break-even sparsity (int8, int4)")
    for row in result["rows"]:
        cells = "".join(f"{row['kernels'][n]['us']:>10.1f} ({row['kernels'][n]['vs_fp32']:.2f}x)"
                        for n in SPARSE_KERNELS)
        even = row["break_even"]
        lines.append(f"{row['in']}x{row['out']:<8}" + cells + f"   {even['int8']}, {even['int4']}")
    head = result["head"]
    lines.append(f"int8 head {head['in']}x{head['out']}: " + ", ".join(
        f"{name} {ms:.2f} ms ({head['vs_dense'][name]:.2f}x)" for name, ms in head["ms"].items()))
    step = result.get("step")
    if step is not None:
        lines.append(f"a decode step's products from DRAM ({step['projections']} projections; "
                     + ", ".join(f"{name.removeprefix('engine ')} {mb} MB" for name, mb in step["mb"].items()) + "):")
        for rows, kernels in step["rows"].items():
            lines.append(f"  {rows} rows: " + ", ".join(
                f"{name.removeprefix('engine ')} {k['ms']:.2f} ms ({k['gb_per_s']:.1f} GB/s, {k['vs_fp32']:.2f}x)"
                for name, k in kernels.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prunewatch bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=models_root() / DEFAULT_MODEL)
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per kernel and shape (20 calls each)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "weight-kernels-cpu.json")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `prunewatch models pull`)")
    result = run(args.model_dir, args.reps, args.threads, args.out)
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
