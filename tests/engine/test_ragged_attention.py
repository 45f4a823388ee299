"""The attention of a batched decode step (prunewatch.engine.batching.ragged_attention): the compiled per-row
operator (csrc/ragged_attention.cpp) gives bitwise the outputs and caches of the row-by-row Python loop, which
is what each row would compute alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from prunewatch.engine import batching
from prunewatch.engine.batching import RaggedStep, ragged_attention

HEAD_DIM = 16


def _caches(lengths: list[int], kv_heads: int, seed: int) -> list[DynamicCache]:
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for length in lengths:
        cache = DynamicCache()
        keys = torch.randn(1, kv_heads, length, HEAD_DIM, generator=generator)
        cache.update(keys, torch.randn(1, kv_heads, length, HEAD_DIM, generator=generator), 0)
        caches.append(cache)
    return caches


def _step(lengths: list[int], heads: int, kv_heads: int, use_operator: bool, monkeypatch: pytest.MonkeyPatch,
          scaling: float | None = 0.25) -> tuple[torch.Tensor, list[DynamicCache]]:
    generator = torch.Generator().manual_seed(7)
    rows = len(lengths)
    query = torch.randn(rows, 1, heads, HEAD_DIM, generator=generator).transpose(1, 2)  # as the model makes it
    key = torch.randn(rows, 1, kv_heads, HEAD_DIM, generator=generator).transpose(1, 2)
    value = torch.randn(rows, 1, kv_heads, HEAD_DIM, generator=generator).transpose(1, 2)
    caches = _caches(lengths, kv_heads, seed=3)
    if not use_operator:
        monkeypatch.setattr(batching, "_operator", None)
    module = SimpleNamespace(layer_idx=0, training=False)
    output, weights = ragged_attention(module, query, key, value, None, RaggedStep(caches), scaling=scaling)
    assert weights is None
    monkeypatch.undo()
    return output, caches


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("lengths", [[5, 1], [9, 1, 30, 17], [12, 12, 12]])
def test_the_operator_gives_the_python_loops_outputs_and_caches_bitwise(
        lengths: list[int], heads: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert batching._ragged_operator() is not None  # built with the sparse kernel on this machine
    compiled, compiled_caches = _step(lengths, heads, kv_heads, True, monkeypatch)
    python, python_caches = _step(lengths, heads, kv_heads, False, monkeypatch)
    assert compiled.shape == (len(lengths), 1, heads, HEAD_DIM)
    assert torch.equal(compiled, python)
    for ours, theirs, length in zip(compiled_caches, python_caches, lengths, strict=True):
        assert ours.get_seq_length(0) == theirs.get_seq_length(0) == length + 1
        assert torch.equal(ours.layers[0].keys, theirs.layers[0].keys)
        assert torch.equal(ours.layers[0].values, theirs.layers[0].values)
        # The operator stands in for DynamicLayer.update: if a transformers upgrade makes update keep any other
        # state (a length counter, a flag), the layers differ here and the operator must learn to keep it too.
        assert _state(ours.layers[0]) == _state(theirs.layers[0])


def _state(layer: DynamicLayer) -> dict[str, object]:
    """A cache layer's attributes other than its key and value tensors."""
    return {name: value for name, value in vars(layer).items() if not isinstance(value, torch.Tensor)}


def test_each_row_attends_over_its_own_cache_as_a_batch_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 1 of a ragged batch equals the same row decoded alone, and softmax(q k^T s) v by hand."""
    lengths = [9, 4, 21]
    batched, caches = _step(lengths, 6, 2, True, monkeypatch)
    row_keys, row_values = caches[1].layers[0].keys, caches[1].layers[0].values  # (1, 2, 5, dim), new row included
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(3, 1, 6, HEAD_DIM, generator=generator).transpose(1, 2)[1:2]
    by_hand = torch.softmax(query @ row_keys.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25, dim=-1)
    by_hand = (by_hand @ row_values.repeat_interleave(3, dim=1)).transpose(1, 2)
    torch.testing.assert_close(batched[1:2], by_hand)


def test_caches_that_are_not_plain_dynamic_layers_take_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    class Recording(DynamicLayer):
        """A DynamicLayer subclass whose update the compiled operator would bypass: it must be called."""

        calls = 0

        def update(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            Recording.calls += 1
            return super().update(*args, **kwargs)

    caches = _caches([3, 8], 2, seed=1)
    original = caches[1].layers[0]
    replacement = Recording()
    replacement.update(original.keys, original.values)
    caches[1].layers[0] = replacement
    Recording.calls = 0
    query = torch.randn(2, 4, 1, HEAD_DIM)
    key, value = torch.randn(2, 2, 1, HEAD_DIM), torch.randn(2, 2, 1, HEAD_DIM)
    ragged_attention(SimpleNamespace(layer_idx=0, training=False), query, key, value, None, RaggedStep(caches),
                     scaling=None)
    assert Recording.calls == 1
    assert caches[0].get_seq_length(0) == 4 and caches[1].get_seq_length(0) == 9
