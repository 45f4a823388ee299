// What the integer dense products (int4_dense.cpp, int8_dense.cpp) share: decode inputs rounded to int16 with one
// scale per group of 32, the layout's blocks of 16 outputs, the rows sharing each widened weight vector, and the
// split of output blocks over threads.
//
// Both products run over blocks of 16 outputs. A block's weights for one pair of rounded inputs are 16 pairs of
// weights, one per output, side by side: widened to int16, each 32-bit lane holds one output's pair, so `madd` (or
// AVX512-VNNI's `dpwssd`, which also adds) with the input pair broadcast to every lane adds two products to each of
// the 16 outputs' sums at once. The sums never cross lanes, so no reduction across lanes is needed, and the rows of
// a tile reuse each widened vector.
//
// Why int16 and not llama.cpp's int8 (one `maddubs` per 32 weights instead of two `madd` per 16): a group's
// largest input sets its step, and LLM activations have outlier channels, so at 8 bits the other inputs of an
// outlier's group lose most of their precision. On SmolLM2-135M's 63 held-out prompts int4 dense agreed with fp32
// dense on 0.989 of the tokens with int16 inputs (bench/results/precision-cpu.json) and 0.961 with int8 ones
// (bench/results/precision-cpu-int4-int8-inputs.json), under the quality floor, for no measurable gain in a whole
// decode step. At 16 bits a step is 1/65534 of the group's largest input, far below the weights' own rounding.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "thread_count.h"

namespace prunewatch {
namespace integer_dense {

constexpr int64_t kGroup = 32;  // inputs per input scale
constexpr float kLevels = 32767.0f;  // int16 inputs: -32767..32767

// Input of the rounded order at position j: 0-7, 16-23, then 8-15, 24-31 (a 128-bit lane each), the order the
// vectorized rounding packs its int16 values in; the int8 and int4 weights laid out by output follow it
// (quantize.pack_int8_by_output, quantize.pack_int4_by_output).
inline int64_t position(int64_t j) { return (j % 16 < 8 ? 0 : 16) + (j < 16 ? 0 : 8) + j % 8; }

// One row's group of 32 inputs rounded: q gets them in the rounded order, dx the scale, and sx (where not null)
// the exact sum, added in input order.
inline void round_group(const float* v, int16_t* q, float* dx, float* sx) {
#if defined(__AVX2__)
  // The scalar arithmetic below, vectorized to the same bits: |v| has no rounding, the maximum is exact in any
  // order, and cvtps rounds to nearest even like nearbyint under the default rounding mode.
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
               v3 = _mm256_loadu_ps(v + 24);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, magnitude), _mm256_and_ps(v1, magnitude)),
                                 _mm256_max_ps(_mm256_and_ps(v2, magnitude), _mm256_and_ps(v3, magnitude)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? kLevels / amax : 0.0f);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  // packs gives inputs 0-3, 16-19, 4-7, 20-23 (and 8-11, 24-27, ...): 64-bit lanes 0, 2, 1, 3 restore the order.
  // Values are within +-32767, so the saturating pack never saturates.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i2), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(i1, i3), 0xD8));
#else
  float amax = 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) {
    amax = std::max(amax, std::fabs(v[j]));
  }
  const float inv = amax > 0.0f ? kLevels / amax : 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) {
    q[j] = static_cast<int16_t>(std::nearbyint(v[position(j)] * inv));
  }
#endif
  *dx = amax / kLevels;
  if (sx != nullptr) {
    float sum = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) {
      sum += v[j];
    }
    *sx = sum;
  }
}

struct RoundedRows {
  std::vector<int16_t> q;  // (rows, groups, 32)
  std::vector<float> dx, sx;  // (rows, groups); sx empty where the product needs no input sums
};

inline RoundedRows round_rows(const float* x, int64_t rows, int64_t in, bool sums) {
  const int64_t groups = in / kGroup;
  RoundedRows out{std::vector<int16_t>(rows * groups * kGroup), std::vector<float>(rows * groups),
                  std::vector<float>(sums ? rows * groups : 0)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
      round_group(x + r * in + g * kGroup, out.q.data() + at * kGroup, &out.dx[at], sums ? &out.sx[at] : nullptr);
    }
  }
  return out;
}

constexpr int64_t kBlock = 16;  // outputs a product computes together: one 512-bit or two 256-bit vectors of sums

// The pair of rounded inputs at q[0], q[1] as one 32-bit value, each int16 in its own half (q[0] low), which
// `madd` multiplies with the two weights in the same halves of every 32-bit lane and adds.
inline int32_t input_pair(const int16_t* q) {
  int32_t pair;
  std::memcpy(&pair, q, sizeof(pair));
  return pair;
}

