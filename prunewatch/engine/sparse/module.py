"""SparseLinear: a linear layer that zeroes small inputs and skips the weights they would multiply.

It wraps an existing nn.Linear (or GPT-2 Conv1D) without copying any model code. Under an
execution plan that asks for activation sparsity, a call with few rows (decode steps) goes to the
sparse kernel of its device (compiled C++ on the CPU, Triton on CUDA), which reads only the weight
rows of active input channels and reports how many it read. Its decoder block counted the layer
as dense work when it started; the call takes 2 x (in - active) x out x rows FLOPs (the weight rows
it never read) back off the ledger. A call with many rows (a long prefill) is compute-bound, where
skipping rows of a weight matrix saves no time: it applies the same mask and runs the dense layer,
which stays counted as dense work. Without a plan, or with a target of 0, the dense layer runs
untouched and is counted as dense. Under a row-invariant plan (the CPU's eager and batched decoding) a dense call, or
a masked chunk, of up to ROW_INVARIANT_CHUNK_ROWS rows multiplies through the fp32 row-invariant product instead,
so a prefill chunk and the decode rows riding along its packed pass can share one call (`_joined`).

With int8 or int4 weights (SparsityOptions.weights, prunewatch/engine/sparse/quantize.py) a decode step reads a
quarter (int8) or about a sixth (int4) of the fp32 bytes whether or not it prunes. A sparse call with few rows reads
the active quantized rows and their scales through the kernel (int4: the scales and minimums of every group,
counted in full per call), and only from the sparsity where that pays (SparsityOptions.quantized_sparse_from). A
dense call with few rows multiplies a second copy of the weights laid out by output as the integers they are, on
inputs rounded to int16 per group of 32 (csrc/int4_dense.cpp, csrc/int8_dense.cpp: 2.7-4.2x (int8) and 2.3-3.9x
(int4) the speed of the kernel widening each weight to fp32 in bench/results/weight-kernels-cpu.json); an int8 layer
whose sizes are not whole groups reads every row through the kernel instead. The wrapped layer keeps the
dequantized weights in fp32 for calls with many rows (a prefill, where a BLAS product is faster than converting
quantized weights row by row) and for head-gated slices: every path multiplies by the same weights, so the model is
the quantized model throughout, at 1.5x (int8) or about 1.28x (int4) the bytes of its fp32 weights, as computed
from the layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from prunewatch.engine.execution import (
    COMPILED_STEP,
    ExecutionLedger,
    ExecutionPlan,
    Segment,
    current_execution,
    per_segment,
)
from prunewatch.engine.sparse.kernel import (
    SparseKernelUnavailableError,
    device_kernel,
    fp32_dense_kernel,
    int4_dense_kernel,
    int8_dense_kernel,
    threshold_mask_kernel,
)
from prunewatch.engine.sparse.quantize import (
    WeightFormat,
    dequantize_int4,
    dequantize_int8,
    int4_fits,
    int8_by_output_fits,
    pack_int4_by_output,
    pack_int8_by_output,
    quantize_int4,
    quantize_int8,
)
from prunewatch.engine.sparse.targets import DEFAULT_PROJECTIONS, LinearWrapper, in_out, is_conv1d, projection_family
from prunewatch.engine.sparse.thresholds import LayerThresholds

# A prefill chunk of up to this many rows runs the fp32 row-invariant product (csrc/fp32_dense.cpp) under a
# row-invariant plan, where a longer one runs BLAS. Measured by hand on SmolLM2-135M's decoder shapes (2 threads,
# AVX-512, weights streamed from memory, interleaved): about as fast as BLAS at 30 rows, 0.92x at 54, 0.86x at 128
# (PREFILL_CHUNK), where the shared read below no longer pays for it. A packed pass's decode rows then share the
# chunk's call (SparseLinear._joined): one read of each weight and one product instead of two. Served, dense requests
# at 4 clients, packed passes took 104-107 ms against 115-118 ms with every chunk through BLAS
# (bench/results/load-cpu-levels-1-4-joined-*.json against -before-joined-*.json; README "Serving under load").
ROW_INVARIANT_CHUNK_ROWS = 64


class SparsityOptions(BaseModel):
    """How activation sparsity is installed on a model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    projections: tuple[str, ...] = Field(
        DEFAULT_PROJECTIONS, min_length=1,
        description="Names of the linear layers inside each decoder block that get sparse inputs.")
    max_kernel_rows: int = Field(
        16, ge=1, le=4096,
        description=(
            "Calls with more token rows run masked-then-dense and count as dense work: with many "
            "rows the union of active channels is nearly all of them and a dense GEMM is faster."))
    kernel_threads: int = Field(
        0, ge=0, le=1024,
        description=(
            "Threads per kernel call; 0 uses torch's intra-op threads. 1 avoids a parallel region "
            "per call, which pays off on a host whose cores are busy with other work."))
    share_weight_storage: bool = Field(
        True,
        description=(
            "Keep one copy of each weight: the dense layer reads the kernel's transposed copy "
            "through a view. False keeps the original layout for the dense path too (2x memory)."))
    weights: WeightFormat = Field(
        "fp32",
        description=(
            "How the kernel holds the weights: fp32, int8 with one scale per output channel (a quarter of "
            "the bytes a decode step reads; CPU only), or int4 in groups of 32 input channels (an eighth, plus "
            "fp16 scales and minimums; layers whose sizes are not multiples of 32 stay int8)."))
    quantized_sparse_from: float = Field(
        0.0, ge=0.0, le=1.0,
        description=(
            "With int8 or int4 weights, the sparsity a layer must be asked for before it reads the active rows; "
            "below it the layer takes the dense integer product of its weights laid out by output, which on a CPU "
            "is faster than the sparse kernel until most rows are skipped (prunewatch.engine.settings."
            "EngineSettings.quantized_sparse_from gives the measured default). 1 never prunes quantized layers."))


