"""KV caches reserved ahead for a request: each layer's keys and values in one buffer of the request's whole length.

transformers' DynamicLayer grows by concatenation: every decode step copies the layer's whole cache to append one
position, a copy that grows with the context, and the step's attention then runs over a fresh tensor. A request
in the batcher knows its length up front (prompt plus max new tokens, which is also what the KV budget reserves
for it), so its layers can hold buffers of that size from the first position: the prefill writes into them through
`update` like any transformers layer, and a decode step writes its position in place
(csrc/ragged_attention.cpp, prunewatch.engine.batching) and advances the length.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

PREFILL_CHUNK = 128
"""Prompt positions one prefill pass computes at most: on the batcher's stepper (one packed pass per chunk, with the
due decode rows riding along; prunewatch.engine.batching), for a request decoding eagerly in process on the CPU, and
for a prompt's head (prunewatch.engine.prefix_cache). The same chunks run the same matrix products, so a prompt's
keys, values and logits have the same bits whichever of these paths prefilled it, and a request decodes the same
tokens in process as through `serve`, however long its prompt. (A compiled or GPU decode in process prefills the
prompt in one pass: its tokens are not held to the served ones.)"""


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of the first `length` positions of buffers of `capacity`.

    `keys` and `values` read as transformers expects ((batch, kv_heads, length, head_dim)); they are written only
    through `update` (or a decode step's operator and `advance`). Past `capacity` the buffers double, copied once,
    so an underestimate costs a copy, never a failure."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a reserved cache layer needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.length = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        super().__init__()

    @property  # a view of the buffer, not an attribute
    def keys(self) -> torch.Tensor | None:
        return None if self.key_buffer is None else self.key_buffer[:, :, :self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._drop_on_none(value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buffer is None else self.value_buffer[:, :, :self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._drop_on_none(value)

    def _drop_on_none(self, value: torch.Tensor | None) -> None:
        """transformers sets keys and values to None to reset a layer; anything else would bypass the buffer."""
        if value is not None:
            raise TypeError("a ReservedLayer's keys and values are written through update(), not assigned")
        self.key_buffer = self.value_buffer = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = self._buffer(key_states, self.capacity)
        self.value_buffer = self._buffer(value_states, self.capacity)
        self.length = 0
        self.is_initialized = True

    @staticmethod
    def _buffer(states: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = states.shape
        return torch.empty((batch, heads, capacity, dim), dtype=states.dtype, device=states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the filled ones and return every filled position's keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        assert self.key_buffer is not None and self.value_buffer is not None
        self.key_buffer[:, :, self.length:end].copy_(key_states)
        self.value_buffer[:, :, self.length:end].copy_(value_states)
        self.length = end
        return self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]

    def reserve(self, positions: int) -> None:
        """Make room for `positions` positions in all (doubling the buffers when they are short)."""
        if positions <= self.capacity or self.key_buffer is None or self.value_buffer is None:
            self.capacity = max(self.capacity, positions)
            return
        capacity = max(positions, 2 * self.capacity)
        for name in ("key_buffer", "value_buffer"):
            old: torch.Tensor = getattr(self, name)
            grown = self._buffer(old, capacity)
            grown[:, :, :self.length].copy_(old[:, :, :self.length])
            setattr(self, name, grown)
        self.capacity = capacity

    def advance(self) -> None:
        """Count the position a decode step's operator wrote in place (at `length`)."""
        self.length += 1

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a reserved cache holds one request")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a reserved cache holds one request")


def reserved_cache(config: Any, capacity: int) -> DynamicCache:
    """transformers' DynamicCache for `config`, its plain layers replaced by ReservedLayer(capacity). Layers of any
    other kind (sliding windows, linear attention) stay as transformers makes them."""
    cache = DynamicCache(config=config)
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
