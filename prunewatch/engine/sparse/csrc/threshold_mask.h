// The row policy's mask applied to a call of many rows (a prefill), in one pass (threshold_mask.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace prunewatch {

// (x with every entry whose |x| * scale[channel] is not above `threshold` multiplied by 0, the number of entries
// kept): x float32 (..., in), contiguous; scale float32 (in,). The comparison is in fp32, the threshold rounded to it.
std::tuple<at::Tensor, int64_t> threshold_mask(const at::Tensor& x, const at::Tensor& scale, double threshold);

}  // namespace prunewatch
