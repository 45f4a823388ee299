// Attention of one batched decode step over per-row KV caches, as one operator call per layer.
//
// In a batched decode step every row is a different request with a cache of its own length. Each row appends
// its new key and value to its cache and attends over that cache alone, exactly as it would decoding by itself.
// Done in Python that is a slice, a cache update (two concatenations) and a scaled-dot-product-attention call
// per row and layer. Here the same ATen calls run per row from C++: the same concatenations and the same
// scaled_dot_product_attention on the same tensors, so each row's output is bitwise the one the Python loop (and
// a batch of one) computes; only the interpreter's share goes. Measured on SmolLM2-135M (2 threads, AVX2 host,
// interleaved runs, same logits): a step of 4 rows 1.03x faster, 8 rows 1.05x; a step of one row gains nothing
// and keeps the loop. The rows run one after another on the calling thread: run on threads of their own, each
// row's attention ran single-threaded and its sums came out in a different order.

#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace {

// query (B, heads, 1, dim), key and value (B, kv_heads, 1, dim): the step's new rows; keys[b] and values[b]
// (1, kv_heads, n_b, dim): row b's cache before the step. Returns (output (B, 1, heads, dim), the caches with
// the new rows appended), as transformers' DynamicLayer.update and SDPA attention would give them.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> ragged_decode_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::TensorList keys,
    at::TensorList values, c10::optional<double> scale, bool enable_gqa) {
  const int64_t rows = query.size(0);
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(2) == 1,
              "ragged_decode_attention: query, key and value must be (rows, heads, 1, dim), got ", query.sizes());
  TORCH_CHECK(key.size(0) == rows && value.size(0) == rows && static_cast<int64_t>(keys.size()) == rows &&
                  static_cast<int64_t>(values.size()) == rows,
              "ragged_decode_attention: one key, value and cache per query row");
  std::vector<at::Tensor> new_keys(rows), new_values(rows), outputs(rows);
  for (int64_t b = 0; b < rows; ++b) {
    new_keys[b] = at::cat({keys[b], key.narrow(0, b, 1)}, -2);
    new_values[b] = at::cat({values[b], value.narrow(0, b, 1)}, -2);
    outputs[b] = at::scaled_dot_product_attention(query.narrow(0, b, 1), new_keys[b], new_values[b],
                                                  /*attn_mask=*/c10::nullopt, /*dropout_p=*/0.0,
                                                  /*is_causal=*/false, scale, enable_gqa)
                     .transpose(1, 2);
  }
  at::Tensor output = rows == 1 ? outputs[0] : at::cat(outputs, 0);
  return std::make_tuple(output, new_keys, new_values);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prunewatch, m) {
  m.def("ragged_decode_attention(Tensor query, Tensor key, Tensor value, Tensor[] keys, Tensor[] values, "
        "float? scale, bool enable_gqa) -> (Tensor, Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(prunewatch, CPU, m) {
  m.impl("ragged_decode_attention", &ragged_decode_attention);
}
