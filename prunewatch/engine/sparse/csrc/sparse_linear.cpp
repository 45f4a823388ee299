// Sparse linear layer for activation sparsity on the CPU: y = x_masked @ W^T + b.
//
// The weight is stored transposed and contiguous per input channel, wt = W^T with shape (in, out),
// so the out weights that multiply input channel i are one contiguous row wt[i, :]. The kernel
// first decides which input channels are active for the whole call (the union over rows of the
// entries that pass the threshold, or a top-k channel set shared by the rows), then streams only
// the rows of wt for those channels. The row of an inactive channel is never touched, so its
// bytes are never read from memory: that is where the time goes at small batch, where a linear
// layer is bound by the bandwidth needed to read its weights.
//
// Work is split over the active channels (each thread streams whole rows, the longest contiguous
// runs the prefetcher can follow) into per-thread fp32 accumulators that are summed at the end.
// Inside a thread, eight active rows are combined per pass so each accumulator element is loaded
// and stored once per eight fused multiply-adds (eight weight streams, which the hardware
// prefetcher still follows; eight measured faster than four or sixteen at 2048-5632 wide layers),
// batch rows are taken two at a time so each weight loaded feeds two accumulators, and outputs are
// tiled so the eight weight tiles stay in L1 while they are reused for every row of the batch.
// Parallel regions are entered only when each thread gets enough work, since a region waits for
// its slowest thread.
//
// Weights may also be int8 with one fp32 scale per output channel (W[o, i] ~ q[i, o] * s[o]): a row
// of wt is then a quarter of the fp32 bytes, the same loops convert each int8 weight to fp32 before
// its multiply-add (sums stay fp32), and the scale is applied once to each finished output. Reading
// a quarter of the bytes is the point: at one token per step a layer is bound by its weight reads.
//
// Or int4 in groups of 32 input channels with a scale and a minimum per (group, output), both fp16:
// W[o, i] ~ d[g, o] * q[i, o] + m[g, o] with q in 0..15 and g = i / 32, which is GGUF's Q4_1 block read
// along the other axis. Row i of wt then holds out / 2 bytes: in each run of 32 outputs, byte k carries
// output k in its low nibble and output k + 16 in its high one, so one 16-byte load widens into two
// vectors of 16 consecutive outputs. Per group, sum_i x_i W[o, i] = d[g, o] * sum_i x_i q[i, o] +
// m[g, o] * sum_i x_i: the inner sums run on small integers converted to fp32 in registers, and the
// scales are applied once per group and output.
//
// A dense call of an int4 or int8 layer with few rows goes instead to int4_dense.cpp or int8_dense.cpp, on the
// weights laid out by output.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fp32_dense.h"
#include "int4_dense.h"
#include "int8_dense.h"
#include "ragged_attention.h"
#include "threshold_mask.h"
#include "thread_count.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 8;   // active weight rows combined per pass
constexpr int64_t kMaxTile = 768;  // output columns per tile at most: 8 x 768 x 4 B = 24 KiB of weights in L1
constexpr int64_t kMinWorkPerThread = 1 << 16;  // weights read below which one thread does it all

// Weight rows are requested into L2 (prefetcht1) one unit of work ahead: the next group of kGroup rows
// (fp32, int8) or the next int4 group's active rows. A call's rows are short interleaved streams (8 to 32
// rows read a few cache lines at a time) that the hardware prefetcher does not run ahead of, so without
// this a decode step reads its weights from DRAM at a fraction of the bandwidth. The quantized products
// request the next rows' lines column by column as they combine the current ones (a burst of a whole
// group's lines at once stalls on the miss buffers and gained int4 nothing); fp32 requests a tile at
// once. Into L2 rather than L1, which the accumulators and the current rows occupy. Measured on
// SmolLM2-135M's layer shapes, 30 layers streamed from DRAM in rotating order, 2 threads, one token,
// interleaved with the kernel without it: int8 1.5-1.65x faster, int4 1.2-1.45x, fp32 at half the rows
// 1.1x; with the weights already in cache (not a decode step's case) fp32 ran 0.88x.
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's locality: 2 = prefetcht1 (into L2)

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at, 0, kPrefetchLocality);
  __builtin_prefetch(c + bytes - 1, 0, kPrefetchLocality);
}

// The channels a call reads, and the input values it multiplies them by.
struct Selection {
  std::vector<int64_t> channels;  // active input channels, ascending (so memory is read in order)
  std::vector<float> coef;        // (n_active, rows): masked input value of each row per channel
  int64_t kept_entries = 0;       // non-zero (row, channel) entries after masking
};

