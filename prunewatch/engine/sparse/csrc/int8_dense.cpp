// The dense decode product of int8 weights, multiplied as integers on inputs rounded to int16.
//
// The sparse kernel (sparse_linear.cpp) widens each int8 weight to fp32 before its multiply-add: three
// instructions per 8 weights, which bind a one-token step on two cores well before the bytes do. A dense call
// needs no row selection, so here the weights are laid out by output and multiplied as the small integers they
// are: each group of 32 inputs of a row is rounded to int16 with a scale of its own (integer_dense.h says why 16
// bits), `madd` multiplies 16 weights by 16 inputs and adds them in pairs, and per group and output the integer
// sum is scaled by the input's scale; the output's own scale multiplies the finished sum:
//   y[o] = s[o] * sum over g of dx[g] * sum_i q[i, o] * xq[i].
// A group's integer sum is at most 32 x 127 x 32767 < 2^27 in magnitude: exact in int32, and rounded to fp32's 24
// bits only when it exceeds 2^24.
//
// The weights are laid out by output: by_output[ob, g, k, :] holds output 8 * ob + k's 32 weights of group g in
// the rounded order (inputs 0-7, 16-23, 8-15, 24-31), so its two 16-byte halves widen into the two vectors that
// pair with the rounded inputs, and a thread streams one contiguous run of bytes per block of 8 outputs.
//
// Each output's value depends on its row's inputs only (no sum across rows or threads, one fixed order of groups),
// so a row gets the same bits in a batch of any size and under any thread count, as batched decoding needs. A CPU
// without AVX2 takes a scalar path with the same arithmetic.

#include "int8_dense.h"

#include "integer_dense.h"  // with <immintrin.h> where the compiler targets AVX2

namespace prunewatch {
namespace {

using integer_dense::kBlock;
using integer_dense::kGroup;
using integer_dense::RoundedRows;

// Outputs [8 * b0, 8 * b1) of every row.
void blocks_into(const RoundedRows& xq, const int8_t* w, const float* ws, const float* bias, int64_t rows,
                 int64_t groups, int64_t out, int64_t b0, int64_t b1, float* y) {
#if defined(__AVX2__)
  // Row by row over a block: its weights (8 x in bytes) stay in L1 for the next row, and each weight is widened
  // from memory where it is used, so the loop holds 8 sums, 2 inputs and a weight pair in 16 vector registers.
  for (int64_t ob = b0; ob < b1; ++ob) {
    const __m256 scale = _mm256_loadu_ps(ws + ob * kBlock);
    for (int64_t r = 0; r < rows; ++r) {
      __m256 acc = _mm256_setzero_ps();
      const int8_t* p = w + ob * groups * kBlock * kGroup;
      for (int64_t g = 0; g < groups; ++g, p += kBlock * kGroup) {
        const int64_t at = r * groups + g;
        const int16_t* q = xq.q.data() + at * kGroup;
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16));
        __m256i s[kBlock];  // eight partial sums of each output
        for (int64_t k = 0; k < kBlock; ++k) {
          // 16-bit weights: rounded positions 0-15 pair with xl, 16-31 with xh
          const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kGroup * k)));
          const __m256i wh =
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kGroup * k + 16)));
          s[k] = _mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh));
        }
        const __m256i sums = integer_dense::sum_lanes(s);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(xq.dx[at]), acc);
      }
      // One fused multiply-add with the bias, written out so that no compiler contracts it differently
      _mm256_storeu_ps(y + r * out + ob * kBlock,
                       bias != nullptr ? _mm256_fmadd_ps(acc, scale, _mm256_loadu_ps(bias + ob * kBlock))
                                       : _mm256_mul_ps(acc, scale));
    }
  }
#else
  for (int64_t ob = b0; ob < b1; ++ob) {
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t o = ob * kBlock + k;
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const int8_t* p = w + ((ob * groups + g) * kBlock + k) * kGroup;
          const int64_t at = r * groups + g;
          const int16_t* q = xq.q.data() + at * kGroup;
          int32_t sum = 0;
          for (int64_t j = 0; j < kGroup; ++j) {
            sum += static_cast<int32_t>(p[j]) * q[j];
          }
          acc = std::fma(static_cast<float>(sum), xq.dx[at], acc);
        }
        y[r * out + o] = bias != nullptr ? std::fma(acc, ws[o], bias[o]) : acc * ws[o];
      }
    }
  }
#endif
}

void check_inputs(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& weight_scale,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(by_output.device().is_cpu() && weight_scale.device().is_cpu(), "int8_dense_linear: CPU tensors expected");
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.size(0) % kBlock == 0 && weight_scale.size(0) > 0 &&
                  weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous(),
              "int8_dense_linear: weight_scale must be a contiguous float32 (out,) tensor with out a multiple of 8, "
              "got ", weight_scale.sizes(), " ", weight_scale.scalar_type());
  const int64_t out = weight_scale.size(0);
  integer_dense::check_rows("int8_dense_linear", x, bias, out);
  const int64_t in = x.size(1);
  integer_dense::check_by_output("int8_dense_linear", by_output, at::kChar, kGroup, in, out,
                                 "quantize.pack_int8_by_output");
}

}  // namespace

at::Tensor int8_dense_linear(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& weight_scale,
                             const c10::optional<at::Tensor>& bias, int64_t threads) {
  check_inputs(x, by_output, weight_scale, bias);
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup, out = weight_scale.size(0);
  const integer_dense::Call call = integer_dense::prepare(x, bias, out, false);
  const int8_t* w = by_output.data_ptr<int8_t>();
  const float* ws = weight_scale.data_ptr<float>();
  float* y = call.y.data_ptr<float>();
  integer_dense::over_output_blocks(in, out, threads, [&](int64_t b0, int64_t b1) {
    blocks_into(call.xq, w, ws, call.bias, rows, groups, out, b0, b1, y);
  });
  return call.y.to(x.scalar_type());
}

}  // namespace prunewatch
