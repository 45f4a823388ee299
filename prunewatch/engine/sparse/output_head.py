"""ShortlistHead: the output head (LM head) computed from a sparse input, then exact for a shortlist.

Why: on a small model with a large vocabulary the output head is a fifth of the decode work
(SmolLM2-135M: 49152 x 576 of 135 M weights) and activation sparsity of the decoder's linears never
touches it. Its input, the final normed hidden state, can be thresholded like any other: zeroing
the smallest entries gives approximate logits that rank the vocabulary well but not exactly (on
SmolLM2 at input sparsity 0.7 the approximate argmax matches the dense one on only ~52% of tokens).
The exact logit of the right token is nearly always among the approximate top few hundred, so the
head then computes exact logits for its `candidates` highest approximate ones and keeps the
approximation for the rest: the argmax is the dense one unless the dense winner fell out of the
shortlist, and what is sampled from the tail is approximate. Measured on SmolLM2 with 1024 candidates
(bench/results/frontier-SmolLM2-135M-Instruct.json, row "output head 0.6"): input sparsity 0.6 kept
reference-scored agreement 1.000 on the 63 evaluation prompts and held-out perplexity (the three passages of
prunewatch/probes/heldout.txt) +0.14% (prunewatch.engine.settings.DEFAULT_OUTPUT_HEAD_SPARSITY).

Work counted is work done: at a decode step (rows <= max_kernel_rows) each row runs the sparse
kernel, which reads only the weight rows of its kept input entries, and the shortlist's rows of
W; the head's dense work is counted alongside, so the ledger's ratio includes what the head
skipped. A call with many rows (teacher-forced scoring) applies the same masks with a dense
product and counts it as dense work, plus the shortlist, unless the plan asks for the kernel on every
row (`output_head_row_kernel`: an echoed prompt, scored as the request's own prefill).

The head keeps its own transposed copy of W for the kernel (one contiguous row per input
channel), so a head tied to the input embeddings stays tied; the copy costs vocab x hidden
weights of memory.

With int8 weights (`weights="int8"`, prunewatch/engine/sparse/quantize.py) that copy is int8 with one scale
per vocabulary entry, a quarter of the bytes, and every sparse call with few rows reads it; a dense call with
few rows reads a second int8 copy laid out by output and multiplies it as integers on inputs rounded to int16
per group of 32 (csrc/int8_dense.cpp), counted as dense work. The head's own fp32 weight is overwritten with the
dequantized values, so calls with many rows (BLAS), the shortlist's exact logits and a tied input
embedding all use the int8 model's values; the original fp32 weights are not kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prunewatch.engine.execution import COMPILED_STEP, ExecutionLedger, current_execution, per_segment
from prunewatch.engine.sparse.kernel import (
    SparseKernelUnavailableError,
    device_kernel,
    fp32_dense_kernel,
    int8_dense_kernel,
)
from prunewatch.engine.sparse.quantize import (
    WeightFormat,
    dequantize_int8,
    int8_by_output_fits,
    pack_int8_by_output,
    quantize_int8,
)
from prunewatch.engine.sparse.targets import LinearWrapper, in_out

RESCORE_CHUNK_ROWS = 16  # rows whose shortlist weights are gathered at once: 16 x 1024 x hidden floats


class ShortlistHead(LinearWrapper):
    """The model's output head, sparse-input approximate logits plus exact logits for a shortlist."""

    def __init__(self, linear: nn.Linear, max_kernel_rows: int = 16, kernel_threads: int = 0,
                 weights: WeightFormat = "fp32") -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"the output head must be an nn.Linear, got {type(linear).__name__}")
        self.linear = linear
        self.in_features, self.out_features = in_out(linear)
        self.max_kernel_rows = max_kernel_rows
        self.kernel_threads = kernel_threads
        weight = linear.weight.detach()
        weight_t, weight_scale = weight.t().contiguous(), None  # (hidden, vocab)
        self.quantized = weights != "fp32"  # int8 under int4 weights too: GGUFs ship the embedding at 8 bits
        if self.quantized:
            if weight.device.type != "cpu":
                raise SparseKernelUnavailableError(
                    f"int8 weights have a CPU kernel only; the model is on {weight.device.type}")
            weight_t, weight_scale = quantize_int8(weight_t)
            with torch.no_grad():  # every path multiplies by the int8 values (a tied input embedding reads them too)
                linear.weight.copy_(dequantize_int8(weight_t, weight_scale).t())
        self.register_buffer("weight_t", weight_t, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)  # (vocab,) for int8, else None
        # int8: the same weights laid out by output, for the dense product of few rows (csrc/int8_dense.cpp)
        fits = self.quantized and int8_by_output_fits(self.in_features, self.out_features)
        self.register_buffer("weight_by_output", pack_int8_by_output(weight_t) if fits else None, persistent=False)
        self._int8_dense = int8_dense_kernel(weight.device) if fits else None
        self.register_buffer("ones", torch.ones(self.in_features, dtype=torch.float32, device=weight.device),
                             persistent=False)
        self._kernel = device_kernel(weight.device)
        self._fp32_dense = None if self.quantized else fp32_dense_kernel(weight.device, weight_t.dtype)
        self._dense_flops_per_row = 2 * self.in_features * self.out_features
        self._bytes_per_input_row = self.out_features * weight_t.element_size()  # one row of W^T
        self.scale_bytes = 0 if weight_scale is None else weight_scale.numel() * weight_scale.element_size()  # int8 only
        self._bytes_per_vocab_row = self.in_features * weight.element_size()  # one row of W
        # Compiled decode steps: a top-k per row (its size set per request); the shortlist size is a
        # setting, so a constant of the graph (COMPILED_STEP.shortlist).
        self.init_compiled_call()

    @property
    def dense_read_bytes(self) -> int:
        """Bytes the kernel reads for a dense call of the head: every input row of its copy, and int8 scales."""
        return self._bytes_per_input_row * self.in_features + self.scale_bytes

    def extra_repr(self) -> str:
        return f"in={self.in_features}, vocab={self.out_features}"

    def kept_inputs(self, sparsity: float) -> int:
        """Input entries a row keeps at `sparsity` (its largest by magnitude), at least one."""
        return max(1, round((1.0 - sparsity) * self.in_features))

    def shortlist_size(self, candidates: int) -> int:
        return max(1, min(int(candidates), self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._compiled(x)
        packed = per_segment(x, self.forward)  # a prefill chunk's last row and decode rows: each under its own plan
        if packed is not None:
            return packed
        execution = current_execution()
        if execution is None or execution[0].output_head_sparsity <= 0.0:
            if execution is not None and (self.quantized or execution[0].row_invariant):
                return self._quantized_dense(x, execution[1])
            return self.linear(x)  # the head's counting hook sees a dense call
        plan, ledger = execution
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        keep = self.kept_inputs(plan.output_head_sparsity)
        shortlist = self.shortlist_size(plan.output_head_candidates)
        ledger.dense_flops += self._dense_flops_per_row * rows
        if rows <= self.max_kernel_rows or plan.output_head_row_kernel:
            logits = self._sparse_rows(flat, keep, ledger)
        else:
            logits = self._masked_dense(flat, keep, ledger)
        self._rescore(flat, logits, shortlist, ledger)
        return logits.reshape(*x.shape[:-1], self.out_features)

    def _compiled(self, x: torch.Tensor) -> torch.Tensor:
        """The head inside a compiled decode step (one token row): dense, or kernel plus exact shortlist."""
        if not self.counting or not (COMPILED_STEP.output_head or self.quantized):
            return self.linear(x)
        flat = x.reshape(-1, self.in_features)
        logits = self.counted_call(flat, self.weight_t, self.linear.bias, self.ones, self.weight_scale,
                                   self.weight_by_output)  # taken only by a dense call (top-k -1)
        if COMPILED_STEP.output_head:  # else: the int8 head read in full (its top-k is -1), exact already
            self._rescore(flat, logits, COMPILED_STEP.shortlist, None)
        return logits.reshape(*x.shape[:-1], self.out_features)

    def _sparse_rows(self, flat: torch.Tensor, keep: int, ledger: ExecutionLedger) -> torch.Tensor:
        """One kernel call per row: each reads the weight rows of its own `keep` largest entries."""
        kernel = self._kernel if flat.device.type == self.weight_t.device.type else device_kernel(flat.device)
        bias = self.linear.bias
        outputs = []
        for row in flat.split(1):
            output, active, _ = kernel(row, self.weight_t, bias, self.ones, 0.0, keep, self.kernel_threads,
                                       self.weight_scale)
            ledger.executed_flops += 2 * self.out_features * int(active)
            ledger.weight_bytes_read += self._bytes_per_input_row * int(active) + self.scale_bytes
            outputs.append(output)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _quantized_dense(self, x: torch.Tensor, ledger: ExecutionLedger) -> torch.Tensor:
        """The dense head on int8 weights (or fp32 under a row-invariant plan) when the call has few rows: int8 laid
        out by output and multiplied as integers on int16-rounded inputs (csrc/int8_dense.cpp), fp32 on the CPU with
        the outputs split over threads (csrc/fp32_dense.cpp), else the kernel reading every input row; counted here as
        the dense work it is (the counting hook fires on the wrapped layer's calls only). The wrapped fp32 layer
        otherwise (many rows: compute-bound, BLAS is faster)."""
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows > self.max_kernel_rows:
            return self.linear(x)
        if self._int8_dense is not None:
            output = self._int8_dense(flat, self.weight_by_output, self.weight_scale, self.linear.bias,
                                      self.kernel_threads)
        elif self._fp32_dense is not None and flat.dtype == torch.float32 and flat.device.type == "cpu":
            output = self._fp32_dense(flat, self.weight_t, self.linear.bias, self.kernel_threads)
        else:
            kernel = self._kernel if flat.device.type == self.weight_t.device.type else device_kernel(flat.device)
            output, _, _ = kernel(flat, self.weight_t, self.linear.bias, self.ones, -1.0, -1, self.kernel_threads,
                                  self.weight_scale)
        work = self._dense_flops_per_row * rows
        ledger.dense_flops += work
        ledger.executed_flops += work
        ledger.weight_bytes_read += self.dense_read_bytes
        return output.reshape(*x.shape[:-1], self.out_features)

    def _masked_dense(self, flat: torch.Tensor, keep: int, ledger: ExecutionLedger) -> torch.Tensor:
        """The same per-row masks, one dense product: counted as the dense work it is."""
        kept = flat.abs().topk(keep, dim=-1).indices
        masked = torch.zeros_like(flat).scatter_(-1, kept, flat.gather(-1, kept))
        ledger.executed_flops += self._dense_flops_per_row * flat.shape[0]
        ledger.weight_bytes_read += self._bytes_per_input_row * self.in_features
        return F.linear(masked, self.linear.weight, self.linear.bias)

    def _rescore(self, flat: torch.Tensor, logits: torch.Tensor, shortlist: int,
                 ledger: ExecutionLedger | None) -> None:
        """Replace the `shortlist` highest approximate logits of each row by exact ones, in place; counted
        on `ledger` unless None (a compiled step, counted from its plan)."""
        weight, bias = self.linear.weight, self.linear.bias
        chosen = logits.topk(shortlist, dim=-1, sorted=False).indices  # (rows, shortlist)
        for start in range(0, flat.shape[0], RESCORE_CHUNK_ROWS):
            ids = chosen[start:start + RESCORE_CHUNK_ROWS]
            rows = flat[start:start + RESCORE_CHUNK_ROWS]
            # index_select copies whole rows of W (contiguous, in_features wide): ~3x faster than W[ids]
            gathered = weight.index_select(0, ids.reshape(-1)).view(*ids.shape, self.in_features)
            exact = torch.bmm(gathered, rows.unsqueeze(-1).to(gathered.dtype)).squeeze(-1)  # (chunk, shortlist)
            if bias is not None:
                exact = exact + bias.index_select(0, ids.reshape(-1)).view(ids.shape)
            logits[start:start + RESCORE_CHUNK_ROWS].scatter_(-1, ids, exact.to(logits.dtype))
        if ledger is not None:
            ledger.executed_flops += 2 * shortlist * self.in_features * flat.shape[0]
            ledger.weight_bytes_read += self._bytes_per_vocab_row * shortlist * flat.shape[0]


def install_shortlist_head(model: nn.Module, max_kernel_rows: int = 16, kernel_threads: int = 0,
                           weights: WeightFormat = "fp32") -> ShortlistHead:
    """Put a ShortlistHead in place of the model's output embeddings (idempotent); it runs dense until a
    plan asks for output-head sparsity. Raises SparseKernelUnavailableError where no kernel can run, and
    ValueError when a head already installed holds weights of another format."""
    head = model.get_output_embeddings()
    if isinstance(head, ShortlistHead):
        if head.quantized != (weights != "fp32"):
            raise ValueError(f"the output head is installed with {'int8' if head.quantized else 'fp32'} weights, "
                             f"not {weights}")
        return head
    wrapper = ShortlistHead(head, max_kernel_rows=max_kernel_rows, kernel_threads=kernel_threads, weights=weights)
    model.set_output_embeddings(wrapper)
    return wrapper