class SparseLinear(LinearWrapper):
    """An nn.Linear (or Conv1D) whose inputs are thresholded per request and computed sparsely."""

    def __init__(
        self,
        linear: nn.Module,
        layer: int,
        name: str,
        thresholds: LayerThresholds,
        scale: torch.Tensor,
        options: SparsityOptions,
        sparsity: LayerThresholds | None = None,
    ) -> None:
        super().__init__()
        self.linear = linear
        self.layer = layer  # decoder block index, for per-layer targets
        self.name = name  # path inside the block, e.g. "mlp.down_proj"
        self.family = projection_family(name)  # attn_in / attn_out / mlp_in / mlp_out: the plan scales by it
        self.thresholds = thresholds
        # the layer's own sparsity at a request's target (its allocation; None: the target itself)
        self.sparsity = sparsity if sparsity is not None else LayerThresholds((0.0, 1.0), (0.0, 1.0))
        self.in_features, self.out_features = in_out(linear)
        self.max_kernel_rows = options.max_kernel_rows
        self.kernel_threads = options.kernel_threads
        self._conv1d = is_conv1d(linear)
        weight = linear.weight.detach()
        # What the decoder block counts as this layer's dense read per call (instrumented before wrapping).
        self._counted_bytes = weight.numel() * weight.element_size()
        if self._conv1d:
            weight_t = weight.contiguous()  # Conv1D stores (in, out) already
        else:
            weight_t = weight.t().contiguous()  # (in, out): one contiguous row per input channel
        weight_scale = None
        self.quantized = options.weights != "fp32"
        self.sparse_from = options.quantized_sparse_from if self.quantized else 0.0
        # int4 where the sizes allow it (multiples of 32), else int8
        self.weight_format: WeightFormat = options.weights if options.weights != "int4" or int4_fits(
            self.in_features, self.out_features) else "int8"
        if self.quantized:
            if weight.device.type != "cpu":
                raise SparseKernelUnavailableError(
                    f"{options.weights} weights have a CPU kernel only; the model is on {weight.device.type}")
            if self.weight_format == "int4":
                weight_t, weight_scale = quantize_int4(weight_t)
                exact = dequantize_int4(weight_t, weight_scale).to(weight.dtype)
            else:
                weight_t, weight_scale = quantize_int8(weight_t)
                exact = dequantize_int8(weight_t, weight_scale).to(weight.dtype)  # the values the kernel multiplies by
            linear.weight = nn.Parameter(exact if self._conv1d else exact.t(), requires_grad=False)
        elif not self._conv1d and options.share_weight_storage:
            linear.weight = nn.Parameter(weight_t.t(), requires_grad=False)
        self.register_buffer("weight_t", weight_t, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        # int4 and int8: the same weights laid out by output, for the dense product of few rows
        # (csrc/int4_dense.cpp, csrc/int8_dense.cpp); an int8 layer whose sizes do not fit reads its rows instead
        by_output, self._quantized_dense_kernel = None, None
        if self.weight_format == "int4":
            by_output, self._quantized_dense_kernel = pack_int4_by_output(weight_t), int4_dense_kernel(weight.device)
        elif self.quantized and int8_by_output_fits(self.in_features, self.out_features):
            by_output, self._quantized_dense_kernel = pack_int8_by_output(weight_t), int8_dense_kernel(weight.device)
        self.register_buffer("weight_by_output", by_output, persistent=False)
        self.register_buffer("scale", scale.to(weight.device, torch.float32).contiguous(), persistent=False)
        self._kernel = device_kernel(weight.device)  # resolved once: a decode step makes ~7 calls per block
        # fp32 on the CPU: the dense product of few rows splits the outputs over threads (csrc/fp32_dense.cpp)
        self._fp32_dense = None if self.quantized else fp32_dense_kernel(weight.device, weight_t.dtype)
        self._threshold_mask = threshold_mask_kernel(weight.device, torch.float32)  # a prefill's mask, in one pass
        self._kernel_is_cuda = weight.device.type == "cuda"  # a model moved after installing resolves per call
        self._bias = (linear.bias,)  # a tuple: read per call without nn.Module's attribute lookup
        self._dense_flops_per_row = 2 * self.in_features * self.out_features
        self._flops_per_active_row = 2 * self.out_features  # per active input channel and token row
        self._bytes_per_active = weight_t.shape[1] * weight_t.element_size()  # one weight row read (int4: out / 2)
        self._scale_bytes = 0 if weight_scale is None else weight_scale.numel() * weight_scale.element_size()
        self._thresholds_by_target: dict[float, float] = {}
        # (plan, target_under(plan)) of the last call: a request's ~7 calls per block per token share one
        # plan, and hashing a frozen plan costs more than the comparison by identity.
        self._last_target: tuple[ExecutionPlan | None, float] = (None, 0.0)
        self.init_compiled_call()

    @property
    def dense_read_bytes(self) -> int:
        """Bytes a dense call with few rows reads: the fp32 weights, or the int8 / int4 rows and their scales."""
        return self._bytes_per_active * self.in_features + self._scale_bytes

    @property
    def counted_bytes(self) -> int:
        """Bytes the decoder block counts for this layer per call (its weights as loaded)."""
        return self._counted_bytes

    def restore(self) -> nn.Module:
        """The wrapped layer with a contiguous weight of its original layout, for uninstalling."""
        if not self._conv1d and not self.linear.weight.is_contiguous():
            self.linear.weight = nn.Parameter(self.linear.weight.detach().contiguous(),
                                              requires_grad=self.linear.weight.requires_grad)
        return self.linear

    def extra_repr(self) -> str:
        return f"layer={self.layer}, name={self.name}, in={self.in_features}, out={self.out_features}"

    def target_under(self, plan: ExecutionPlan) -> float:
        """This layer's activation-sparsity target under `plan` (its block's, times its family's factor), or 0
        where the layer's own share of that target is below the sparsity its weights prune from
        (SparsityOptions.quantized_sparse_from): it then multiplies dense, counted as dense."""
        target = plan.sparsity_for(self.layer, self.family)
        if target > 0.0 and self.sparse_from > 0.0 and self.sparsity.at(target) < self.sparse_from:
            return 0.0
        return target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._compiled(x)
        # a prefill chunk with decode rows riding along: in one row-invariant call where both parts would run one,
        # else each on its own
        packed = per_segment(x, self.forward, self._joined)
        if packed is not None:
            return packed
        execution = current_execution()
        if execution is None:
            return self.linear(x)
        plan, ledger = execution
        target = self._target(plan)
        if target <= 0.0:
            if self.quantized or plan.row_invariant:
                return self._quantized_dense(x, ledger, row_invariant=plan.row_invariant)
            return self._dense(x)
        in_features = self.in_features
        rows = x.numel() // in_features
        dense_flops = self._dense_flops_per_row * rows
        ledger.sparse_dense_flops += dense_flops
        ledger.sparse_input_entries += rows * in_features
        keep = -1 if plan.sparsity_policy != "shared" else self._shared_keep(plan, x, target)
        threshold = self._threshold(target)
        if rows > self.max_kernel_rows:
            return self._masked_dense(x, ledger, threshold, keep, dense_flops, row_invariant=plan.row_invariant)
        # The decode hot path (~7 calls per block per token): buffers read directly, the bias and
        # per-channel costs precomputed, and the skipped work taken off the ledger in hand rather
        # than through record_skipped_work, which would look the active execution up again.
        buffers = self._buffers
        kernel = self._kernel if x.is_cuda == self._kernel_is_cuda else device_kernel(x.device)
        output, active, kept = kernel(x if x.dim() == 2 else x.reshape(rows, in_features), buffers["weight_t"],
                                      self._bias[0], buffers["scale"], threshold, keep, self.kernel_threads,
                                      buffers["weight_scale"])
        executed = self._flops_per_active_row * active * rows
        # The block counted this layer dense; the kernel's own count of active channels says what it skipped.
        ledger.executed_flops -= dense_flops - executed
        ledger.weight_bytes_read -= self._counted_bytes - self._bytes_per_active * active - self._scale_bytes
        ledger.sparse_executed_flops += executed
        ledger.sparse_kept_entries += kept
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)

    def _target(self, plan: ExecutionPlan) -> float:
        """target_under(plan), remembered for the last plan: a request's ~7 calls per block per token share one."""
        last_plan, target = self._last_target  # one tuple read: threads may replace it concurrently
        if last_plan is not plan:
            target = self.target_under(plan)
            self._last_target = (plan, target)  # holds the plan, so `is` can never match a reused id
        return target

    def _threshold(self, target: float) -> float:
        threshold = self._thresholds_by_target.get(target)
        if threshold is None:
            threshold = self._thresholds_by_target.setdefault(target, self.thresholds.at(target))
        return threshold

    def _fp32_product(self, x: torch.Tensor) -> bool:
        """Whether the fp32 row-invariant product (csrc/fp32_dense.cpp) can multiply `x`: fp32 weights and inputs on
        the CPU."""
        return self._fp32_dense is not None and x.dtype == torch.float32 and x.device.type == "cpu"

    def _row_invariant_chunk(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a row-invariant call of `rows` rows (more than max_kernel_rows: a prefill chunk) multiplies through
        the fp32 row-invariant product rather than BLAS: at most ROW_INVARIANT_CHUNK_ROWS rows it can multiply."""
        return rows <= ROW_INVARIANT_CHUNK_ROWS and self._fp32_product(x)

    def _joins(self, x: torch.Tensor, plan: ExecutionPlan, target: float) -> bool:
        """Whether a call of `x`'s rows under `plan` runs the fp32 row-invariant product, whose every row's sums
        depend on that row alone (so a packed pass's parts may share one call): under a row-invariant plan, dense at
        few rows or in a chunk (`_quantized_dense`), or masked at a row policy's threshold in a chunk
        (`_masked_dense`)."""
        if not plan.row_invariant:
            return False
        rows = x.numel() // self.in_features
        if target <= 0.0:
            return rows <= max(self.max_kernel_rows, ROW_INVARIANT_CHUNK_ROWS) and self._fp32_product(x)
        return (rows > self.max_kernel_rows and self._row_invariant_chunk(x, rows) and self._threshold_mask is not None
                and self._shared_keep(plan, x, target) < 0)

    def _row_invariant_rows(self, x: torch.Tensor, plan: ExecutionPlan, ledger: ExecutionLedger,
                            target: float) -> torch.Tensor:
        """`x`'s rows as the row-invariant product multiplies them (masked at the target's threshold where it is
        above 0), counted on `ledger` as the call of those rows alone counts them (`_quantized_dense`,
        `_masked_dense`)."""
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if target <= 0.0:
            ledger.weight_bytes_read -= self._counted_bytes - self.dense_read_bytes
            return flat
        dense_flops = self._dense_flops_per_row * rows
        ledger.sparse_dense_flops += dense_flops
        ledger.sparse_input_entries += rows * self.in_features
        return self._masked_rows(flat, ledger, self._threshold(target), dense_flops)

    def _masked_rows(self, x: torch.Tensor, ledger: ExecutionLedger, threshold: float,
                     dense_flops: int) -> torch.Tensor:
        """`x` with its entries below the threshold zeroed in one pass (csrc/threshold_mask.cpp), counted as the
        dense work the product that follows does."""
        assert self._threshold_mask is not None
        ledger.sparse_executed_flops += dense_flops
        masked, kept = self._threshold_mask(x.contiguous(), self.scale, threshold)
        ledger.sparse_kept_entries += kept
        return masked

    def _row_invariant_product(self, parts: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The row-invariant product of the rows of `parts`, in one call, shaped `shape` + (out,)."""
        assert self._fp32_dense is not None
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        output = self._fp32_dense(flat, self._buffers["weight_t"], self._bias[0], self.kernel_threads)
        return output.reshape(*shape, self.out_features)

    def _joined(self, chunk: Segment, tail: Segment) -> torch.Tensor | None:
        """A packed pass's chunk rows and decode rows in one call of the row-invariant product, when each part alone
        would run that product: each row gets the bits of its own part's call (its sums depend on it alone), each
        part is counted in its own ledger as its call would be, and the weights are read once for both. None
        otherwise (the parts run apart)."""
        (chunk_x, chunk_plan, chunk_ledger), (tail_x, tail_plan, tail_ledger) = chunk, tail
        chunk_target, tail_target = self._target(chunk_plan), self._target(tail_plan)
        if not (self._joins(chunk_x, chunk_plan, chunk_target) and self._joins(tail_x, tail_plan, tail_target)):
            return None
        parts = [self._row_invariant_rows(chunk_x, chunk_plan, chunk_ledger, chunk_target),
                 self._row_invariant_rows(tail_x, tail_plan, tail_ledger, tail_target)]
        return self._row_invariant_product(parts, torch.Size((*chunk_x.shape[:-2], sum(p.shape[0] for p in parts))))

    def _compiled(self, x: torch.Tensor) -> torch.Tensor:
        """The layer inside a compiled decode step: dense, or the counted kernel at the threshold in force."""
        if not self.counting or not (COMPILED_STEP.sparse or self.quantized):
            return self._dense(x)
        # int8 weights go through the kernel in every graph: at target 0 its threshold reads every row
        output = self.counted_call(x.reshape(-1, self.in_features), self.weight_t, self._bias[0], self.scale,
                                   self.weight_scale, self.weight_by_output)
        return output.reshape(*x.shape[:-1], self.out_features)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped layer's own product. nn.Linear is computed directly (one module call less on the
        dense decode path, ~7 per block per token) unless something hooked it, which then still fires."""
        linear = self.linear
        if self._conv1d or linear._forward_hooks or linear._forward_pre_hooks:
            return linear(x)
        return F.linear(x, linear.weight, linear.bias)

    def _quantized_dense(self, x: torch.Tensor, ledger: ExecutionLedger, row_invariant: bool = False) -> torch.Tensor:
        """The dense product when the call has few rows: int4 or int8 laid out by output (csrc/int4_dense.cpp,
        csrc/int8_dense.cpp), fp32 on the CPU with the outputs split over threads (csrc/fp32_dense.cpp), else the
        kernel reading every row (int8 / int4: the block counted the fp32 bytes, the call read the quantized rows and
        their scales; fp32 under a row-invariant plan: the same bytes); with many rows the wrapped layer on the
        dequantized weights (a prefill: compute-bound, where BLAS is faster), except an fp32 chunk of up to
        ROW_INVARIANT_CHUNK_ROWS rows under a row-invariant plan (`row_invariant`), which takes the fp32 product."""
        rows = x.numel() // self.in_features
        if rows > self.max_kernel_rows and not (row_invariant and self._row_invariant_chunk(x, rows)):
            return self._dense(x)
        buffers = self._buffers
        flat = x if x.dim() == 2 else x.reshape(rows, self.in_features)
        if self._quantized_dense_kernel is not None:
            output = self._quantized_dense_kernel(flat, buffers["weight_by_output"], buffers["weight_scale"],
                                                  self._bias[0], self.kernel_threads)
        elif self._fp32_product(flat):
            output = self._fp32_dense(flat, buffers["weight_t"], self._bias[0], self.kernel_threads)
        else:
            kernel = self._kernel if x.is_cuda == self._kernel_is_cuda else device_kernel(x.device)
            output, _, _ = kernel(flat, buffers["weight_t"], self._bias[0], buffers["scale"], -1.0, -1,
                                  self.kernel_threads, buffers["weight_scale"])
        ledger.weight_bytes_read -= self._counted_bytes - self.dense_read_bytes
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)

    def _shared_keep(self, plan: ExecutionPlan, x: torch.Tensor, target: float) -> int:
        """Channels the rows share under the shared policy at a decode step; -1 for the row policy."""
        decode_step = x.dim() == 2 or (x.dim() == 3 and x.shape[1] == 1)
        if plan.sparsity_policy != "shared" or not decode_step:
            return -1
        return max(1, round((1.0 - target) * self.in_features))

    def _masked_dense(self, x: torch.Tensor, ledger: ExecutionLedger, threshold: float, keep: int,
                      dense_flops: int, row_invariant: bool = False) -> torch.Tensor:
        """Same mask as the kernel, dense matmul: it stays counted as the dense work its block counted. The product is
        BLAS's, or under a row-invariant plan the fp32 row-invariant one for a chunk of up to
        ROW_INVARIANT_CHUNK_ROWS rows."""
        if keep < 0 and self._threshold_mask is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            masked = self._masked_rows(x, ledger, threshold, dense_flops)  # the operators below, one pass
            if row_invariant and self._row_invariant_chunk(x, x.numel() // self.in_features):
                return self._row_invariant_product([masked.reshape(-1, self.in_features)], x.shape[:-1])
            return self.linear(masked)
        ledger.sparse_executed_flops += dense_flops
        scale = self.scale.to(x.device)
        score = x.abs().float() * scale  # (..., in)
        if keep < 0:
            mask = score > threshold
        else:
            flat = score.reshape(-1, self.in_features).sum(dim=0)  # (in,)
            mask = torch.zeros(self.in_features, dtype=torch.bool, device=x.device)
            mask[torch.topk(flat, keep).indices] = True
            mask = mask.expand_as(score)
        ledger.sparse_kept_entries += int((mask & (x != 0)).sum()) if keep >= 0 else int(mask.sum())
        return self.linear(x * mask)
