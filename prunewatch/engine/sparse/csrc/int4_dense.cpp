// The dense decode product of int4 weights, multiplied as integers on inputs rounded to int16.
//
// The sparse kernel (sparse_linear.cpp) widens each int4 weight to fp32 before its multiply-add, so at one token
// per step its int4 products are bound by those instructions, not by the bytes they read (SmolLM2-135M's layers,
// 2 threads: ~21 G weights/s whether the weights come from DRAM or from cache). A dense call needs no row
// selection, so here the weights are laid out by output and multiplied as the small integers they are: each group
// of 32 inputs of a row is rounded to int16 with a scale of its own (amax / 32767), `madd` multiplies 16 weights
// by 16 inputs and adds them in pairs, and per group and output the exact integer sum is scaled by the weight's and
// the input's scales, while the weight's minimum multiplies the group's exact fp32 input sum:
//   y[o] = sum over g of d[g, o] * dx[g] * sum_i q[i, o] * xq[i] + m[g, o] * sum_i x[i].
// Why int16 inputs: integer_dense.h.
//
// The weights are laid out by output: by_output[ob, g, k, :] holds output 8 * ob + k's 32 weights of group g, byte j
// holding the weight of the rounded inputs' position j in its low nibble and of position j + 16 in its high one
// (quantize.pack_int4_by_output), so one widening to 16 bits, a mask and a shift give the two vectors that pair
// with the rounded inputs; a thread streams one contiguous run of bytes per block of 8 outputs, which the hardware
// prefetcher follows. The 8 outputs' partial sums are reduced across vector lanes together and kept as one vector
// per row over all groups.
//
// Each output's value depends on its row's inputs only (no sum across rows or threads, one fixed order of groups),
// so a row gets the same bits in a batch of any size and under any thread count, as batched decoding needs. A CPU
// without AVX2 takes a scalar path with the same arithmetic.

#include "int4_dense.h"

#include "integer_dense.h"  // with <immintrin.h> where the compiler targets AVX2

namespace prunewatch {
namespace {

using integer_dense::kBlock;
using integer_dense::kGroup;
using integer_dense::RoundedRows;

// Outputs [8 * b0, 8 * b1) of every row.
void blocks_into(const RoundedRows& xq, const uint8_t* w, const at::Half* scales, const float* bias, int64_t rows,
                 int64_t groups, int64_t out, int64_t b0, int64_t b1, float* y) {
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi16(0x0F);
  // Row by row over a block: its weights (8 x in / 2 bytes) stay in L1 for the next row, and each output's
  // nibbles are unpacked where they are used, so the loop holds 8 sums, 2 inputs and a weight pair in 16 vector
  // registers.
  for (int64_t ob = b0; ob < b1; ++ob) {
    const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + ob * kBlock) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      __m256 acc = _mm256_setzero_ps();
      const uint8_t* p = w + ob * groups * kBlock * 16;
      for (int64_t g = 0; g < groups; ++g, p += kBlock * 16) {
        const int64_t at = r * groups + g;
        const int16_t* q = xq.q.data() + at * kGroup;
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16));
        __m256i s[kBlock];  // eight partial sums of each output (|sum| <= 32 x 15 x 32767 < 2^24: exact as fp32)
        for (int64_t k = 0; k < kBlock; ++k) {
          // 16 bytes widened to 16 bits: the low nibbles are the weights of rounded positions 0-15 (pair with xl),
          // the high ones of positions 16-31 (xh)
          const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k)));
          s[k] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, low), xl),
                                  _mm256_madd_epi16(_mm256_srli_epi16(v, 4), xh));
        }
        const at::Half* ds = scales + 2 * g * out + ob * kBlock;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + out)));
        const __m256i sums = integer_dense::sum_lanes(s);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(xq.dx[at])), acc);
        acc = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.sx[at]), acc);
      }
      _mm256_storeu_ps(y + r * out + ob * kBlock, bias != nullptr ? _mm256_add_ps(acc, b) : acc);
    }
  }
#else
  for (int64_t ob = b0; ob < b1; ++ob) {
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t o = ob * kBlock + k;
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* p = w + ((ob * groups + g) * kBlock + k) * 16;
          const int64_t at = r * groups + g;
          const int16_t* q = xq.q.data() + at * kGroup;
          int32_t sum = 0;
          for (int64_t j = 0; j < 16; ++j) {
            sum += (p[j] & 0xF) * q[j] + (p[j] >> 4) * q[j + 16];
          }
          const float d = static_cast<float>(scales[2 * g * out + o]);
          const float m = static_cast<float>(scales[(2 * g + 1) * out + o]);
          acc = std::fma(static_cast<float>(sum), d * xq.dx[at], acc);
          acc = std::fma(m, xq.sx[at], acc);
        }
        y[r * out + o] = bias != nullptr ? acc + bias[o] : acc;
      }
    }
  }
#endif
}

void check_inputs(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(by_output.device().is_cpu() && scales.device().is_cpu(), "int4_dense_linear: CPU tensors expected");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == 2 && scales.size(2) % kBlock == 0 && scales.size(2) > 0 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "int4_dense_linear: scales must be a contiguous float16 (in / 32, 2, out) tensor with out a multiple "
              "of 8, got ", scales.sizes());
  const int64_t out = scales.size(2);
  integer_dense::check_rows("int4_dense_linear", x, bias, out);
  const int64_t in = x.size(1), groups = in / kGroup;
  TORCH_CHECK(scales.size(0) == groups, "int4_dense_linear: scales must be a contiguous float16 (in / 32, 2, out) "
              "tensor, got ", scales.sizes(), " for in = ", in);
  integer_dense::check_by_output("int4_dense_linear", by_output, at::kByte, 16, in, out,
                                 "quantize.pack_int4_by_output");
}

}  // namespace

at::Tensor int4_dense_linear(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias, int64_t threads) {
  check_inputs(x, by_output, scales, bias);
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup, out = scales.size(2);
  const integer_dense::Call call = integer_dense::prepare(x, bias, out, true);
  const uint8_t* w = by_output.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  float* y = call.y.data_ptr<float>();
  integer_dense::over_output_blocks(in, out, threads, [&](int64_t b0, int64_t b1) {
    blocks_into(call.xq, w, s, call.bias, rows, groups, out, b0, b1, y);
  });
  return call.y.to(x.scalar_type());
}

}  // namespace prunewatch
