// The dense decode product of int4 weights, multiplied as integers on inputs rounded to int16.
//
// The sparse kernel (sparse_linear.cpp) widens each int4 weight to fp32 before its multiply-add, so at one token
// per step its int4 products are bound by those instructions, not by the bytes they read (SmolLM2-135M's layers,
// 2 threads: ~21 G weights/s whether the weights come from DRAM or from cache). A dense call needs no row
// selection, so here the weights are laid out by output and multiplied as the small integers they are: each group
// of 32 inputs of a row is rounded to int16 with a scale of its own (amax / 32767), `madd` (`dpwssd` with
// AVX512-VNNI) multiplies 16 outputs' weights by a pair of inputs and adds the products, and per group and output
// the exact integer sum is scaled by the weight's and the input's scales, while the weight's minimum multiplies the
// group's exact fp32 input sum:
//   y[o] = sum over g of d[g, o] * dx[g] * sum_i q[i, o] * xq[i] + m[g, o] * sum_i x[i].
// Why int16 inputs: integer_dense.h.
//
// The weights are laid out by output in blocks of 16 (quantize.pack_int4_by_output): per group, 8 pieces of 32
// bytes, two per output, each byte holding a weight of one pair of rounded inputs in its low nibble and of the next
// pair in its high one. One widening to 16 bits, a mask and a shift give two vectors whose 32-bit lanes hold each
// output's weights for a pair of inputs (integer_dense.h), multiplied with that pair broadcast; no sum crosses
// lanes. A thread streams one contiguous run of bytes over its blocks, prefetched a little ahead, and the rows of a
// tile share each widened piece.
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

constexpr int64_t kPieces = kGroup / 4;  // pieces of a group in the layout: two pairs of inputs each

// Rows [r0, r0 + R) of output block ob: each piece of weights is widened once and multiplied with every row of the
// tile. w points at the block's weights.
template <int64_t R>
void tile_into(const RoundedRows& xq, const uint8_t* w, const at::Half* scales, const float* bias, int64_t groups,
               int64_t out, int64_t ob, int64_t r0, float* y) {
#if defined(__AVX512BW__)
  const __m512i low = _mm512_set1_epi16(0x0F);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w + g * kPieces * 2 * kBlock;
    const int16_t* q[R];
    __m512i sums[R];  // |sum| <= 32 x 15 x 32767 < 2^24: exact as fp32
    for (int64_t r = 0; r < R; ++r) {
      q[r] = xq.q.data() + ((r0 + r) * groups + g) * kGroup;
      sums[r] = _mm512_setzero_si512();
    }
    integer_dense::prefetch_ahead(p, kPieces * 2 * kBlock);
    for (int64_t j = 0; j < kPieces; ++j) {
      // 32 bytes widened to 16 bits: the low nibbles are each output's weights of rounded inputs 4j and 4j + 1, the
      // high ones of 4j + 2 and 4j + 3
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * kBlock * j)));
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_srli_epi16(v, 4);
      for (int64_t r = 0; r < R; ++r) {
        sums[r] = integer_dense::add_pair_products(sums[r], lo, _mm512_set1_epi32(integer_dense::input_pair(q[r] + 4 * j)));
        sums[r] = integer_dense::add_pair_products(sums[r], hi,
                                                   _mm512_set1_epi32(integer_dense::input_pair(q[r] + 4 * j + 2)));
      }
    }
    const at::Half* ds = scales + 2 * g * out + ob * kBlock;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + out)));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(xq.dx[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.sx[at]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + (r0 + r) * out + ob * kBlock,
                     bias != nullptr ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias + ob * kBlock)) : acc[r]);
  }
#elif defined(__AVX2__)
  const __m256i low = _mm256_set1_epi16(0x0F);
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w + g * kPieces * 2 * kBlock;
    const int16_t* q[R];
    __m256i sums[R][2];  // outputs 0-7 and 8-15
    for (int64_t r = 0; r < R; ++r) {
      q[r] = xq.q.data() + ((r0 + r) * groups + g) * kGroup;
      sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    }
    integer_dense::prefetch_ahead(p, kPieces * 2 * kBlock);
    for (int64_t j = 0; j < kPieces; ++j) {
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i v =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * kBlock * j + kBlock * h)));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi16(v, 4);
        for (int64_t r = 0; r < R; ++r) {
          sums[r][h] = _mm256_add_epi32(
              sums[r][h],
              _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi32(integer_dense::input_pair(q[r] + 4 * j))),
                               _mm256_madd_epi16(hi, _mm256_set1_epi32(integer_dense::input_pair(q[r] + 4 * j + 2)))));
        }
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      const at::Half* ds = scales + 2 * g * out + ob * kBlock + 8 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + out)));
      for (int64_t r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * groups + g;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(xq.dx[at])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.sx[at]), acc[r][h]);
      }
    }
  }
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t o = ob * kBlock + 8 * h;
    for (int64_t r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + (r0 + r) * out + o, bias != nullptr ? _mm256_add_ps(acc[r][h], _mm256_loadu_ps(bias + o))
                                                               : acc[r][h]);
    }
  }
#else
  for (int64_t k = 0; k < kBlock; ++k) {
    const int64_t o = ob * kBlock + k;
    for (int64_t r = r0; r < r0 + R; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = w + g * kPieces * 2 * kBlock;
        const int16_t* q = xq.q.data() + (r * groups + g) * kGroup;
        int32_t sum = 0;
        for (int64_t j = 0; j < kPieces; ++j) {
          for (int64_t t = 0; t < 2; ++t) {
            const uint8_t b = p[2 * kBlock * j + 2 * k + t];
            sum += (b & 0xF) * q[4 * j + t] + (b >> 4) * q[4 * j + 2 + t];
          }
        }
        const float d = static_cast<float>(scales[2 * g * out + o]);
        const float m = static_cast<float>(scales[(2 * g + 1) * out + o]);
        acc = std::fma(static_cast<float>(sum), d * xq.dx[r * groups + g], acc);
        acc = std::fma(m, xq.sx[r * groups + g], acc);
      }
      y[r * out + o] = bias != nullptr ? acc + bias[o] : acc;
    }
  }
#endif
}

// Outputs [16 * b0, 16 * b1) of every row.
void blocks_into(const RoundedRows& xq, const uint8_t* w, const at::Half* scales, const float* bias, int64_t rows,
                 int64_t groups, int64_t out, int64_t b0, int64_t b1, float* y) {
  for (int64_t ob = b0; ob < b1; ++ob) {
    const uint8_t* block = w + ob * groups * kPieces * 2 * kBlock;
    integer_dense::over_row_tiles(rows, [&](auto tile, int64_t r0) {
      tile_into<decltype(tile)::value>(xq, block, scales, bias, groups, out, ob, r0, y);
    });
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& by_output, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(by_output.device().is_cpu() && scales.device().is_cpu(), "int4_dense_linear: CPU tensors expected");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == 2 && scales.size(2) % kBlock == 0 && scales.size(2) > 0 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "int4_dense_linear: scales must be a contiguous float16 (in / 32, 2, out) tensor with out a multiple "
              "of 16, got ", scales.sizes());
  const int64_t out = scales.size(2);
  integer_dense::check_rows("int4_dense_linear", x, bias, out);
  const int64_t in = x.size(1), groups = in / kGroup;
  TORCH_CHECK(scales.size(0) == groups, "int4_dense_linear: scales must be a contiguous float16 (in / 32, 2, out) "
              "tensor, got ", scales.sizes(), " for in = ", in);
  integer_dense::check_by_output("int4_dense_linear", by_output, at::kByte, kPieces, in, out,
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
