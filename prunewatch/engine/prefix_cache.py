"""Keys and values of a chat prompt's head (everything before the last user message's text), computed once per plan
and reused by every prompt that starts with the same head.

Why: the chat requests of one application share their start: the template's system block (its own system prompt,
or the model's default one) up to the user's turn; SmolLM2-135M-Instruct's default head is 24 tokens of a typical 40
to 50 token prompt. A prefill on the CPU is compute-bound, and under load each one takes a pass of the batcher's
stepper that the decoding requests' rows share (prunewatch.engine.batching), so its positions set how long their step
takes. A head's keys and values depend only on its tokens,
the weights, what the forward pass skipped and the thread count that ran it. The engine computes heads without
activation sparsity (a prefill multiplies dense whether its inputs are masked or not, so that saves no time; the
default's targets adapt to each prompt, so a head computed under one request's targets would serve no other) and
keys them by the rest of the plan, what shapes the cache (bypassed blocks, gated heads): one computation serves
every later request with the same head and cache shape on the same kind of thread.

Where the head ends is a function of the prompt's tokens alone: right after the last occurrence of the template's
user-turn marker (the tokens it puts between a system prompt and the user's text, found by rendering two system
prompts). So a prompt is always prefilled in two passes split at the same place, its head's keys and values either
copied from the store or computed by the first pass (and stored); the second pass starts after them either way, and a
request decodes the same tokens whether the store held its head or not, and whatever other requests came before.

Which heads are split off: those of at least `prefix_cache_min_tokens` (default 64), and the chat template's own head
(what it renders before the user's text when a request sends no system message: SmolLM2's default system prompt)
at any length. A prefill pays a whole forward pass however few its rows (every weight is read; on the CPU at 2
threads a 24-row pass of SmolLM2-135M costs about two thirds of a 49-row one), so a short head's own pass, on a miss,
costs more than a hit saves: in bench/results/prefix-cache-cpu.json the held-out prompts' one-off system prompts
made their prefills slower split than whole, while behind one 240-token system prompt the prefills ran about 4x
faster as served. The template's own head is the exception: every request without a system message starts with it,
so it misses once per cache shape and thread count, and every later such request skips its positions.

What is not cached: shorter heads, prompts without the marker (raw completions, a model without a chat template), prompts that end
with it, requests that score every prompt position (echo with logprobs needs the head's logits), and models whose
cache holds layers other than transformers' plain ones (sliding windows, linear attention).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from prunewatch.engine.kv_cache import ReservedLayer

logger = logging.getLogger("prunewatch.engine.prefix_cache")


@dataclass(frozen=True)
class PrefixEntry:
    """One computed head: each layer's keys and values, (1, kv_heads, head length, head_dim), or None for a layer
    the plan bypassed (its cache stays empty)."""

    keys: tuple[torch.Tensor | None, ...]
    values: tuple[torch.Tensor | None, ...]

    @property
    def nbytes(self) -> int:
        """Memory its keys and values hold."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


class PrefixCache:
    """At most `max_entries` computed heads (per head, cache shape and thread count) holding at most `max_bytes` of keys
    and values together, least recently used evicted first; thread-safe. `max_entries` 0, `max_bytes` 0, or an empty
    marker, turns it off. A head larger than `max_bytes` alone is computed for its request and not kept.

    Why a byte bound beside the count: an entry's size grows with its head (every layer's keys and values, 45 KiB per
    token on SmolLM2-135M, about 0.5 MiB on a 7B Llama), so a count alone bounds nothing when system prompts are long
    or earlier turns pile up in the head."""

    def __init__(self, marker: Sequence[int], max_entries: int, min_tokens: int = 1,
                 max_bytes: int | None = None, shared_heads: Sequence[Sequence[int]] = ()) -> None:
        if max_entries < 0 or min_tokens < 1 or (max_bytes is not None and max_bytes < 0):
            raise ValueError(f"max_entries and max_bytes must be >= 0 and min_tokens >= 1, got {max_entries}, "
                             f"{max_bytes}, {min_tokens}")
        self.marker = tuple(marker)
        self.max_entries = max_entries
        self.max_bytes = max_bytes  # None: bounded by the count alone
        self.min_tokens = min_tokens  # shorter heads are not split off: their second pass costs more than they save
        # Heads split off at any length: ones most requests start with (the chat template's own), which miss once
        self.shared_heads = frozenset(tuple(head) for head in shared_heads if head)
        self._entries: OrderedDict[Hashable, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def head_length(self, prompt_ids: Sequence[int]) -> int:
        """Positions of `prompt_ids` up to and including the last user-turn marker, when that head has at least
        `min_tokens` (or is one of `shared_heads`) and some token follows it; else 0 (the prompt is prefilled in one
        piece, as without a cache)."""
        marker, width = self.marker, len(self.marker)
        if self.max_entries == 0 or self.max_bytes == 0 or width == 0:
            return 0
        for end in range(len(prompt_ids) - 1, width - 1, -1):  # the head must leave at least one token after it
            if prompt_ids[end - 1] == marker[-1] and tuple(prompt_ids[end - width:end]) == marker:
                return end if end >= self.min_tokens or tuple(prompt_ids[:end]) in self.shared_heads else 0
        return 0

    @staticmethod
    def supports(cache: Any) -> bool:
        """Whether every layer of `cache` is a plain key/value layer this store can copy into and out of."""
        layers = getattr(cache, "layers", None) or ()
        return bool(layers) and all(type(layer) in (ReservedLayer, DynamicLayer) for layer in layers)

    def lookup(self, key: Hashable) -> PrefixEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def store(self, key: Hashable, cache: Any, length: int) -> None:
        """Keep a copy of a head's keys and values from `cache`, each of whose layers holds exactly the head's
        `length` positions, or none (a bypassed block)."""
        if self.max_entries == 0:
            return
        layers = cache.layers
        filled = [layer.get_seq_length() for layer in layers]
        if any(positions not in (0, length) for positions in filled) or not any(filled):
            raise ValueError(f"the cache holds {filled} positions per layer, not the head's {length} (or 0 where "
                             f"a block was bypassed)")
        entry = PrefixEntry(tuple(layer.keys.clone() if positions else None for layer, positions in zip(layers, filled)),
                            tuple(layer.values.clone() if positions else None
                                  for layer, positions in zip(layers, filled)))
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            logger.debug("a %d-position head (%d bytes) is over the prefix cache's %d bytes: not kept", length,
                         entry.nbytes, self.max_bytes)
            return
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self._bytes -= replaced.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while len(self._entries) > self.max_entries or (self.max_bytes is not None and self._bytes > self.max_bytes):
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    @staticmethod
    def fill(cache: Any, entry: PrefixEntry) -> None:
        """Write the head's keys and values into an empty `cache` (its first positions)."""
        for layer, keys, values in zip(cache.layers, entry.keys, entry.values, strict=True):
            if layer.get_seq_length() != 0:
                raise ValueError("the prefix goes into an empty cache")
            if keys is not None and values is not None:
                layer.update(keys, values)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Memory the kept heads' keys and values hold."""
        return self._bytes

    def clear(self) -> None:
        """Forget every head (the weights or what a plan's thresholds mean changed)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