// Row policy (TEAL-style): entry (b, i) is kept when |x[b, i]| * scale[i] > threshold. A channel is
// active when any row keeps it, so the weights read are the union over rows.
Selection select_by_threshold(const float* x, int64_t rows, int64_t in, const float* scale,
                              float threshold) {
  Selection sel;
  sel.channels.reserve(in);
  if (rows == 1) {
    // A decode step: one pass, since a channel's coefficient is its one entry (measured ~2% of the
    // kernel's time on SmolLM2-135M's decode inputs against the two passes below).
    sel.coef.reserve(in);
    for (int64_t i = 0; i < in; ++i) {
      if (std::fabs(x[i]) * scale[i] > threshold) {
        sel.channels.push_back(i);
        sel.coef.push_back(x[i]);
      }
    }
    sel.kept_entries = static_cast<int64_t>(sel.channels.size());
    return sel;
  }
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t b = 0; b < rows; ++b) {
      if (std::fabs(x[b * in + i]) * scale[i] > threshold) {
        sel.channels.push_back(i);
        break;
      }
    }
  }
  const int64_t n = static_cast<int64_t>(sel.channels.size());
  sel.coef.resize(static_cast<size_t>(n * rows));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = sel.channels[j];
    for (int64_t b = 0; b < rows; ++b) {
      const float v = x[b * in + i];
      const bool keep = std::fabs(v) * scale[i] > threshold;
      sel.coef[j * rows + b] = keep ? v : 0.0f;
      sel.kept_entries += keep ? 1 : 0;
    }
  }
  return sel;
}

// Shared policy: the rows share the `keep` channels with the largest sum over rows of
// |x[b, i]| * scale[i]; every row keeps its full value on those channels.
Selection select_top_k(const float* x, int64_t rows, int64_t in, const float* scale, int64_t keep) {
  std::vector<float> score(static_cast<size_t>(in), 0.0f);
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < in; ++i) {
      score[i] += std::fabs(x[b * in + i]) * scale[i];
    }
  }
  std::vector<int64_t> order(static_cast<size_t>(in));
  for (int64_t i = 0; i < in; ++i) order[i] = i;
  keep = std::max<int64_t>(0, std::min(keep, in));
  // Larger score first; the lower index wins a tie so the selection is deterministic.
  auto larger = [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  if (keep < in) {
    std::nth_element(order.begin(), order.begin() + keep, order.end(), larger);
  }
  Selection sel;
  sel.channels.assign(order.begin(), order.begin() + keep);
  std::sort(sel.channels.begin(), sel.channels.end());
  sel.coef.resize(static_cast<size_t>(keep * rows));
  for (int64_t j = 0; j < keep; ++j) {
    for (int64_t b = 0; b < rows; ++b) {
      const float v = x[b * in + sel.channels[j]];
      sel.coef[j * rows + b] = v;
      sel.kept_entries += v != 0.0f ? 1 : 0;
    }
  }
  return sel;
}

