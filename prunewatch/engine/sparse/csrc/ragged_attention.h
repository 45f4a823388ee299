// Attention of one decode step over per-row KV caches reserved ahead, in place (ragged_attention.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace prunewatch {

// query (rows, heads, 1, dim), key and value (rows, kv_heads, 1, dim), float32: the step's new rows. key_caches[b]
// and value_caches[b] (1, kv_heads, capacity_b, dim), contiguous float32: row b's reserved buffers, lengths[b]
// positions filled. Writes each row's key and value at position lengths[b] (the caller advances the lengths) and
// returns the attention output (rows, 1, heads, dim). threads <= 0: torch's intra-op thread count.
at::Tensor reserved_decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const std::vector<at::Tensor>& key_caches,
                                     const std::vector<at::Tensor>& value_caches,
                                     const std::vector<int64_t>& lengths, double scale, int64_t threads);

}  // namespace prunewatch
