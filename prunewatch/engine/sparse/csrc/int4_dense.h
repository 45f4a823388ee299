// The dense decode product of int4 weights laid out by output, on inputs rounded to int16 (int4_dense.cpp).
#pragma once

#include <torch/extension.h>

namespace prunewatch {

// y (rows, out) = x (rows, in) times the int4 weights (+ bias), each group of 32 inputs of x rounded to int16 with a
// scale of its own. by_output: uint8 (out / 16, in / 32, 8, 32) (quantize.pack_int4_by_output); scales: float16
// (in / 32, 2, out), the sparse kernel's int4 scales and minimums. threads <= 0: torch's intra-op thread count.
at::Tensor int4_dense_linear(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias, int64_t threads);

}  // namespace prunewatch