// acc[o0, o1) += sum over k of c[k] * w[k][o0, o1) for one row and a full group of int8 weight rows.
// Written with intrinsics: the compiler's own vectorization of the int8 -> fp32 conversion inside the
// group loop ran at ~1.7 cycles per weight (shuffles instead of one sign-extending load), slower per
// byte than the fp32 loop. Here each 16 (AVX-512) or 8 (AVX2) weights are one sign-extending load, one
// conversion and one multiply-add, two output vectors at a time with two partial sums each so the
// multiply-adds of a group do not wait on each other. `next` (or nullptr): the rows of the group that
// follows, whose same columns are requested as these are combined (see kPrefetchLocality).
inline void int8_group_into(const int8_t* const* w, const float* c, float* acc, int64_t o0, int64_t o1,
                            const int8_t* const* next) {
  int64_t o = o0;
#if defined(__AVX512F__)
  __m512 cv[kGroup];
  for (int64_t k = 0; k < kGroup; ++k) cv[k] = _mm512_set1_ps(c[k]);
  auto load = [](const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  for (; o + 32 <= o1; o += 32) {
    if (next != nullptr) {
      for (int64_t k = 0; k < kGroup; ++k) __builtin_prefetch(next[k] + o, 0, kPrefetchLocality);
    }
    __m512 a0 = _mm512_loadu_ps(acc + o), a1 = _mm512_loadu_ps(acc + o + 16);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < kGroup; k += 2) {
      a0 = _mm512_fmadd_ps(cv[k], load(w[k] + o), a0);
      a1 = _mm512_fmadd_ps(cv[k], load(w[k] + o + 16), a1);
      b0 = _mm512_fmadd_ps(cv[k + 1], load(w[k + 1] + o), b0);
      b1 = _mm512_fmadd_ps(cv[k + 1], load(w[k + 1] + o + 16), b1);
    }
    _mm512_storeu_ps(acc + o, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(acc + o + 16, _mm512_add_ps(a1, b1));
  }
#elif defined(__AVX2__)
  __m256 cv[kGroup];
  for (int64_t k = 0; k < kGroup; ++k) cv[k] = _mm256_set1_ps(c[k]);
  auto load = [](const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  for (; o + 16 <= o1; o += 16) {
    if (next != nullptr) {
      for (int64_t k = 0; k < kGroup; ++k) __builtin_prefetch(next[k] + o, 0, kPrefetchLocality);
    }
    __m256 a0 = _mm256_loadu_ps(acc + o), a1 = _mm256_loadu_ps(acc + o + 8);
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < kGroup; k += 2) {
      a0 = _mm256_fmadd_ps(cv[k], load(w[k] + o), a0);
      a1 = _mm256_fmadd_ps(cv[k], load(w[k] + o + 8), a1);
      b0 = _mm256_fmadd_ps(cv[k + 1], load(w[k + 1] + o), b0);
      b1 = _mm256_fmadd_ps(cv[k + 1], load(w[k + 1] + o + 8), b1);
    }
    _mm256_storeu_ps(acc + o, _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(acc + o + 8, _mm256_add_ps(a1, b1));
  }
#endif
  for (; o < o1; ++o) {  // the tail (and every column on a CPU without AVX2)
    float sum = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) sum += c[k] * static_cast<float>(w[k][o]);
    acc[o] += sum;
  }
}

constexpr int64_t kQuantGroup = 32;  // int4: input channels sharing one scale and minimum per output

// acc[0, out) += d * (sum over k of c[k] * q_k) + m * (sum over k of c[k]) for the `count` active rows w[k]
// of one int4 group (d, m: that group's fp16 scale and minimum rows). The partial sums of 64 (AVX-512) or
// 32 (AVX2) outputs stay in registers over all the group's rows, so each output is loaded and stored once
// per group. next[0, next_count): the rows of the thread's next group, whose same columns are requested
// as these are combined.
inline void int4_group_into(const uint8_t* const* w, const float* c, int64_t count, const at::Half* d,
                            const at::Half* m, float* acc, int64_t out, const uint8_t* const* next, int64_t next_count) {
  float total = 0.0f;
  for (int64_t k = 0; k < count; ++k) total += c[k];
  int64_t o = 0;
#if defined(__AVX512F__)
  const __m512i low = _mm512_set1_epi32(0xF);
  const __m512 sum = _mm512_set1_ps(total);
  auto widen = [](const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  auto half16 = [](const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  auto finish = [&](__m512 t, int64_t at) {
    _mm512_storeu_ps(acc + at, _mm512_fmadd_ps(half16(d + at), t, _mm512_fmadd_ps(half16(m + at), sum, _mm512_loadu_ps(acc + at))));
  };
  for (; o + 64 <= out; o += 64) {
    for (int64_t k = 0; k < next_count; ++k) __builtin_prefetch(next[k] + o / 2, 0, kPrefetchLocality);
    __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps(), t2 = _mm512_setzero_ps(), t3 = _mm512_setzero_ps();
    for (int64_t k = 0; k < count; ++k) {
      const __m512 cv = _mm512_set1_ps(c[k]);
      const uint8_t* p = w[k] + o / 2;
      const __m512i v0 = widen(p), v1 = widen(p + 16);
      t0 = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_and_si512(v0, low)), t0);
      t1 = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), t1);
      t2 = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_and_si512(v1, low)), t2);
      t3 = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), t3);
    }
    finish(t0, o);
    finish(t1, o + 16);
    finish(t2, o + 32);
    finish(t3, o + 48);
  }
  for (; o + 32 <= out; o += 32) {
    __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < count; ++k) {
      const __m512 cv = _mm512_set1_ps(c[k]);
      const __m512i v0 = widen(w[k] + o / 2);
      t0 = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_and_si512(v0, low)), t0);
      t1 = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), t1);
    }
    finish(t0, o);
    finish(t1, o + 16);
  }
#elif defined(__AVX2__)
  const __m256i low = _mm256_set1_epi32(0xF);
  const __m256 sum = _mm256_set1_ps(total);
  auto widen = [](const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); };
  auto half8 = [](const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  auto finish = [&](__m256 t, int64_t at) {
    _mm256_storeu_ps(acc + at, _mm256_fmadd_ps(half8(d + at), t, _mm256_fmadd_ps(half8(m + at), sum, _mm256_loadu_ps(acc + at))));
  };
  for (; o + 32 <= out; o += 32) {
    for (int64_t k = 0; k < next_count; ++k) __builtin_prefetch(next[k] + o / 2, 0, kPrefetchLocality);
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps(), t3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < count; ++k) {
      const __m256 cv = _mm256_set1_ps(c[k]);
      const uint8_t* p = w[k] + o / 2;
      const __m256i v0 = widen(p), v1 = widen(p + 8);  // bytes 0-7: outputs o..o+7 and o+16..o+23; 8-15: the rest
      t0 = _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), t0);
      t1 = _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), t1);
      t2 = _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), t2);
      t3 = _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), t3);
    }
    finish(t0, o);
    finish(t1, o + 8);
    finish(t2, o + 16);
    finish(t3, o + 24);
  }
#endif
  for (; o < out; ++o) {  // every column on a CPU without AVX2 (out is a multiple of 32: no tail otherwise)
    const int64_t byte = (o / 32) * 16 + (o % 16);
    const int shift = (o % 32) < 16 ? 0 : 4;
    float t = 0.0f;
    for (int64_t k = 0; k < count; ++k) t += c[k] * static_cast<float>((w[k][byte] >> shift) & 0xF);
    acc[o] += static_cast<float>(d[o]) * t + static_cast<float>(m[o]) * total;
  }
}

