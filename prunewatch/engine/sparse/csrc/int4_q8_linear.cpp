// The dense decode product of int4 weights with integer dot products on int8-quantized activations.
//
// The sparse kernel (sparse_linear.cpp) multiplies each int4 weight as fp32: a mask or a shift, a widening, a
// conversion and a multiply-add per 8 (AVX2) weights, so at one token per step its int4 products are bound by
// those instructions, not by the bytes they read (SmolLM2-135M's layers, 2 threads: ~21 G weights/s whether the
// weights come from DRAM or from cache, ~10 GB/s of int4). Here each group of 32 inputs of a row is quantized to
// int8 with a scale of its own (amax / 127, llama.cpp's Q8 activation blocks), and the weights are multiplied as
// the small integers they are: `maddubs` multiplies 32 unsigned 4-bit weights by 32 signed 8-bit inputs and adds
// them in pairs in one instruction. Per group and output the integer sum is exact; its float value is scaled by
// the weight's and the input's scales, and the weight's minimum multiplies the group's exact fp32 input sum:
//   y[o] = sum over g of d[g, o] * dx[g] * sum_i q[i, o] * xq[i] + m[g, o] * sum_i x[i].
// What it costs in quality is the activations' rounding (one 254th of a group's largest input at most), which
// `prunewatch bench precision` measures on served answers against fp32 dense.
//
// The weights are laid out by output for this: by_output[ob, g, k, :] holds output 8 * ob + k's 32 weights of
// group g as GGUF's Q4_1 packs them (byte j: input j in the low nibble, input j + 16 in the high one), so a
// thread streams one contiguous run of bytes per block of 8 outputs, which the hardware prefetcher follows. The
// sums of 8 outputs are reduced across vector lanes together (three horizontal adds and a permutation) and kept
// as one vector per row over all groups.
//
// Each output's value depends on its row's inputs only (no sum across rows or threads, one fixed order of
// groups), so a row gets the same bits in a batch of any size and under any thread count, as batched decoding
// needs. A CPU without AVX2 takes a scalar path with the same arithmetic.

#include "int4_q8_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "thread_count.h"

namespace prunewatch {
namespace {

constexpr int64_t kGroup = 32;  // inputs per activation scale and per weight scale (the int4 group)
constexpr int64_t kBlock = 8;  // outputs whose sums are reduced together
constexpr int64_t kQuantBytes = 64;  // per (row, group): inputs 0-15 twice, then 16-31 twice (one per 128-bit lane)
constexpr int64_t kMinWeightsPerThread = 1 << 16;  // below this one thread does it all

// One row's group of 32 inputs quantized: q gets kQuantBytes bytes, dx the scale, sx the exact sum.
void quantize_group(const float* v, int8_t* q, float* dx, float* sx) {
  float amax = 0.0f, sum = 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) {
    amax = std::max(amax, std::fabs(v[j]));
    sum += v[j];
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t j = 0; j < kGroup / 2; ++j) {
    const auto low = static_cast<int8_t>(std::nearbyint(v[j] * inv));
    const auto high = static_cast<int8_t>(std::nearbyint(v[j + kGroup / 2] * inv));
    q[j] = low;
    q[16 + j] = low;
    q[32 + j] = high;
    q[48 + j] = high;
  }
  *dx = amax / 127.0f;
  *sx = sum;
}

struct QuantizedRows {
  std::vector<int8_t> q;  // (rows, groups, kQuantBytes)
  std::vector<float> dx, sx;  // (rows, groups)
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t groups = in / kGroup;
  QuantizedRows out{std::vector<int8_t>(rows * groups * kQuantBytes), std::vector<float>(rows * groups),
                    std::vector<float>(rows * groups)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
      quantize_group(x + r * in + g * kGroup, out.q.data() + at * kQuantBytes, &out.dx[at], &out.sx[at]);
    }
  }
  return out;
}

// Outputs [8 * b0, 8 * b1) of every row.
void blocks_into(const QuantizedRows& xq, const uint8_t* w, const at::Half* scales, const float* bias, int64_t rows,
                 int64_t groups, int64_t out, int64_t b0, int64_t b1, float* y) {
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the reduction leaves outputs 0 2 4 6 1 3 5 7
  std::vector<__m256> acc(rows);
  for (int64_t ob = b0; ob < b1; ++ob) {
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    const uint8_t* p = w + ob * groups * kBlock * 16;
    for (int64_t g = 0; g < groups; ++g, p += kBlock * 16) {
      __m256i lo[4], hi[4];  // pairs of outputs: (2k, 2k + 1), inputs 0-15 (lo) and 16-31 (hi), one per lane
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
        lo[k] = _mm256_and_si256(v, low);
        hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const at::Half* ds = scales + 2 * g * out + ob * kBlock;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + out)));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = r * groups + g;
        const int8_t* q = xq.q.data() + at * kQuantBytes;
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
        __m256i s[4];  // per pair: four partial sums of each output (|each| <= 2 x 15 x 127 x 4)
        for (int k = 0; k < 4; ++k) {
          s[k] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[k], xl), _mm256_maddubs_epi16(hi[k], xh)),
                                   ones);
        }
        const __m256i sums = _mm256_permutevar8x32_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3])), order);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(xq.dx[at])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.sx[at]), acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 v = bias != nullptr ? _mm256_add_ps(acc[r], _mm256_loadu_ps(bias + ob * kBlock)) : acc[r];
      _mm256_storeu_ps(y + r * out + ob * kBlock, v);
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
          const int8_t* q = xq.q.data() + at * kQuantBytes;
          int32_t sum = 0;
          for (int64_t j = 0; j < 16; ++j) sum += (p[j] & 0xF) * q[j] + (p[j] >> 4) * q[32 + j];
          const float d = static_cast<float>(scales[2 * g * out + o]), m = static_cast<float>(scales[(2 * g + 1) * out + o]);
          acc = std::fma(static_cast<float>(sum), d * xq.dx[at], acc);
          acc = std::fma(m, xq.sx[at], acc);
        }
        y[r * out + o] = bias != nullptr ? acc + bias[o] : acc;
      }
    }
  }
