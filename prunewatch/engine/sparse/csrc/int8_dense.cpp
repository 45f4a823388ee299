// The dense decode product of int8 weights, multiplied as integers on inputs rounded to int16.
//
// The sparse kernel (sparse_linear.cpp) widens each int8 weight to fp32 before its multiply-add: three
// instructions per 8 weights, which bind a one-token step on two cores well before the bytes do. A dense call
// needs no row selection, so here the weights are laid out by output and multiplied as the small integers they
// are: each group of 32 inputs of a row is rounded to int16 with a scale of its own (integer_dense.h says why 16
// bits), `madd` (`dpwssd` with AVX512-VNNI) multiplies 16 outputs' weights by a pair of inputs and adds the
// products, and per group and output the integer sum is scaled by the input's scale; the output's own scale
// multiplies the finished sum:
//   y[o] = s[o] * sum over g of dx[g] * sum_i q[i, o] * xq[i].
// A group's integer sum is at most 32 x 127 x 32767 < 2^27 in magnitude: exact in int32, and rounded to fp32's 24
// bits only when it exceeds 2^24.
//
// The weights are laid out by output in blocks of 16 (quantize.pack_int8_by_output): per group, 16 pieces of 32
// bytes, one per pair of rounded inputs, holding the 16 outputs' two weights side by side. Widened to 16 bits, a
// piece's 32-bit lanes hold each output's weights for the pair (integer_dense.h), multiplied with the pair
// broadcast; no sum crosses lanes. A thread streams one contiguous run of bytes over its blocks, prefetched a little
// ahead, and the rows of a tile share each widened piece.
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

constexpr int64_t kPairs = kGroup / 2;  // pieces of a group in the layout: one pair of inputs each

// Rows [r0, r0 + R) of output block ob: each weight vector is widened once and multiplied with every row of the
// tile. w points at the block's weights.
template <int64_t R>
void tile_into(const RoundedRows& xq, const int8_t* w, const float* ws, const float* bias, int64_t groups,
               int64_t out, int64_t ob, int64_t r0, float* y) {
#if defined(__AVX512BW__)
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* p = w + g * kPairs * 2 * kBlock;
    const int16_t* q[R];
    __m512i sums[R];  // |sum| <= 32 x 127 x 32767 < 2^27: exact in int32
    for (int64_t r = 0; r < R; ++r) {
      q[r] = xq.q.data() + ((r0 + r) * groups + g) * kGroup;
      sums[r] = _mm512_setzero_si512();
    }
    integer_dense::prefetch_ahead(p, kPairs * 2 * kBlock);
    for (int64_t j = 0; j < kPairs; ++j) {
      const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * kBlock * j)));
      for (int64_t r = 0; r < R; ++r) {
        sums[r] = integer_dense::add_pair_products(sums[r], v, _mm512_set1_epi32(integer_dense::input_pair(q[r] + 2 * j)));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(xq.dx[(r0 + r) * groups + g]), acc[r]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(ws + ob * kBlock);
  for (int64_t r = 0; r < R; ++r) {
    // One fused multiply-add with the bias, written out so that no compiler contracts it differently
    _mm512_storeu_ps(y + (r0 + r) * out + ob * kBlock,
                     bias != nullptr ? _mm512_fmadd_ps(acc[r], scale, _mm512_loadu_ps(bias + ob * kBlock))
                                     : _mm512_mul_ps(acc[r], scale));
  }
#elif defined(__AVX2__)
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* p = w + g * kPairs * 2 * kBlock;
    const int16_t* q[R];
    __m256i sums[R][2];  // outputs 0-7 and 8-15
    for (int64_t r = 0; r < R; ++r) {
      q[r] = xq.q.data() + ((r0 + r) * groups + g) * kGroup;
      sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    }
    integer_dense::prefetch_ahead(p, kPairs * 2 * kBlock);
    for (int64_t j = 0; j < kPairs; ++j) {
      const int8_t* pj = p + 2 * kBlock * j;
      const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pj)));
      const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pj + kBlock)));
      for (int64_t r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(integer_dense::input_pair(q[r] + 2 * j));
        sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(v0, x));
        sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(v1, x));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(xq.dx[(r0 + r) * groups + g]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), dx, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), dx, acc[r][1]);
    }
  }
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t o = ob * kBlock + 8 * h;
    const __m256 scale = _mm256_loadu_ps(ws + o);
    for (int64_t r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + (r0 + r) * out + o, bias != nullptr ? _mm256_fmadd_ps(acc[r][h], scale, _mm256_loadu_ps(bias + o))
                                                               : _mm256_mul_ps(acc[r][h], scale));
    }
  }
#else
  for (int64_t k = 0; k < kBlock; ++k) {
    const int64_t o = ob * kBlock + k;
    for (int64_t r = r0; r < r0 + R; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* p = w + g * kPairs * 2 * kBlock;
        const int16_t* q = xq.q.data() + (r * groups + g) * kGroup;
        int32_t sum = 0;
        for (int64_t j = 0; j < kPairs; ++j) {
          sum += static_cast<int32_t>(p[2 * kBlock * j + 2 * k]) * q[2 * j] +
                 static_cast<int32_t>(p[2 * kBlock * j + 2 * k + 1]) * q[2 * j + 1];
        }
        acc = std::fma(static_cast<float>(sum), xq.dx[r * groups + g], acc);
      }
      y[r * out + o] = bias != nullptr ? std::fma(acc, ws[o], bias[o]) : acc * ws[o];
    }
  }
#endif
}

// Outputs [16 * b0, 16 * b1) of every row.
void blocks_into(const RoundedRows& xq, const int8_t* w, const float* ws, const float* bias, int64_t rows,
                 int64_t groups, int64_t out, int64_t b0, int64_t b1, float* y) {
  for (int64_t ob = b0; ob < b1; ++ob) {
    const int8_t* block = w + ob * groups * kPairs * 2 * kBlock;
    integer_dense::over_row_tiles(rows, [&](auto tile, int64_t r0) {
      tile_into<decltype(tile)::value>(xq, block, ws, bias, groups, out, ob, r0, y);
    });
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& weight_scale,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(by_output.device().is_cpu() && weight_scale.device().is_cpu(), "int8_dense_linear: CPU tensors expected");
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.size(0) % kBlock == 0 && weight_scale.size(0) > 0 &&
                  weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous(),
              "int8_dense_linear: weight_scale must be a contiguous float32 (out,) tensor with out a multiple of 16, "
              "got ", weight_scale.sizes(), " ", weight_scale.scalar_type());
  const int64_t out = weight_scale.size(0);
  integer_dense::check_rows("int8_dense_linear", x, bias, out);
  const int64_t in = x.size(1);
  integer_dense::check_by_output("int8_dense_linear", by_output, at::kChar, kPairs, in, out,
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