// The int4 product of a call's active channels: work is split over the int4 groups that hold active
// channels (a group's rows share its scales, so a group is never split between threads).
void accumulate_int4(const Selection& sel, const uint8_t* wt, const at::Half* scales, int64_t rows, int64_t out,
                     float* acc, int64_t num_threads) {
  const int64_t n = static_cast<int64_t>(sel.channels.size());
  std::vector<int64_t> starts;  // first selected channel of each int4 group that has one, then n
  for (int64_t j = 0; j < n; ++j) {
    if (j == 0 || sel.channels[j] / kQuantGroup != sel.channels[j - 1] / kQuantGroup) starts.push_back(j);
  }
  starts.push_back(n);
  const int64_t spans = static_cast<int64_t>(starts.size()) - 1;
  if (spans <= 0) return;
  const int64_t row_bytes = out / 2;
  auto body = [&](int64_t begin, int64_t end) {
    const int64_t tid = num_threads == 1 ? 0 : std::min<int64_t>(at::get_thread_num(), num_threads - 1);
    float* a = acc + tid * rows * out;
    const uint8_t* w[kQuantGroup];
    float c[kQuantGroup];
    auto prefetch_scales = [&](int64_t s) {  // a span's fp16 scales and minimums: 2 x out values
      prefetch_bytes(scales + 2 * (sel.channels[starts[s]] / kQuantGroup) * out, 2 * out * 2);
    };
    if (begin < end) {  // the first span of this thread, at once
      for (int64_t j = starts[begin]; j < starts[begin + 1]; ++j) prefetch_bytes(wt + sel.channels[j] * row_bytes, row_bytes);
      prefetch_scales(begin);
    }
    const uint8_t* nw[kQuantGroup];
    for (int64_t s = begin; s < end; ++s) {
      const int64_t j0 = starts[s], j1 = starts[s + 1];
      int64_t next_count = 0;
      if (s + 1 < end) {  // the next span's rows are requested inside the product, its scales here
        for (int64_t j = starts[s + 1]; j < starts[s + 2]; ++j) nw[next_count++] = wt + sel.channels[j] * row_bytes;
        prefetch_scales(s + 1);
      }
      const int64_t g = sel.channels[j0] / kQuantGroup;
      const at::Half* d = scales + (2 * g) * out;
      bool requested = next_count == 0;
      for (int64_t b = 0; b < rows; ++b) {
        int64_t count = 0;
        for (int64_t j = j0; j < j1; ++j) {
          const float v = sel.coef[j * rows + b];
          if (v == 0.0f) continue;
          w[count] = wt + sel.channels[j] * row_bytes;
          c[count++] = v;
        }
        if (count == 0) continue;
        int4_group_into(w, c, count, d, d + out, a + b * out, out, nw, requested ? 0 : next_count);  // once per span
        requested = true;
      }
    }
  };
  // As for the other formats: a thread gets at least kMinWorkPerThread weights (read, not multiply-adds: the same
  // split for any number of rows), else one thread does it all.
  const int64_t min_grain = std::max<int64_t>(1, kMinWorkPerThread * spans / std::max<int64_t>(1, n * out));
  const int64_t grain = std::max(min_grain, (spans + num_threads - 1) / num_threads);
  if (num_threads == 1 || spans <= grain) {
    body(0, spans);
  } else {
    at::parallel_for(0, spans, grain, body);
  }
}

// Output columns per tile: `out` split into equal tiles of at most kMaxTile, rounded up to whole cache lines.
// Equal rather than fixed-width tiles: a 576-wide layer as one tile instead of 512 + 64 ran its products
// 4-5% faster (SmolLM2-135M's decode inputs, one thread), the short tail tile costing a pass of its own.
int64_t tile_width(int64_t out) {
  const int64_t tiles = std::max<int64_t>(1, (out + kMaxTile - 1) / kMaxTile);
  const int64_t even = (out + tiles - 1) / tiles;
  return (even + 15) / 16 * 16;
}

