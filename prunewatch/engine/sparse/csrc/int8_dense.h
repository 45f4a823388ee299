// The dense decode product of int8 weights laid out by output, on inputs rounded to int16 (int8_dense.cpp).
#pragma once

#include <torch/extension.h>

namespace prunewatch {

// y (rows, out) = x (rows, in) times the int8 weights (+ bias), each group of 32 inputs of x rounded to int16 with a
// scale of its own. by_output: int8 (out / 16, in / 32, 16, 32) (quantize.pack_int8_by_output); weight_scale: float32
// (out,), one scale per output. threads <= 0: torch's intra-op thread count.
at::Tensor int8_dense_linear(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& weight_scale,
                             const c10::optional<at::Tensor>& bias, int64_t threads);

}  // namespace prunewatch
