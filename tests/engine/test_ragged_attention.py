"""The attention of a decode step over reserved caches (prunewatch.engine.batching.ragged_attention with
csrc/ragged_attention.cpp, prunewatch.engine.kv_cache): each row writes its key and value in place and attends
over its own filled positions, as softmax(q k^T * scale) v by hand, whatever the other rows of the step are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from prunewatch.engine import batching
from prunewatch.engine.batching import RaggedStep, ragged_attention
from prunewatch.engine.kv_cache import ReservedLayer, reserved_cache
from prunewatch.engine.sparse.kernel import build


def _caches(lengths: list[int], kv_heads: int, dim: int, seed: int, spare: int = 4) -> list[DynamicCache]:
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for length in lengths:
        cache = DynamicCache()
        cache.layers = [ReservedLayer(length + spare)]
        cache.update(torch.randn(1, kv_heads, length, dim, generator=generator),
                     torch.randn(1, kv_heads, length, dim, generator=generator), 0)
        caches.append(cache)
    return caches


def _inputs(rows: int, heads: int, kv_heads: int, dim: int, seed: int = 7) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    # (rows, heads, 1, dim) as the model makes them: transposed views of (rows, 1, heads, dim)
    return tuple(torch.randn(rows, 1, n, dim, generator=generator).transpose(1, 2) for n in (heads, kv_heads, kv_heads))


def _attend(caches: list[DynamicCache], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scaling: float | None = 0.25) -> torch.Tensor:
    module = SimpleNamespace(layer_idx=0, training=False)
    output, weights = ragged_attention(module, query, key, value, None, RaggedStep(caches), scaling=scaling)
    assert weights is None
    return output


def _by_hand(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: (1, heads, 1, dim) over (1, kv_heads, n, dim), in float64."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    weights = torch.softmax(query.double() @ keys.transpose(-1, -2) * scale, dim=-1)
    return (weights @ values).transpose(1, 2).float()


@pytest.mark.parametrize("dim", [64, 16, 12])  # 64: the vector path throughout; 16: vector scores; 12: scalar
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("lengths", [[5, 1], [9, 1, 30, 17], [12, 12, 12], [300]])
def test_each_row_attends_over_its_own_cache_with_the_new_position_written_in_place(
        lengths: list[int], heads: int, kv_heads: int, dim: int) -> None:
    caches = _caches(lengths, kv_heads, dim, seed=3)
    before = [(c.layers[0].keys.clone(), c.layers[0].values.clone()) for c in caches]
    buffers = [c.layers[0].key_buffer for c in caches]
    query, key, value = _inputs(len(lengths), heads, kv_heads, dim)
    output = _attend(caches, query, key, value)
    assert output.shape == (len(lengths), 1, heads, dim) and output.is_contiguous()
    for row, (cache, (keys, values), length) in enumerate(zip(caches, before, lengths, strict=True)):
        layer = cache.layers[0]
        assert layer.key_buffer is buffers[row]  # written in place: no copy of the cache
        assert cache.get_seq_length(0) == layer.length == length + 1
        assert torch.equal(layer.keys, torch.cat([keys, key[row:row + 1]], dim=-2))
        assert torch.equal(layer.values, torch.cat([values, value[row:row + 1]], dim=-2))
        expected = _by_hand(query[row:row + 1], layer.keys, layer.values, 0.25)
        torch.testing.assert_close(output[row:row + 1], expected, rtol=1e-5, atol=1e-6)


def test_the_default_scale_is_one_over_the_root_of_the_head_dimension() -> None:
    caches = _caches([7], 2, 16, seed=1)
    query, key, value = _inputs(1, 4, 2, 16)
    output = _attend(caches, query, key, value, scaling=None)
    expected = _by_hand(query, caches[0].layers[0].keys, caches[0].layers[0].values, 16 ** -0.5)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


def test_a_rows_output_does_not_depend_on_the_other_rows_nor_on_the_thread_count() -> None:
    """Row 1 alone, in a batch of four, and with one or two threads (the long caches wake a team of threads):
    bitwise the same output, so a request decodes the same tokens alone or batched."""
    lengths = [40, 700, 3, 900]
    query, key, value = _inputs(4, 9, 3, 64)
    batched = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            batched[threads] = _attend(_caches(lengths, 3, 64, seed=5), query, key, value)
        finally:
            torch.set_num_threads(2)
    alone = _attend([_caches(lengths, 3, 64, seed=5)[1]], query[1:2], key[1:2], value[1:2])
    assert torch.equal(batched[1], batched[2])
    assert torch.equal(batched[2][1:2], alone)


def test_without_the_operator_the_rows_attend_through_torchs_sdpa_to_the_same_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [9, 1, 30]
    query, key, value = _inputs(3, 6, 2, 64)
    compiled_caches, python_caches = _caches(lengths, 2, 64, seed=3), _caches(lengths, 2, 64, seed=3)
    compiled = _attend(compiled_caches, query, key, value)
    monkeypatch.setattr(batching, "_operator", None)
    python = _attend(python_caches, query, key, value)
    torch.testing.assert_close(compiled, python, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(compiled_caches, python_caches, strict=True):
        assert torch.equal(ours.layers[0].keys, theirs.layers[0].keys)


def test_a_full_cache_grows_before_the_step_writes() -> None:
    caches = _caches([5], 2, 16, seed=2, spare=0)
    layer = caches[0].layers[0]
    assert layer.capacity == 5
    kept = layer.keys.clone()
    query, key, value = _inputs(1, 4, 2, 16)
    _attend(caches, query, key, value)
    assert layer.capacity == 10 and layer.length == 6
    assert torch.equal(layer.keys[:, :, :5], kept) and torch.equal(layer.keys[:, :, 5:], key)


def test_the_operator_refuses_a_cache_without_room_for_the_step() -> None:
    query, key, value = _inputs(1, 4, 2, 16)
    buffer = torch.zeros(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match="no room"):
        build().reserved_decode_attention(query, key, value, [buffer], [buffer.clone()], [3], 0.25, 1)
    with pytest.raises(RuntimeError, match="one key cache, value cache and length per row"):
        build().reserved_decode_attention(query, key, value, [buffer], [buffer.clone()], [1, 1], 0.25, 1)


def test_a_reserved_layer_fills_like_transformers_dynamic_layer() -> None:
    """Prefill chunks through update: the same keys and values, lengths and mask sizes as a DynamicLayer, without
    reallocating until the reservation is exceeded."""
    generator = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 3, n, 8, generator=generator) for n in (4, 1, 6)]
    ours, theirs = ReservedLayer(8), DynamicLayer()
    for chunk in chunks:
        got, want = ours.update(chunk, chunk * 2), theirs.update(chunk, chunk * 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
    assert ours.capacity == 16  # 4 + 1 fit in 8; the 6 after them doubled it


def test_a_reserved_layers_keys_are_written_only_through_update_and_reset_empties_it() -> None:
    layer = ReservedLayer(4)
    layer.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    with pytest.raises(TypeError, match="written through update"):
        layer.keys = torch.zeros(1, 1, 2, 4)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None and not layer.is_initialized
    layer.update(torch.full((1, 1, 3, 4), 2.0), torch.full((1, 1, 3, 4), 3.0))
    assert layer.get_seq_length() == 3 and float(layer.values.sum()) == 36.0
    layer.crop(-1)
    assert layer.get_seq_length() == 2 and layer.keys.shape == (1, 1, 2, 4)
    with pytest.raises(ValueError, match="capacity >= 1"):
        ReservedLayer(0)


def test_reserved_cache_replaces_only_transformers_plain_layers() -> None:
    from transformers import LlamaConfig, MistralConfig

    plain = reserved_cache(LlamaConfig(num_hidden_layers=3), 10)
    assert [type(layer) for layer in plain.layers] == [ReservedLayer] * 3
    assert all(layer.capacity == 10 for layer in plain.layers)
    windowed = reserved_cache(MistralConfig(num_hidden_layers=2, sliding_window=16), 10)
    assert all(type(layer) is not ReservedLayer for layer in windowed.layers)


def _tiny_model(family: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, StableLmConfig, StableLmForCausalLM

    config = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    if family == "stablelm":
        return StableLmForCausalLM(StableLmConfig(**config)).eval()
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


@pytest.mark.parametrize("family", ["llama", "stablelm"])  # StableLM's decoder layers drop extra keyword arguments
def test_a_decode_step_over_reserved_caches_gives_transformers_own_logits(family: str) -> None:
    model = _tiny_model(family)
    prompt = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = DynamicCache(config=model.config)
        token = int(model(input_ids=prompt, cache=theirs, use_cache=True).logits[0, -1].argmax())
        expected = model(input_ids=torch.tensor([[token]]), cache=theirs, use_cache=True,
                         position_ids=torch.tensor([[9]])).logits[0, -1]
        batching.install_ragged_attention(model)
        ours = reserved_cache(model.config, 12)
        model(input_ids=prompt, cache=ours, use_cache=True)
        logits = batching.ragged_decode_step(model, [token], [9], [ours])
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)
    assert ours.get_seq_length() == 10


def test_a_step_whose_attention_bypasses_the_ragged_function_fails_instead_of_answering() -> None:
    """Attention that does not go through transformers' interface would attend over the new position alone."""
    model = _tiny_model("llama")  # its attention left as SDPA: the step's caches are never read
    cache = reserved_cache(model.config, 12)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="3 attention layers hold this request's cache but 0 attended"):
            batching.ragged_decode_step(model, [8], [3], [cache])
