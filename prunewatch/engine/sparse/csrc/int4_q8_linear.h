// Products of int4 weights with int8-quantized activations (int4_q8_linear.cpp): dense, on weights laid out by
// output, and sparse, on the active rows of the input-major layout.
#pragma once

#include <torch/extension.h>

namespace prunewatch {

// y (rows, out) = x (rows, in) times the int4 weights, each group of 32 inputs of x quantized to int8 with a
// scale of its own. by_output: uint8 (out / 8, in / 32, 8, 16); scales: float16 (in / 32, 2, out), the
// sparse kernel's int4 scales and minimums. threads <= 0: torch's intra-op thread count.
at::Tensor int4_q8_linear(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t threads);

// The same arithmetic over the active input channels only, reading their rows of the sparse kernel's int4
// layout (wt: (in, out / 2) bytes): y (rows, out, zero-filled) += the product of coef (n, rows), the masked
// inputs of the n ascending `channels`. Each row's output is bitwise int4_q8_linear's on that row's masked input.
void int4_q8_sparse_into(const int64_t* channels, int64_t n, const float* coef, int64_t rows, const uint8_t* wt,
                         const at::Half* scales, int64_t out, int64_t num_threads, float* y);

}  // namespace prunewatch
