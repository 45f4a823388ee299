// The dense product of fp32 weights for the few rows of a decode step, each row's sums independent of the others.
//
// Batched decoding needs a row to get the same bits whatever rows share its step (batching.py). The sparse kernel
// (sparse_linear.cpp) gives that by splitting the input channels over threads into per-thread accumulators that are
// zeroed, filled and summed at the end: three operators more per call, and at 4 to 8 rows its loops reload and
// store every accumulator once per 8 input channels. Here the threads split the *outputs* instead: each output of
// each row is one chain of fused multiply-adds over the input channels in ascending order, from zero, computed by
// one thread, then the bias added. Nothing in that chain depends on the number of rows, on how the rows are
// blocked, or on the number of threads, so a row gets the same bits alone, in a batch of any size, under any thread
// count (the scalar tail, std::fma in the same order, gives the vector lanes' bits too).
//
// A thread's outputs are taken in tiles held in vector registers, `rows x vectors` accumulators (as many as the
// registers hold beside one weight vector per column and a broadcast input: more vectors per row when the step has
// fewer rows), over blocks of kChannels input channels; between blocks the partial sums wait in the output, which
// stays in L1. Each weight vector loaded feeds every row of the block, and each broadcast input every vector of
// the tile, so 4 to 8 rows run on the multiply-adds rather than on loads and stores. The weights are wt = W^T,
// (in, out), the layout the sparse kernel reads: a block reads kChannels contiguous runs of the thread's columns.
//
// Measured against the sparse kernel reading every row (its dense call before this one), SmolLM2-135M's decoder
// shapes, 30 layers of weights streamed from memory in turn, 2 threads, AVX-512, medians of 8 interleaved passes:
// 1 row 1.10x faster, 4 rows 1.33x, 8 rows 1.47x, 16 rows 1.48x; its 49152-wide output head 1.5x at one row and
// 1.3x at 8. A whole batched decode step of the real model: 37.3 / 41.9 / 48.3 ms at 1 / 4 / 8 rows, from 39.7 /
// 50.7 / 60.2 ms.

#include "fp32_dense.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "thread_count.h"

