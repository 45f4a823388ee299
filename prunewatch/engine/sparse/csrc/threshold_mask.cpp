// The row policy's mask for a call with more rows than the kernel takes (a prefill), as one pass over the input.
//
// Such a call keeps the entries the kernel would keep (|x| * scale > threshold, per row) and multiplies the masked
// input by the dense weights (module.SparseLinear._masked_dense). Written as tensor operators that mask is six of
// them per layer call (abs, scale, compare, convert, multiply, count), ~20 ms of a 49-token prefill of
// SmolLM2-135M at the default sensitivity, 2 threads, against ~57 ms in its matrix products. Here it is one loop
// with the operators' arithmetic: the score in fp32, compared with the threshold rounded to fp32, and each entry
// multiplied by 1 or 0 (so a dropped negative entry is -0, as x * mask gives).

#include "threshold_mask.h"

#include <cmath>
#include <cstdint>

namespace prunewatch {

std::tuple<at::Tensor, int64_t> threshold_mask(const at::Tensor& x, const at::Tensor& scale, double threshold) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous(),
              "threshold_mask: x must be a contiguous float32 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  const int64_t in = x.size(-1);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.dim() == 1 &&
                  scale.size(0) == in && scale.is_contiguous(),
              "threshold_mask: scale must be a contiguous float32 CPU vector of length ", in);
  at::Tensor masked = at::empty_like(x);
  const float limit = static_cast<float>(threshold);
  const float* xp = x.data_ptr<float>();
  const float* s = scale.data_ptr<float>();
  float* out = masked.data_ptr<float>();
  const int64_t rows = in == 0 ? 0 : x.numel() / in;
  int64_t kept = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * in;
    float* yr = out + r * in;
    int64_t row_kept = 0;
    for (int64_t i = 0; i < in; ++i) {
      const bool keep = std::fabs(xr[i]) * s[i] > limit;
      yr[i] = xr[i] * (keep ? 1.0f : 0.0f);
      row_kept += keep ? 1 : 0;
    }
    kept += row_kept;
  }
  return std::make_tuple(masked, kept);
}

}  // namespace prunewatch