// Four rows of fp32 weights at once: acc_b[o0, o1) += sum over k of c[k * rows + b] * w[k][o0, o1) for b in
// [first, first + 4). Each weight vector loaded feeds four rows and each coefficient broadcast feeds two output
// vectors, so a pass does 64 multiply-adds per 56 loads where the two-row loop below does 16 per 28: a batched
// decode step of 4 to 8 rows is bound by these loads, not by the weights' bytes. Each row's sum runs over k in the
// same order, from zero, as the one- and two-row loops (one fused multiply-add per term, then one add into the
// accumulator), so a row's output does not depend on the rows beside it. Returns the first column it left.
// Measured against the two-row loop (one thread, SmolLM2-135M's shapes, weights in cache, AVX2, two interleaved
// runs): 4 rows 1.02-1.12x faster, 8 rows 1.04-1.19x.
template <typename scalar_t>
inline int64_t fp32_four_rows_into(const scalar_t* const* w, const float* c, int64_t rows, int64_t first,
                                   float* acc, int64_t out, int64_t o0, int64_t o1) {
  int64_t o = o0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    float* a[4] = {acc + first * out, acc + (first + 1) * out, acc + (first + 2) * out, acc + (first + 3) * out};
    for (; o + 16 <= o1; o += 16) {
      __m256 s[4][2];
      for (int r = 0; r < 4; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < kGroup; ++k) {
        const __m256 w0 = _mm256_loadu_ps(w[k] + o), w1 = _mm256_loadu_ps(w[k] + o + 8);
        const float* ck = c + k * rows + first;
        for (int r = 0; r < 4; ++r) {
          const __m256 cr = _mm256_broadcast_ss(ck + r);
          s[r][0] = _mm256_fmadd_ps(cr, w0, s[r][0]);
          s[r][1] = _mm256_fmadd_ps(cr, w1, s[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(a[r] + o, _mm256_add_ps(_mm256_loadu_ps(a[r] + o), s[r][0]));
        _mm256_storeu_ps(a[r] + o + 8, _mm256_add_ps(_mm256_loadu_ps(a[r] + o + 8), s[r][1]));
      }
    }
  }
#endif
  return o;
}

// Groups [begin, end) of a call's active channels, into the accumulator of the calling thread. A function
// of its own with its sizes passed by value rather than the body of a by-reference lambda: the same
// loops ran ~3% faster so (SmolLM2-135M's decode inputs, interleaved repetitions, twice).
template <typename scalar_t>
void accumulate_groups(const Selection& sel, const scalar_t* wt, const int64_t rows, const int64_t out,
                       float* acc, const int64_t num_threads, const int64_t n, const int64_t begin,
                       const int64_t end) {
  const int64_t tid = num_threads == 1 ? 0 : std::min<int64_t>(at::get_thread_num(), num_threads - 1);
  float* a = acc + tid * rows * out;
  const int64_t tile = tile_width(out);
  for (int64_t g = begin; g < end; ++g) {
    const int64_t j = g * kGroup;
    const int64_t width = std::min(kGroup, n - j);
    const float* c = sel.coef.data() + j * rows;
    if (width == kGroup) {
      const scalar_t* wk[kGroup];
      for (int64_t k = 0; k < kGroup; ++k) {
        wk[k] = wt + sel.channels[j + k] * out;
      }
      // The rows of the next group, when this thread runs one: requested while this group is combined.
      const bool has_next = g + 1 < end && n - (j + kGroup) >= kGroup;
      const scalar_t* nk[kGroup];
      for (int64_t k = 0; k < kGroup; ++k) nk[k] = has_next ? wt + sel.channels[j + kGroup + k] * out : nullptr;
      for (int64_t o0 = 0; o0 < out; o0 += tile) {
        const int64_t o1 = std::min(out, o0 + tile);
        if constexpr (std::is_same_v<scalar_t, int8_t>) {
          bool requested = !has_next;
          for (int64_t b = 0; b < rows; ++b) {  // one row at a time: the tile's weights stay in L1 across rows
            float cc[kGroup];
            bool any = false;
            for (int64_t k = 0; k < kGroup; ++k) {
              cc[k] = c[k * rows + b];
              any |= cc[k] != 0.0f;
            }
            if (!any) continue;
            int8_group_into(wk, cc, a + b * out, o0, o1, requested ? nullptr : nk);  // requests them once per tile
            requested = true;
          }
          continue;
        }
        if (has_next) {  // floating-point weights: the next group's part of this tile, at once
          for (int64_t k = 0; k < kGroup; ++k) prefetch_bytes(nk[k] + o0, (o1 - o0) * static_cast<int64_t>(sizeof(scalar_t)));
        }
        int64_t b = 0;
        if constexpr (std::is_same_v<scalar_t, float>) {
          for (; b + 3 < rows; b += 4) {
            const int64_t left = fp32_four_rows_into(wk, c, rows, b, a, out, o0, o1);
            // The columns it left (a tile's end short of 16, or every column without AVX2), in the same order.
            for (int64_t r = b; r < b + 4; ++r) {
              float* __restrict__ ar = a + r * out;
              for (int64_t o = left; o < o1; ++o) {
                float sum = 0.0f;
                for (int64_t k = 0; k < kGroup; ++k) sum += c[k * rows + r] * wk[k][o];
                ar[o] += sum;
              }
            }
          }
        }
        // Two rows per pass: each weight loaded from L1 feeds two accumulators.
        for (; b + 1 < rows; b += 2) {
          float p[kGroup], q[kGroup];
#pragma GCC unroll 16
          for (int64_t k = 0; k < kGroup; ++k) {
            p[k] = c[k * rows + b];
            q[k] = c[k * rows + b + 1];
          }
          float* __restrict__ ap = a + b * out;
          float* __restrict__ aq = a + (b + 1) * out;
#pragma GCC ivdep
          for (int64_t o = o0; o < o1; ++o) {
            float sp = 0.0f, sq = 0.0f;
#pragma GCC unroll 16
            for (int64_t k = 0; k < kGroup; ++k) {
              const float v = static_cast<float>(wk[k][o]);
              sp += p[k] * v;
              sq += q[k] * v;
            }
            ap[o] += sp;
            aq[o] += sq;
          }
        }
        for (; b < rows; ++b) {
          float cc[kGroup];
          bool any = false;
#pragma GCC unroll 16
          for (int64_t k = 0; k < kGroup; ++k) {
            cc[k] = c[k * rows + b];
            any |= cc[k] != 0.0f;
          }
          if (!any) continue;
          float* __restrict__ ab = a + b * out;
#pragma GCC ivdep
          for (int64_t o = o0; o < o1; ++o) {
            float sum = 0.0f;
#pragma GCC unroll 16
            for (int64_t k = 0; k < kGroup; ++k) sum += cc[k] * static_cast<float>(wk[k][o]);
            ab[o] += sum;
          }
        }
      }
    } else {
      for (int64_t k = 0; k < width; ++k) {
        const scalar_t* w = wt + sel.channels[j + k] * out;
        for (int64_t b = 0; b < rows; ++b) {
          const float ck = c[k * rows + b];
          if (ck == 0.0f) continue;
          float* __restrict__ ab = a + b * out;
#pragma GCC ivdep
          for (int64_t o = 0; o < out; ++o) {
            ab[o] += ck * static_cast<float>(w[o]);
          }
        }
      }
    }
  }
}

template <typename scalar_t>
void accumulate(const Selection& sel, const scalar_t* wt, int64_t rows, int64_t out, float* acc,
                int64_t num_threads) {
  const int64_t n = static_cast<int64_t>(sel.channels.size());
  const int64_t groups = (n + kGroup - 1) / kGroup;
  // Contiguous ranges of groups per thread; each thread owns one (rows, out) accumulator. A thread
  // gets at least kMinWorkPerThread weights: waking a thread for less costs more than it saves,
  // and on a busy host a parallel region waits for its slowest (descheduled) thread. Counted in weights read,
  // not in multiply-adds: the split, and so the order of each row's partial sums, is then the same for any number
  // of rows, so a row reading every channel gets the same output alone or in a batch.
  const int64_t min_grain = std::max<int64_t>(1, kMinWorkPerThread / (kGroup * out));
  const int64_t grain = std::max(min_grain, (groups + num_threads - 1) / num_threads);  // <= num_threads chunks
  auto body = [&](int64_t begin, int64_t end) {
    accumulate_groups<scalar_t>(sel, wt, rows, out, acc, num_threads, n, begin, end);
  };
  if (num_threads == 1 || groups <= grain) {
    body(0, groups);  // no parallel region: nothing to wait for on a busy host
  } else {
    at::parallel_for(0, groups, grain, body);
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias,
                  const at::Tensor& scale, const c10::optional<at::Tensor>& weight_scale) {
  TORCH_CHECK(x.device().is_cpu() && wt.device().is_cpu(), "sparse_linear: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2, "sparse_linear: x must be (rows, in), got ", x.sizes());
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous(), "sparse_linear: wt must be a contiguous (in, out) tensor");
  TORCH_CHECK(x.size(1) == wt.size(0), "sparse_linear: x has ", x.size(1), " input channels, wt has ", wt.size(0));
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == wt.size(0) && scale.scalar_type() == at::kFloat,
              "sparse_linear: scale must be a float32 vector of length in");
  const bool quantized = wt.scalar_type() == at::kChar || wt.scalar_type() == at::kByte;
  TORCH_CHECK(quantized == weight_scale.has_value(),
              "sparse_linear: int8 and int4 weights need weight_scale (int8: one float32 scale per output "
              "channel; int4: float16 (in / 32, 2, out) scales and minimums), and only they take one");
  if (wt.scalar_type() == at::kChar) {
    TORCH_CHECK(weight_scale->dim() == 1 && weight_scale->size(0) == wt.size(1) &&
                    weight_scale->scalar_type() == at::kFloat && weight_scale->device().is_cpu() &&
                    weight_scale->is_contiguous(),
                "sparse_linear: weight_scale must be a contiguous float32 CPU vector of length out");
  } else if (quantized) {
    const int64_t out = wt.size(1) * 2;
    TORCH_CHECK(wt.size(0) % kQuantGroup == 0 && out % kQuantGroup == 0,
                "sparse_linear: int4 weights need in and out to be multiples of 32, got in ", wt.size(0), ", out ", out);
    TORCH_CHECK(weight_scale->dim() == 3 && weight_scale->size(0) == wt.size(0) / kQuantGroup &&
                    weight_scale->size(1) == 2 && weight_scale->size(2) == out &&
                    weight_scale->scalar_type() == at::kHalf && weight_scale->device().is_cpu() &&
                    weight_scale->is_contiguous(),
                "sparse_linear: int4 weight_scale must be a contiguous float16 CPU tensor of shape (in / 32, 2, out)");
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, "sparse_linear: bias must have length out");
    }
    return;
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == wt.size(1), "sparse_linear: bias must have length out");
  }
}