#endif
}

// One row's quantized inputs to one int4 group for the sparse product: the active channels' int8 values paired
// as int16 words (low byte: the first of two channels, high byte: the second; an odd last channel pairs with 0),
// the scale and the exact fp32 sum, computed as quantize_group computes them over the masked group (its inactive
// inputs are 0: they change neither the maximum nor the sum), so both products give a row the same bits.
struct SparseGroup {
  int16_t pairs[kGroup / 2];
  float dx, sx;
};

SparseGroup quantize_active(const float* coef, int64_t rows, int64_t j0, int64_t j1, int64_t b) {
  SparseGroup group{};
  float amax = 0.0f, sum = 0.0f;
  for (int64_t j = j0; j < j1; ++j) {
    amax = std::max(amax, std::fabs(coef[j * rows + b]));
    sum += coef[j * rows + b];
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t j = j0; j < j1; ++j) {
    const auto q = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(coef[j * rows + b] * inv)));
    const int64_t k = j - j0;
    group.pairs[k / 2] = static_cast<int16_t>(k % 2 == 0 ? q : (static_cast<uint16_t>(group.pairs[k / 2]) | (q << 8)));
  }
  group.dx = amax / 127.0f;
  group.sx = sum;
  return group;
}

// y[o] for the 32 outputs of one run += one group's product: rows[k] + at points at active row k's 16 bytes of the
// run (byte k: output k in the low nibble, output k + 16 in the high one), `count` rows, their int8 inputs in pairs.
inline void sparse_run_into(const uint8_t* const* rows, int64_t at, int64_t count, const SparseGroup& group,
                            const at::Half* d, const at::Half* m, float* y) {
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i t0 = _mm256_setzero_si256(), t1 = t0, t2 = t0, t3 = t0;  // int32 sums of outputs 0-7, 8-15, 16-23, 24-31
  for (int64_t k0 = 0; k0 < count; k0 += 16) {  // int16 sums over at most 8 pairs (each adds <= 2 x 15 x 127)
    __m256i part_lo = _mm256_setzero_si256(), part_hi = part_lo;  // outputs 0-7 | 16-23, and 8-15 | 24-31
    const int64_t k1 = std::min(count, k0 + 16);
    for (int64_t k = k0; k < k1; k += 2) {
      const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + at));
      const __m128i vb = k + 1 < k1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k + 1] + at)) : va;
      // lane 0: outputs 0-15, lane 1: outputs 16-31 (an odd last row pairs with itself, times 0)
      const __m256i a = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(va, 4), va), low);
      const __m256i b = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(vb, 4), vb), low);
      const __m256i c = _mm256_set1_epi16(group.pairs[k / 2]);
      part_lo = _mm256_add_epi16(part_lo, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(a, b), c));
      part_hi = _mm256_add_epi16(part_hi, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(a, b), c));
    }
    t0 = _mm256_add_epi32(t0, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(part_lo)));
    t2 = _mm256_add_epi32(t2, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(part_lo, 1)));
    t1 = _mm256_add_epi32(t1, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(part_hi)));
    t3 = _mm256_add_epi32(t3, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(part_hi, 1)));
  }
  const __m256 dx = _mm256_set1_ps(group.dx), sx = _mm256_set1_ps(group.sx);
  auto finish = [&](__m256i total, int64_t o) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + o)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + o)));
    const __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, dx), _mm256_loadu_ps(y + o));
    _mm256_storeu_ps(y + o, _mm256_fmadd_ps(mv, sx, acc));
  };
  finish(t0, 0);
  finish(t1, 8);
  finish(t2, 16);
  finish(t3, 24);
