"""Attention-head gating: heads a request does not need are not computed.

A gated query head h of block l costs nothing in that block's projections:
- q_proj computes only the output rows of kept heads (the gated heads' rows stay zero);
- k_proj / v_proj compute only the key/value heads some kept query head reads (grouped-query
  attention shares a key/value head among `heads / kv_heads` query heads);
- o_proj reads only the input columns of kept heads, so the gated heads add nothing to the
  residual stream, exactly as if their attention output were zero.
Fused projections (Phi-3's qkv_proj, GPT-2's c_attn, GPT-NeoX's and Falcon's query_key_value, whose
heads are grouped per key/value head) are cut the same way, head by head.

The gated set is part of the request's ExecutionPlan, fixed before the prefill, so a gated key /
value head writes zeros into the KV cache at every step and no kept head ever reads them: prefill
and decode see the same attention.

Each projection is wrapped (`HeadGatedProjection`), never patched: without a plan, or when the plan
gates nothing in its block, the wrapped layer runs untouched and stays counted as the dense work
its block counted. When heads are gated the wrapper multiplies slices of the layer's own weight
(views, no copy) and takes the work of the slices it did not compute off the ledger with
`record_skipped_work`. When activation sparsity is installed
under the wrapper, o_proj hands the zeroed columns to the sparse kernel (which skips zero inputs)
and q/k/v let the kernel compute every output column: the ledger then counts that full work, so
the ratio never claims a saving that did not happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from prunewatch.engine.execution import InstrumentedModel, current_execution, per_segment, record_skipped_work
from prunewatch.engine.sparse.module import SparseLinear
from prunewatch.engine.sparse.targets import in_out, is_conv1d

Role = Literal["output", "input"]


@dataclass(frozen=True)
class Segment:
    """One kind of head inside a projection's output (or o_proj's input) features, and where each sits."""

    kind: Literal["query", "kv"]  # query heads, or key/value heads shared by a group of query heads
    starts: tuple[int, ...]  # first feature of each head of that kind (head_dim features from there)

    @classmethod
    def packed(cls, kind: Literal["query", "kv"], offset: int, count: int, head_dim: int) -> Segment:
        """`count` heads back to back from feature `offset` (Llama's q/k/v, Phi-3's [q | k | v])."""
        return cls(kind, tuple(offset + unit * head_dim for unit in range(count)))


@dataclass(frozen=True)
class AttentionShape:
    """How many heads a block's attention has and how they map onto each other."""

    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def kept_kv_heads(self, gated: frozenset[int]) -> list[int]:
        """Key/value heads some kept query head still reads."""
        return [k for k in range(self.kv_heads) if any(h not in gated for h in range(k * self.group, (k + 1) * self.group))]

    def kept_ranges(self, segments: tuple[Segment, ...], gated: frozenset[int]) -> tuple[tuple[int, int], ...]:
        """Feature ranges [start, end) still computed when `gated` query heads are off (sorted, merged runs)."""
        starts: list[int] = []
        for segment in segments:
            if segment.kind == "query":
                kept = [h for h in range(self.heads) if h not in gated]
            else:
                kept = self.kept_kv_heads(gated)
            starts.extend(segment.starts[unit] for unit in kept)
        ranges: list[tuple[int, int]] = []
        for start in sorted(starts):
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + self.head_dim)
            else:
                ranges.append((start, start + self.head_dim))
        return tuple(ranges)

    def grouped_qkv(self) -> tuple[Segment, ...]:
        """A fused projection grouped per key/value head: [q_0 .. q_{g-1} k v] for each of them.

        GPT-NeoX and Falcon's query_key_value (Falcon-7B's multi-query [q_0 .. q_{n-1} k v] is one group,
        GPT-NeoX's [q k v] per head is n groups of one, Falcon-40B's grouped layout everything between).
        """
        width = (self.group + 2) * self.head_dim  # one group's features
        query = tuple((h // self.group) * width + (h % self.group) * self.head_dim for h in range(self.heads))
        key = tuple(k * width + self.group * self.head_dim for k in range(self.kv_heads))
        value = tuple(start + self.head_dim for start in key)
        return Segment("query", query), Segment("kv", key), Segment("kv", value)


class HeadGatedProjection(nn.Module):
    """An attention projection that skips the features of the heads the active plan gates."""

    def __init__(self, inner: nn.Module, layer: int, role: Role, shape: AttentionShape,
                 segments: tuple[Segment, ...]) -> None:
        super().__init__()
        self.inner = inner
        self.layer = layer
        self.role = role
        self.shape = shape
        self.segments = segments
        self._ranges: dict[frozenset[int], tuple[tuple[int, int], ...]] = {}
        self._masks: dict[tuple[frozenset[int], int, torch.dtype, torch.device], torch.Tensor] = {}

    def __getattr__(self, name: str):
        # attention code may read `weight`, `bias` or `out_features` off its projections.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, role={self.role}, heads={self.shape.heads}, kv_heads={self.shape.kv_heads}"

    def kept(self, gated: frozenset[int]) -> tuple[tuple[int, int], ...]:
        ranges = self._ranges.get(gated)
        if ranges is None:
            ranges = self._ranges.setdefault(gated, self.shape.kept_ranges(self.segments, gated))
        return ranges

    def dense_layer(self) -> nn.Module:
        """The plain linear (or Conv1D) this projection computes, under any activation-sparsity wrapper."""
        return self.inner.linear if isinstance(self.inner, SparseLinear) else self.inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # compiled decode steps run plans that gate no head
            return self.inner(x)
        packed = per_segment(x, self.forward)  # a packed pass: each part's skipped work in its own ledger
        if packed is not None:
            return packed
        execution = current_execution()
        if execution is None:
            return self.inner(x)
        plan = execution[0]
        gated = plan.heads_gated_in(self.layer)
        if not gated:
            return self.inner(x)
        ranges = self.kept(gated)
        # With activation sparsity on this layer the kernel does the work (and counts it).
        sparse = isinstance(self.inner, SparseLinear) and self.inner.target_under(plan) > 0.0
        if self.role == "input":
            return self._input_gated(x, gated, ranges, sparse)
        return self._output_gated(x, gated, ranges, sparse)

    def _mask(self, gated: frozenset[int], ranges: tuple[tuple[int, int], ...], like: torch.Tensor) -> torch.Tensor:
        """1 on kept features, 0 on gated ones; built once per gated set, dtype and device."""
        key = (gated, like.shape[-1], like.dtype, like.device)
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.zeros(like.shape[-1], dtype=like.dtype, device=like.device)
            for start, end in ranges:
                mask[start:end] = 1
            mask = self._masks.setdefault(key, mask)
        return mask

    def _weight(self) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """(weight, bias, stored_in_by_out) of the dense layer: Conv1D stores (in, out)."""
        linear = self.dense_layer()
        return linear.weight, getattr(linear, "bias", None), is_conv1d(linear)

    def _output_gated(self, x: torch.Tensor, gated: frozenset[int], ranges: tuple[tuple[int, int], ...],
                      sparse: bool) -> torch.Tensor:
        if sparse:
            out = self.inner(x)  # the kernel computes every column and counts it so
            return out * self._mask(gated, ranges, out)
        weight, bias, conv1d = self._weight()
        out_features = weight.shape[1] if conv1d else weight.shape[0]
        in_features = x.shape[-1]
        out = x.new_zeros(*x.shape[:-1], out_features)
        kept = 0
        for start, end in ranges:
            rows = weight[:, start:end].t() if conv1d else weight[start:end]
            out[..., start:end] = F.linear(x, rows, None if bias is None else bias[start:end])
            kept += end - start
        self._record(x, in_features * (out_features - kept), weight.element_size())
        return out

    def _input_gated(self, x: torch.Tensor, gated: frozenset[int], ranges: tuple[tuple[int, int], ...],
                      sparse: bool) -> torch.Tensor:
        if sparse:
            return self.inner(x * self._mask(gated, ranges, x))  # the kernel never reads zero inputs' rows
        weight, bias, conv1d = self._weight()
        out_features = weight.shape[1] if conv1d else weight.shape[0]
        in_features = x.shape[-1]
        out = None
        kept = 0
        for start, end in ranges:
            cols = weight[start:end].t() if conv1d else weight[:, start:end]
            part = F.linear(x[..., start:end], cols)
            out = part if out is None else out.add_(part)
            kept += end - start
        if out is None:
            out = x.new_zeros(*x.shape[:-1], out_features)
        if bias is not None:
            out = out + bias
        self._record(x, (in_features - kept) * out_features, weight.element_size())
        return out

    @staticmethod
    def _record(x: torch.Tensor, skipped_entries: int, element_size: int) -> None:
        """Take the weight entries this call did not multiply off its block's dense count."""
        rows = x.numel() // x.shape[-1]
        record_skipped_work(2 * skipped_entries * rows, skipped_entries * element_size)


@dataclass(frozen=True)
class HeadGating:
    """The gated projections of one model, per block, and the attention shape they share."""

    shape: AttentionShape
    projections: dict[int, list[HeadGatedProjection]]  # block index -> its wrapped projections

    @property
    def num_heads(self) -> int:
        return self.shape.heads


def attention_shape(config) -> AttentionShape | None:
    """Heads, key/value heads and head size from a transformers config; None when they do not fit."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not heads or not hidden:
        return None
    if getattr(config, "new_decoder_architecture", False):  # Falcon-40B style: grouped key/value heads
        kv_heads = getattr(config, "num_kv_heads", None) or heads
    elif getattr(config, "multi_query", False):  # Falcon-7B style: one key/value head for all queries
        kv_heads = 1
    else:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if heads % kv_heads:
        return None
    return AttentionShape(int(heads), int(kv_heads), int(head_dim))


def _features(projection: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of the linear (or Conv1D) under any head-gating or sparsity wrapper."""
    if isinstance(projection, HeadGatedProjection):
        projection = projection.dense_layer()
    elif isinstance(projection, SparseLinear):
        projection = projection.linear
    if isinstance(projection, nn.Linear) or is_conv1d(projection):
        return in_out(projection)
    return None


def _layout(attention: nn.Module, shape: AttentionShape) -> dict[str, tuple[Role, tuple[Segment, ...]]] | None:
    """Projection attribute -> (role, segments) for the attention modules transformers ships; None
    when the names are unknown or a projection's width does not match the heads it should hold."""
    q_width = shape.heads * shape.head_dim
    kv_width = shape.kv_heads * shape.head_dim
    query = (Segment.packed("query", 0, shape.heads, shape.head_dim),)
    kv = (Segment.packed("kv", 0, shape.kv_heads, shape.head_dim),)
    fused = (query[0], Segment.packed("kv", q_width, shape.kv_heads, shape.head_dim),
             Segment.packed("kv", q_width + kv_width, shape.kv_heads, shape.head_dim))
    names = {name for name, _ in attention.named_children()}
    layout: dict[str, tuple[Role, tuple[Segment, ...]]] | None = None
    if {"q_proj", "k_proj", "v_proj"} <= names and names & {"o_proj", "out_proj"}:
        # Llama, Qwen2, Mistral, Gemma, StableLM (o_proj); OPT (out_proj)
        out = "o_proj" if "o_proj" in names else "out_proj"
        layout = {"q_proj": ("output", query), "k_proj": ("output", kv), "v_proj": ("output", kv),
                  out: ("input", query)}
    elif {"qkv_proj", "o_proj"} <= names:  # Phi-3: [q | k | v]
        layout = {"qkv_proj": ("output", fused), "o_proj": ("input", query)}
    elif {"c_attn", "c_proj"} <= names:  # GPT-2: Conv1D [q | k | v], kv_heads == heads
        layout = {"c_attn": ("output", fused), "c_proj": ("input", query)}
    elif {"query_key_value", "dense"} <= names:  # GPT-NeoX, Falcon: grouped per key/value head
        layout = {"query_key_value": ("output", shape.grouped_qkv()), "dense": ("input", query)}
    if layout is None:
        return None
    for name, (role, segments) in layout.items():
        features = _features(getattr(attention, name))
        width = sum(len(segment.starts) for segment in segments) * shape.head_dim
        if features is None or features[1 if role == "output" else 0] != width:
            return None
    return layout


def _attention_of(block: nn.Module) -> nn.Module | None:
    for name in ("self_attn", "attn", "attention", "self_attention"):
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def install_head_gating(instrumented: InstrumentedModel) -> HeadGating | None:
    """Wrap every block's attention projections; None when the architecture's layout is unknown.

    Idempotent: a model whose projections are already wrapped is returned as it is.
    """
    shape = attention_shape(instrumented.model.config)
    if shape is None:
        return None
    layouts = {}
    for block in instrumented.blocks:  # every block is checked before any is wrapped
        attention = _attention_of(block.block)
        layout = _layout(attention, shape) if attention is not None else None
        if layout is None:
            return None
        layouts[block.index] = (attention, layout)
    projections: dict[int, list[HeadGatedProjection]] = {}
    for index, (attention, layout) in layouts.items():
        wrapped = []
        for name, (role, segments) in layout.items():
            current = getattr(attention, name)
            if not isinstance(current, HeadGatedProjection):
                current = HeadGatedProjection(current, index, role, shape, segments)
                setattr(attention, name, current)
            wrapped.append(current)
        projections[index] = wrapped
    return HeadGating(shape=shape, projections=projections)