// The output of a quantized call from its per-thread accumulators: y[b, o] = (sum over threads) * scale[o]
// (+ bias[o]), one pass instead of a sum, a multiply and an add as three operators (at one token per
// step each operator's fixed cost is a few microseconds, ~200 calls per step). int4 calls have applied
// their scales per group already: no scale (nullptr).
at::Tensor finish_quantized(const at::Tensor& acc, int64_t num_threads, int64_t rows, int64_t out,
                            const float* s, const c10::optional<at::Tensor>& bias) {
  at::Tensor y = num_threads == 1 ? acc : at::empty({rows, out}, acc.options());
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* a = acc.data_ptr<float>();
  const float* bs = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t stride = rows * out;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t o = 0; o < out; ++o) {
      float v = a[b * out + o];
      for (int64_t t = 1; t < num_threads; ++t) v += a[t * stride + b * out + o];
      if (s != nullptr) v *= s[o];
      yp[b * out + o] = bs != nullptr ? v + bs[o] : v;
    }
  }
  return y;
}

// Returns (y (rows, out) in x's dtype, active channels read, kept (row, channel) entries).
// keep < 0: row policy with `threshold`; keep >= 0: shared policy keeping `keep` channels.
// threads <= 0: torch's intra-op thread count; 1: run on the calling thread only.
// weight_scale: with int8 wt, the fp32 scale of each output channel; none for floating-point weights.
std::tuple<at::Tensor, int64_t, int64_t> sparse_linear(const at::Tensor& x, const at::Tensor& wt,
                                                       const c10::optional<at::Tensor>& bias,
                                                       const at::Tensor& scale, double threshold,
                                                       int64_t keep, int64_t threads,
                                                       const c10::optional<at::Tensor>& weight_scale) {
  check_inputs(x, wt, bias, scale, weight_scale);
  prunewatch::keep_thread_count();
  const bool int4 = wt.scalar_type() == at::kByte;
  const int64_t rows = x.size(0), in = wt.size(0), out = int4 ? wt.size(1) * 2 : wt.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sc = scale.contiguous();
  const Selection sel = keep < 0
      ? select_by_threshold(xf.data_ptr<float>(), rows, in, sc.data_ptr<float>(), static_cast<float>(threshold))
      : select_top_k(xf.data_ptr<float>(), rows, in, sc.data_ptr<float>(), keep);
  const int64_t pool = std::max<int64_t>(1, at::get_num_threads());
  const int64_t num_threads = threads > 0 ? std::min(threads, pool) : pool;
  // One (rows, out) accumulator per thread; with one thread it is the output itself (no view, no sum:
  // at one token per step these per-call operators cost as much as a small layer's weights).
  at::Tensor acc = num_threads == 1 ? at::zeros({rows, out}, xf.options()) : at::zeros({num_threads, rows, out}, xf.options());
  if (int4) {
    accumulate_int4(sel, wt.data_ptr<uint8_t>(), weight_scale->data_ptr<at::Half>(), rows, out, acc.data_ptr<float>(),
                    num_threads);
    return std::make_tuple(finish_quantized(acc, num_threads, rows, out, nullptr, bias).to(x.scalar_type()),
                           static_cast<int64_t>(sel.channels.size()), sel.kept_entries);
  }
  if (weight_scale.has_value()) {
    accumulate<int8_t>(sel, wt.data_ptr<int8_t>(), rows, out, acc.data_ptr<float>(), num_threads);
    return std::make_tuple(finish_quantized(acc, num_threads, rows, out, weight_scale->data_ptr<float>(), bias)
                               .to(x.scalar_type()),
                           static_cast<int64_t>(sel.channels.size()), sel.kept_entries);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wt.scalar_type(), "sparse_linear", [&] {
    accumulate<scalar_t>(sel, wt.data_ptr<scalar_t>(), rows, out, acc.data_ptr<float>(), num_threads);
  });
  at::Tensor y = num_threads == 1 ? acc : acc.sum(0);
  if (bias.has_value()) {
    y.add_(bias->to(at::kFloat));
  }
  return std::make_tuple(y.to(x.scalar_type()), static_cast<int64_t>(sel.channels.size()), sel.kept_entries);
}