// How far ahead of the group it multiplies a product asks for its weights. A call streams one layer's weights only
// (100-900 KB for SmolLM2-135M's int8 layers, half for int4), each thread its own contiguous share, and the hardware
// prefetcher ramps up too late on streams that short. Asking 2 KB ahead made a decode step's worth of products
// (SmolLM2's 210 projections, weights from DRAM, 2 threads, measured by hand) 1.14x (int8) and 1.5x (int4) faster at
// one row and 1.3x at four.
constexpr int64_t kPrefetchBytes = 2048;

// Asks for the `bytes` (one group's weights) kPrefetchBytes past `group`. Past the end of the weights a prefetch is
// a hint that never faults.
inline void prefetch_ahead(const void* group, int64_t bytes) {
  const char* ahead = static_cast<const char*>(group) + kPrefetchBytes;
  for (int64_t c = 0; c < bytes; c += 64) {
    __builtin_prefetch(ahead + c, 0, 3);
  }
}

#if defined(__AVX512BW__)
constexpr int64_t kRowTile = 4;  // rows sharing each widened weight vector: 4 x 2 accumulators of 32 registers
#elif defined(__AVX2__)
constexpr int64_t kRowTile = 2;  // 2 x 4 accumulators, 2 weight vectors and an input in 16 registers
#else
constexpr int64_t kRowTile = 1;
#endif

#if defined(__AVX512BW__)
// acc + the 16 lanes' pairs of int16 products: one instruction with AVX512-VNNI, `madd` and an add without it. Both
// are exact integer sums, so the two give the same bits.
inline __m512i add_pair_products(__m512i acc, __m512i weights, __m512i inputs) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, weights, inputs);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(weights, inputs));
#endif
}
#endif

// body(tile, r0) for the rows [r0, r0 + tile) of `rows`, in tiles of kRowTile and one last smaller one, with the
// tile size as a compile-time constant so that its accumulators stay in registers.
template <typename Body>
void over_row_tiles(int64_t rows, const Body& body) {
  int64_t r0 = 0;
  for (; r0 + kRowTile <= rows; r0 += kRowTile) {
    body(std::integral_constant<int64_t, kRowTile>{}, r0);
  }
  switch (rows - r0) {
    case 3:
      if constexpr (kRowTile > 3) body(std::integral_constant<int64_t, 3>{}, r0);
      break;
    case 2:
      if constexpr (kRowTile > 2) body(std::integral_constant<int64_t, 2>{}, r0);
      break;
    case 1:
      if constexpr (kRowTile > 1) body(std::integral_constant<int64_t, 1>{}, r0);
      break;
    default:
      break;
  }
}

// A call's inputs as the products read them: x rounded, the bias as fp32 (or none), and the output to fill.
struct Call {
  at::Tensor xf;
  RoundedRows xq;
  at::Tensor bias_f;
  const float* bias;
  at::Tensor y;
};

// Checks x (rows, in) with in a multiple of 32, and the bias's length; `name` prefixes the errors.
inline void check_rows(const char* name, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && x.size(1) > 0,
              name, ": x must be (rows, in) with in a multiple of 32, got ", x.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, name, ": bias must have length out");
  }
}

// Checks the weights laid out by output: a contiguous (out / 16, in / 32, pieces, 32) tensor of `dtype`, each
// piece the weights of 16 outputs for a pair of rounded inputs (int8) or two pairs (int4); `layout` names it in the
// error (the Python function that makes it).
inline void check_by_output(const char* name, const at::Tensor& by_output, at::ScalarType dtype, int64_t pieces,
                            int64_t in, int64_t out, const char* layout) {
  TORCH_CHECK(by_output.scalar_type() == dtype && by_output.is_contiguous() && by_output.dim() == 4 &&
                  by_output.size(0) == out / kBlock && by_output.size(1) == in / kGroup &&
                  by_output.size(2) == pieces && by_output.size(3) == 2 * kBlock,
              name, ": by_output must be a contiguous ", dtype, " (out / 16, in / 32, ", pieces, ", 32) tensor (",
              layout, "), got ", by_output.scalar_type(), " ", by_output.sizes(), " for in = ", in, ", out = ", out);
}

// `sums`: whether the product needs each group's input sum (int4's minimums multiply it).
inline Call prepare(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t out, bool sums) {
  keep_thread_count();
  Call call;
  call.xf = x.to(at::kFloat).contiguous();
  call.xq = round_rows(call.xf.data_ptr<float>(), x.size(0), x.size(1), sums);
  call.bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  call.bias = bias.has_value() ? call.bias_f.data_ptr<float>() : nullptr;
  call.y = at::empty({x.size(0), out}, call.xf.options());
  return call;
}

// body(b0, b1) over the `out / 16` output blocks, whole blocks per thread (over_output_chunks).
template <typename Body>
void over_output_blocks(int64_t in, int64_t out, int64_t threads, const Body& body) {
  over_output_chunks(out / kBlock, in * out, threads, body);
}

}  // namespace integer_dense
}  // namespace prunewatch
