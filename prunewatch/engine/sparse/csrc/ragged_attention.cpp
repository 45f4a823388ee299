// Attention of one decode step over per-row KV caches reserved ahead, as one operator call per layer.
//
// In a decode step of the batcher every row is a different request with a cache of its own length. Each row
// writes its new key and value into its cache, at the first free position of a buffer sized for the whole
// request (prompt plus max new tokens: what the batcher's KV budget reserves for it), and attends over the
// positions filled so far, alone. Done with ATen, each row and layer paid a concatenation of its whole cache
// (a copy that grows with the context) and a scaled_dot_product_attention call; here the write is in place and
// one call serves every row (measured by hand, SmolLM2-135M's heads, 76 positions, AVX2 host: 8 us per layer
// for one row, 31 us for eight).
//
// Each (row, key/value head) is computed start to end by one thread in a fixed order, so a row's output does not
// depend on the other rows of the step nor on the thread count: a request decodes the same tokens alone or in
// any batch. The arithmetic is plain fp32: the scores q.k * scale summed in lanes of 8 (AVX2) then across
// lanes, the softmax with its maximum subtracted (exp from a polynomial, after Cephes' expf; the outputs agree
// with float64 attention to 1e-5 in tests/engine/test_ragged_attention.py), and the weighted sum of values in
// position order.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "ragged_attention.h"
#include "thread_count.h"

namespace {

#ifdef __AVX2__
// e^x for 8 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial in r, times 2^n).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

inline float lane_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1)));
}
#endif

// scores[j] = q . keys[j] * scale for j < n. With AVX2 (dim a multiple of 8) each score is a chain of fused
// multiply-adds over 8-wide slices of dim, then a sum across the 8 lanes; keys are taken 8 at a time only so that
// 8 chains run side by side: every score is the same sum, in the same order, wherever its key falls.
inline void scores_of(const float* q, const float* keys, int64_t n, int64_t dim, float scale, float* scores) {
  int64_t j = 0;
#ifdef __AVX2__
  if (dim % 8 == 0) {
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys + (j + i) * dim + d), acc[i]);
      }
      for (int i = 0; i < 8; ++i) scores[j + i] = lane_sum(acc[i]) * scale;
    }
    for (; j < n; ++j) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(keys + j * dim + d), acc);
      }
      scores[j] = lane_sum(acc) * scale;
    }
    return;
  }
#endif
  for (; j < n; ++j) {
    float sum = 0.0f;
    for (int64_t d = 0; d < dim; ++d) sum += q[d] * keys[j * dim + d];
    scores[j] = sum * scale;
  }
}

// out[d] = sum_j weights[j] * values[j][d] (j in order) * inverse. With AVX2, 64 outputs at a time in registers.
inline void weighted_values(const float* weights, const float* values, int64_t n, int64_t dim, float inverse,
                            float* out) {
  int64_t d0 = 0;
#ifdef __AVX2__
  for (; d0 + 64 <= dim; d0 += 64) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_broadcast_ss(weights + j);
      const float* v = values + j * dim + d0;
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    const __m256 scale = _mm256_set1_ps(inverse);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(acc[i], scale));
  }
#endif
  for (int64_t d = d0; d < dim; ++d) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += weights[j] * values[j * dim + d];
    out[d] = sum * inverse;
  }
}

// scores[0, n) -> exp(scores - max); returns their sum, taken in position order.
inline float softmax_numerators(float* scores, int64_t n) {
  float top = scores[0];
  for (int64_t j = 1; j < n; ++j) top = std::max(top, scores[j]);
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 shift = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift)));
#endif
  for (; j < n; ++j) scores[j] = std::exp(scores[j] - top);
  float total = 0.0f;
  for (j = 0; j < n; ++j) total += scores[j];
  return total;
}

// One row's key/value head `group`: append the new key and value at `length`, then every query head of the group
// attends over positions [0, length]. Pointers are to the row's data; strides in floats.
void attend_group(const float* query, int64_t query_head_stride, const float* key, const float* value,
                  float* key_cache, float* value_cache, int64_t length, int64_t heads_per_group, int64_t dim,
                  float scale, float* output, std::vector<float>& scores) {
  std::copy(key, key + dim, key_cache + length * dim);
  std::copy(value, value + dim, value_cache + length * dim);
  const int64_t n = length + 1;
  scores.resize(static_cast<size_t>(n));
  for (int64_t h = 0; h < heads_per_group; ++h) {
    scores_of(query + h * query_head_stride, key_cache, n, dim, scale, scores.data());
    const float inverse = 1.0f / softmax_numerators(scores.data(), n);
    weighted_values(scores.data(), value_cache, n, dim, inverse, output + h * dim);
  }
}

}  // namespace