// The same product as an operator torch.compile can put in a graph. The thresholds and top-k sizes of all
// call sites of a model come as two vectors, `thresholds` (float32) and `keeps` (int64), one entry per
// slot, set per request without recompiling; the work done is added to stats[slot] = (active channels,
// kept entries, calls) instead of being returned as Python integers. Three tensors shared by every call
// site rather than two per site: each tensor a graph takes is an input the compiled step checks on
// every call, ~200 sites per token on a 30-block model.
at::Tensor sparse_linear_counted(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias,
                                 const at::Tensor& scale, const at::Tensor& thresholds, const at::Tensor& keeps,
                                 int64_t threads, at::Tensor& stats, int64_t slot,
                                 const c10::optional<at::Tensor>& weight_scale,
                                 const c10::optional<at::Tensor>& by_output) {
  TORCH_CHECK(stats.scalar_type() == at::kLong && stats.dim() == 2 && stats.size(1) == 3 && stats.is_contiguous(),
              "sparse_linear_counted: stats must be a contiguous int64 (slots, 3) tensor");
  TORCH_CHECK(slot >= 0 && slot < stats.size(0), "sparse_linear_counted: slot ", slot, " out of range");
  TORCH_CHECK(thresholds.dim() == 1 && thresholds.size(0) == stats.size(0) && thresholds.scalar_type() == at::kFloat &&
                  thresholds.is_contiguous() && thresholds.device().is_cpu() &&
                  keeps.dim() == 1 && keeps.size(0) == stats.size(0) && keeps.scalar_type() == at::kLong &&
                  keeps.is_contiguous() && keeps.device().is_cpu(),
              "sparse_linear_counted: thresholds (float32) and keeps (int64) must be contiguous CPU vectors "
              "with one entry per row of stats");
  // Read directly: Tensor::item() dispatches, twice per layer per token.
  const double limit = thresholds.data_ptr<float>()[slot];
  const int64_t top_k = keeps.data_ptr<int64_t>()[slot];
  if (limit < 0.0 && top_k < 0 && !weight_scale.has_value()) {
    // A layer whose target is 0 in a sparse graph: every channel passes, so the dense product (the BLAS
    // call the eager layer makes, on the same transposed weight) gives what the kernel would. int8
    // weights have no BLAS product here: the kernel reads every row instead.
    check_inputs(x, wt, bias, scale, weight_scale);
    int64_t* counts = stats.data_ptr<int64_t>() + 3 * slot;
    counts[0] += wt.size(0);
    counts[1] += x.size(0) * wt.size(0);
    counts[2] += 1;
    return bias.has_value() ? at::addmm(*bias, x, wt) : at::mm(x, wt);
  }
  if (limit < 0.0 && top_k < 0 && by_output.has_value()) {
    // An int4 or int8 layer's dense product, as the eager layer computes it (int4_dense.cpp, int8_dense.cpp):
    // every row of wt counted.
    TORCH_CHECK(weight_scale.has_value() && (wt.scalar_type() == at::kByte || wt.scalar_type() == at::kChar),
                "sparse_linear_counted: by_output goes with int4 or int8 weights and their scales");
    at::Tensor y = wt.scalar_type() == at::kByte
                       ? prunewatch::int4_dense_linear(x, *by_output, *weight_scale, bias, threads)
                       : prunewatch::int8_dense_linear(x, *by_output, *weight_scale, bias, threads);
    int64_t* counts = stats.data_ptr<int64_t>() + 3 * slot;
    counts[0] += wt.size(0);
    counts[1] += x.size(0) * wt.size(0);
    counts[2] += 1;
    return y;
  }
  auto result = sparse_linear(x, wt, bias, scale, limit, top_k, threads, weight_scale);
  int64_t* counts = stats.data_ptr<int64_t>() + 3 * slot;
  counts[0] += std::get<1>(result);
  counts[1] += std::get<2>(result);
  counts[2] += 1;
  return std::get<0>(result);
}

}  // namespace