#else
  for (int64_t o = 0; o < 32; ++o) {
    const int64_t byte = o % 16;
    const int shift = o < 16 ? 0 : 4;
    int32_t sum = 0;
    for (int64_t k = 0; k < count; ++k) {
      const auto q = static_cast<int8_t>(static_cast<uint16_t>(group.pairs[k / 2]) >> (8 * (k % 2)));
      sum += ((rows[k][at + byte] >> shift) & 0xF) * q;
    }
    const float acc = std::fma(static_cast<float>(sum), static_cast<float>(d[o]) * group.dx, y[o]);
    y[o] = std::fma(static_cast<float>(m[o]), group.sx, acc);
  }
#endif
}

void check_inputs(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && by_output.device().is_cpu() && scales.device().is_cpu(),
              "int4_q8_linear: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && x.size(1) > 0,
              "int4_q8_linear: x must be (rows, in) with in a multiple of 32, got ", x.sizes());
  const int64_t in = x.size(1), groups = in / kGroup;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == groups && scales.size(1) == 2 && scales.size(2) % kBlock == 0 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "int4_q8_linear: scales must be a contiguous float16 (in / 32, 2, out) tensor with out a multiple of 8, "
              "got ", scales.sizes(), " for in = ", in);
  const int64_t out = scales.size(2);
  TORCH_CHECK(by_output.scalar_type() == at::kByte && by_output.is_contiguous() && by_output.dim() == 4 &&
                  by_output.size(0) == out / kBlock && by_output.size(1) == groups && by_output.size(2) == kBlock &&
                  by_output.size(3) == 16,
              "int4_q8_linear: by_output must be a contiguous uint8 (out / 8, in / 32, 8, 16) tensor "
              "(quantize.pack_int4_by_output), got ", by_output.sizes(), " for in = ", in, ", out = ", out);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, "int4_q8_linear: bias must have length out");
  }
}

}  // namespace

at::Tensor int4_q8_linear(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t threads) {
  check_inputs(x, by_output, scales, bias);
  keep_thread_count();
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup, out = scales.size(2);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), rows, in);
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({rows, out}, xf.options());
  const uint8_t* w = by_output.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = out / kBlock;
  const int64_t pool = std::max<int64_t>(1, at::get_num_threads());
  const int64_t num_threads = threads > 0 ? std::min(threads, pool) : pool;
  auto body = [&](int64_t b0, int64_t b1) { blocks_into(xq, w, s, b, rows, groups, out, b0, b1, yp); };
  if (num_threads == 1 || in * out < kMinWeightsPerThread * 2) {
    body(0, blocks);
  } else {
    at::parallel_for(0, blocks, (blocks + num_threads - 1) / num_threads, body);
  }
  return y.to(x.scalar_type());
}

void int4_q8_sparse_into(const int64_t* channels, int64_t n, const float* coef, int64_t rows, const uint8_t* wt,
                         const at::Half* scales, int64_t out, int64_t num_threads, float* y) {
  std::vector<int64_t> starts;  // first active channel of each int4 group that has one, then n
  for (int64_t j = 0; j < n; ++j) {
    if (j == 0 || channels[j] / kGroup != channels[j - 1] / kGroup) starts.push_back(j);
  }
  starts.push_back(n);
  const int64_t spans = static_cast<int64_t>(starts.size()) - 1;
  if (spans <= 0) return;
  std::vector<SparseGroup> groups(spans * rows);
  for (int64_t s = 0; s < spans; ++s) {
    for (int64_t b = 0; b < rows; ++b) groups[s * rows + b] = quantize_active(coef, rows, starts[s], starts[s + 1], b);
  }
  const int64_t row_bytes = out / 2, runs = out / kGroup;
  // Threads split the outputs (runs of 32), never the sum over channels: a row's bits do not depend on them.
  auto body = [&](int64_t r0, int64_t r1) {
    const uint8_t* w[kGroup];
    const uint8_t* next[kGroup];
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t j0 = starts[s], count = starts[s + 1] - j0;
      for (int64_t k = 0; k < count; ++k) w[k] = wt + channels[j0 + k] * row_bytes;
      int64_t next_count = 0;  // the next group's rows, requested line by line as this group's are combined
      if (s + 1 < spans) {
        for (int64_t j = starts[s + 1]; j < starts[s + 2]; ++j) next[next_count++] = wt + channels[j] * row_bytes;
      }
      const at::Half* d = scales + 2 * (channels[j0] / kGroup) * out;
      for (int64_t b = 0; b < rows; ++b) {
        const SparseGroup& group = groups[s * rows + b];
        const bool request = b == 0;
        for (int64_t r = r0; r < r1; ++r) {
          if (request && ((r * 16) % 64 == 0 || r == r0)) {
            for (int64_t k = 0; k < next_count; ++k) __builtin_prefetch(next[k] + r * 16, 0, 2);
          }
          if (group.dx == 0.0f) continue;  // this row's inputs to the group are all 0
          sparse_run_into(w, r * 16, count, group, d + r * kGroup, d + out + r * kGroup, y + b * out + r * kGroup);
        }
      }
    }
  };
  if (num_threads <= 1 || n * out < kMinWeightsPerThread * 2) {
    body(0, runs);
  } else {
    at::parallel_for(0, runs, (runs + num_threads - 1) / num_threads, body);
  }
}

}  // namespace prunewatch
