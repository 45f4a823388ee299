// The dense product of fp32 weights for the few rows of a decode step, row by row invariant (fp32_dense.cpp).
#pragma once

#include <torch/extension.h>

namespace prunewatch {

// y (rows, out) = x (rows, in) @ wt (+ bias), x and wt float32, wt = W^T contiguous (in, out). Each output is one
// chain of fused multiply-adds over the inputs in order, so a row's bits depend on that row alone, not on the other
// rows nor on the thread count. threads <= 0: torch's intra-op thread count.
at::Tensor fp32_dense_linear(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias,
                             int64_t threads);

}  // namespace prunewatch