TORCH_LIBRARY(prunewatch, m) {
  m.def("sparse_linear_counted(Tensor x, Tensor wt, Tensor? bias, Tensor scale, Tensor thresholds, Tensor keeps, "
        "int threads, Tensor(a!) stats, int slot, Tensor? weight_scale=None, Tensor? by_output=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(prunewatch, CPU, m) {
  m.impl("sparse_linear_counted", &sparse_linear_counted);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "prunewatch sparse linear kernel (CPU): reads only the weight rows of active input channels";
  m.def("sparse_linear", &sparse_linear, "y = masked(x) @ wt + bias, reading only active rows of wt",
        pybind11::arg("x"), pybind11::arg("wt"), pybind11::arg("bias"), pybind11::arg("scale"),
        pybind11::arg("threshold"), pybind11::arg("keep"), pybind11::arg("threads"),
        pybind11::arg("weight_scale") = pybind11::none());
  m.def("fp32_dense_linear", &prunewatch::fp32_dense_linear,
        "y = x @ wt + bias for fp32 weights (wt = W^T), each output one chain over the inputs: a row's bits do not "
        "depend on the other rows or the thread count",
        pybind11::arg("x"), pybind11::arg("wt"), pybind11::arg("bias"), pybind11::arg("threads"));
  m.def("int4_dense_linear", &prunewatch::int4_dense_linear,
        "y = x @ int4 weights (laid out by output) + bias, x rounded to int16 per group of 32 inputs",
        pybind11::arg("x"), pybind11::arg("by_output"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("threads"));
  m.def("int8_dense_linear", &prunewatch::int8_dense_linear,
        "y = x @ int8 weights (laid out by output) + bias, x rounded to int16 per group of 32 inputs",
        pybind11::arg("x"), pybind11::arg("by_output"), pybind11::arg("weight_scale"), pybind11::arg("bias"),
        pybind11::arg("threads"));
  m.def("threshold_mask", &prunewatch::threshold_mask,
        "(x with the entries whose |x| * scale is not above threshold zeroed, entries kept): the row policy's mask "
        "of a call with many rows, in one pass",
        pybind11::arg("x"), pybind11::arg("scale"), pybind11::arg("threshold"));
  m.def("reserved_decode_attention", &prunewatch::reserved_decode_attention,
        "one decode step's attention: each row's key and value written in place in its reserved cache, then the "
        "row attending over its filled positions alone",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("key_caches"),
        pybind11::arg("value_caches"), pybind11::arg("lengths"), pybind11::arg("scale"), pybind11::arg("threads"));
}