namespace prunewatch {

at::Tensor reserved_decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const std::vector<at::Tensor>& key_caches,
                                     const std::vector<at::Tensor>& value_caches,
                                     const std::vector<int64_t>& lengths, double scale, int64_t threads) {
  const int64_t rows = query.size(0);
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(2) == 1 && key.size(2) == 1 &&
                  value.size(2) == 1,
              "reserved_decode_attention: query, key and value must be (rows, heads, 1, dim), got ", query.sizes(),
              ", ", key.sizes(), ", ", value.sizes());
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && query.device().is_cpu(),
              "reserved_decode_attention: float32 CPU tensors only");
  const int64_t heads = query.size(1), kv_heads = key.size(1), dim = query.size(3);
  TORCH_CHECK(key.size(0) == rows && value.size(0) == rows && value.size(1) == kv_heads && key.size(3) == dim &&
                  value.size(3) == dim && kv_heads > 0 && heads % kv_heads == 0,
              "reserved_decode_attention: key and value must be (rows, kv_heads, 1, dim) with heads a multiple of "
              "kv_heads");
  TORCH_CHECK(static_cast<int64_t>(key_caches.size()) == rows && static_cast<int64_t>(value_caches.size()) == rows &&
                  static_cast<int64_t>(lengths.size()) == rows,
              "reserved_decode_attention: one key cache, value cache and length per row");
  for (int64_t b = 0; b < rows; ++b) {
    for (const at::Tensor* cache : {&key_caches[b], &value_caches[b]}) {
      TORCH_CHECK(cache->scalar_type() == at::kFloat && cache->is_contiguous() && cache->dim() == 4 &&
                      cache->size(0) == 1 && cache->size(1) == kv_heads && cache->size(3) == dim,
                  "reserved_decode_attention: row ", b, "'s caches must be contiguous float32 (1, kv_heads, "
                  "capacity, dim), got ", cache->sizes());
    }
    TORCH_CHECK(value_caches[b].size(2) == key_caches[b].size(2) && lengths[b] >= 0 &&
                    lengths[b] < key_caches[b].size(2),
                "reserved_decode_attention: row ", b, " has ", lengths[b], " of ", key_caches[b].size(2),
                " positions filled: no room for the step's");
  }
  prunewatch::keep_thread_count();
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  at::Tensor output = at::empty({rows, 1, heads, dim}, query.options());
  const int64_t group = heads / kv_heads;
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  float* out_data = output.data_ptr<float>();
  std::vector<float*> key_data(rows), value_data(rows);
  int64_t positions = 0;
  for (int64_t b = 0; b < rows; ++b) {
    key_data[b] = key_caches[b].data_ptr<float>();
    value_data[b] = value_caches[b].data_ptr<float>();
    positions += lengths[b] + 1;
  }
  const int64_t units = rows * kv_heads;
  // A team is worth waking only for enough positions (a short single-row step runs faster on its own thread). In a
  // decode step of SmolLM2-135M on 2 threads (AVX-512 host, the caches cold after the step's weights streamed
  // through), a team from 1024 positions x heads took the layers' attention from 2.6 to 1.6-2.1 ms per step at 4
  // rows of 80 positions and from 1.65 to 1.2 ms at 1 row of 200 (4096 before); 1 row of 80 stays on one thread.
  const int wanted = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  const int team = positions * heads >= 1024 ? std::max(1, wanted) : 1;
#pragma omp parallel num_threads(team)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t b = unit / kv_heads, g = unit % kv_heads;
      const int64_t capacity = key_caches[b].size(2);
      attend_group(q_data + b * q.stride(0) + g * group * q.stride(1), q.stride(1),
                   k_data + (b * kv_heads + g) * dim, v_data + (b * kv_heads + g) * dim,
                   key_data[b] + g * capacity * dim, value_data[b] + g * capacity * dim, lengths[b], group, dim,
                   static_cast<float>(scale), out_data + (b * heads + g * group) * dim, scores);
    }
  }
  return output;
}

}  // namespace prunewatch