namespace prunewatch {
namespace {

// Input channels per block (partial sums kept in the output between blocks): a decode step's few rows, and a prefill
// chunk's many (more than one register tile of rows). A chunk's tiles re-read each block's weights from L2 once per
// tile of rows, and its partial sums go to the output and back once per block, so longer blocks let it run on the
// multiply-adds. Measured by hand on SmolLM2-135M's decoder shapes, 2 threads, AVX-512, weights in cache: 30 rows
// went from about 0.86x BLAS's multiply-adds per second at 32 channels to 1.07x at 128, 54 rows from 0.74x to 0.96x.
// The order of each output's chain is the same at any block length, so neither changes a bit.
constexpr int64_t kChannels = 32;
constexpr int64_t kChunkChannels = 128;
// Weight lines are requested into L2 (prefetcht1) this many channels ahead, at the columns being combined: a tile
// reads short strided runs that the hardware prefetcher does not run ahead of. Measured on SmolLM2-135M's decoder
// shapes, 30 layers of weights streamed from memory in turn, 2 threads, AVX-512: without it 8 rows took 28.7 ms
// a pass, at 4, 16, 32 and 64 channels ahead 22.3, 18.7, 20.0 and 20.5 ms (one row ~13 ms in every case, bound by
// the bytes); 16 to 128 channels per block varied within the runs' noise.
constexpr int64_t kAhead = 16;
constexpr int kPrefetchLocality = 2;

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int kRowBlock = 8;       // rows per register tile
constexpr int kRegisters = 28;     // of 32, for accumulators, weight vectors and the broadcast
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vbroadcast(float v) { return _mm512_set1_ps(v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int kRowBlock = 4;
constexpr int kRegisters = 15;  // of 16
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vbroadcast(float v) { return _mm256_set1_ps(v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#else
constexpr int64_t kWidth = 1;  // no vector path: threads split single columns
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// Vectors per row in a tile of R rows: R x V accumulators + V weight vectors + 1 broadcast within the registers.
constexpr int vectors_for(int rows) { return std::max(1, std::min(8, (kRegisters - 1) / (rows + 1))); }

// y[r, o, o + V * kWidth) for r < R, channels [k0, k1): from zero when k0 is 0, else from the partial sums in y.
template <int R, int V>
inline void tile(const float* x, int64_t in, const float* wt, int64_t out, float* y, int64_t o, int64_t k0,
                 int64_t k1) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = k0 == 0 ? vzero() : vload(y + r * out + o + v * kWidth);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = wt + k * out + o;
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vload(w + v * kWidth);
    if (k + kAhead < in) {  // one request per 64-byte line of the tile's columns
      for (int v = 0; v < V; v += static_cast<int>(64 / sizeof(Vec))) {
        __builtin_prefetch(w + kAhead * out + v * kWidth, 0, kPrefetchLocality);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec xr = vbroadcast(x[r * in + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) vstore(y + r * out + o + v * kWidth, acc[r][v]);
  }
}

// Columns [c0, c1) (multiples of kWidth) of R rows over channels [k0, k1): wide tiles, then single vectors.
template <int R>
void columns(const float* x, int64_t in, const float* wt, int64_t out, float* y, int64_t c0, int64_t c1, int64_t k0,
             int64_t k1) {
  constexpr int V = vectors_for(R);
  int64_t o = c0;
  for (; o + V * kWidth <= c1; o += V * kWidth) tile<R, V>(x, in, wt, out, y, o, k0, k1);
  for (; o + kWidth <= c1; o += kWidth) tile<R, 1>(x, in, wt, out, y, o, k0, k1);
}

void row_block(int rows, const float* x, int64_t in, const float* wt, int64_t out, float* y, int64_t c0, int64_t c1,
               int64_t k0, int64_t k1) {
  switch (rows) {
    case 1: return columns<1>(x, in, wt, out, y, c0, c1, k0, k1);
    case 2: return columns<2>(x, in, wt, out, y, c0, c1, k0, k1);
    case 3: return columns<3>(x, in, wt, out, y, c0, c1, k0, k1);
#if defined(__AVX512F__)
    case 4: return columns<4>(x, in, wt, out, y, c0, c1, k0, k1);
    case 5: return columns<5>(x, in, wt, out, y, c0, c1, k0, k1);
    case 6: return columns<6>(x, in, wt, out, y, c0, c1, k0, k1);
    case 7: return columns<7>(x, in, wt, out, y, c0, c1, k0, k1);
    case 8: return columns<8>(x, in, wt, out, y, c0, c1, k0, k1);
#else
    case 4: return columns<4>(x, in, wt, out, y, c0, c1, k0, k1);
#endif
    default: TORCH_CHECK(false, "fp32_dense_linear: row block of ", rows, " rows");
  }
}
#endif

// Outputs [c0, c1) of every row, each from its own chain over all channels, plus the bias.
void outputs_into(const float* x, int64_t rows, int64_t in, const float* wt, int64_t out, const float* bias,
                  float* y, int64_t c0, int64_t c1) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const int64_t vector_end = c0 + (c1 - c0) / kWidth * kWidth;  // c0 is a multiple of kWidth
  const int64_t channels = rows > kRowBlock ? kChunkChannels : kChannels;
  for (int64_t k0 = 0; k0 < in; k0 += channels) {
    const int64_t k1 = std::min(in, k0 + channels);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int block = static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0));
      row_block(block, x + r0 * in, in, wt, out, y + r0 * out, c0, vector_end, k0, k1);
    }
  }
#else
  const int64_t vector_end = c0;  // no vector path: every column is the scalar loop's
#endif
  for (int64_t r = 0; r < rows; ++r) {
    // The columns past the last whole vector: the same chain per output, one fused multiply-add per channel.
    for (int64_t o = vector_end; o < c1; ++o) {
      float acc = 0.0f;
      for (int64_t k = 0; k < in; ++k) acc = std::fma(x[r * in + k], wt[k * out + o], acc);
      y[r * out + o] = acc;
    }
    if (bias == nullptr) continue;
    float* yr = y + r * out;
    int64_t o = c0;
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; o + kWidth <= c1; o += kWidth) vstore(yr + o, vadd(vload(yr + o), vload(bias + o)));
#endif
    for (; o < c1; ++o) yr[o] = yr[o] + bias[o];
  }
}

}  // namespace

at::Tensor fp32_dense_linear(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias,
                             int64_t threads) {
  TORCH_CHECK(x.device().is_cpu() && wt.device().is_cpu(), "fp32_dense_linear: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "fp32_dense_linear: x must be a float32 (rows, in) "
              "tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous() && wt.scalar_type() == at::kFloat,
              "fp32_dense_linear: wt must be a contiguous float32 (in, out) tensor");
  TORCH_CHECK(x.size(1) == wt.size(0), "fp32_dense_linear: x has ", x.size(1), " input channels, wt has ", wt.size(0));
  const int64_t rows = x.size(0), in = wt.size(0), out = wt.size(1);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out && bias->device().is_cpu(),
                "fp32_dense_linear: bias must be a CPU vector of length out");
  }
  keep_thread_count();
  const at::Tensor xf = x.contiguous();
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  // No input channels: every sum is empty, so each output is its bias (the loops below never write one).
  at::Tensor y = in == 0 ? at::zeros({rows, out}, xf.options()) : at::empty({rows, out}, xf.options());
  if (rows == 0 || out == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const float* w = wt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t vectors = (out + kWidth - 1) / kWidth;  // the last one may be partial (the scalar tail)
  auto body = [&](int64_t v0, int64_t v1) {
    outputs_into(xp, rows, in, w, out, b, yp, v0 * kWidth, std::min(out, v1 * kWidth));
  };
  over_output_chunks(vectors, in * out, threads, body);
  return y;
}

}  // namespace prunewatch
