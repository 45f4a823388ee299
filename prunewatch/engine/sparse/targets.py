"""Which linear layers of a decoder get activation sparsity, and facts about their weights.

Targets are found by name inside each decoder block: the attention and MLP projections of the
Llama family (q/k/v/o, gate/up/down, also Qwen2, Mistral, Gemma, StableLM), Phi-3's fused qkv_proj
and gate_up_proj, GPT-2's Conv1D c_attn / c_proj / c_fc, GPT-NeoX's and Falcon's query_key_value /
dense / dense_h_to_4h / dense_4h_to_h, and OPT's q/k/v / out_proj / fc1 / fc2. Every default name
maps to one projection family (`projection_family`). The output head is never a target: it has its
own wrapper (prunewatch.engine.sparse.output_head).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from prunewatch.engine.errors import UnsupportedArchitectureError
from prunewatch.engine.execution import InstrumentedModel

DEFAULT_PROJECTIONS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # Llama family
    "qkv_proj", "gate_up_proj",  # Phi-3
    "c_attn", "c_proj", "c_fc",  # GPT-2 (Conv1D)
    "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",  # GPT-NeoX, Falcon
    "out_proj", "fc1", "fc2",  # OPT (with q_proj, k_proj, v_proj)
)


PROJECTION_FAMILIES: tuple[str, ...] = ("attn_in", "attn_out", "mlp_in", "mlp_out")
_FAMILY_OF = {
    "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in", "c_attn": "attn_in",
    "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "c_fc": "mlp_in",
    "down_proj": "mlp_out",
    "query_key_value": "attn_in", "out_proj": "attn_out", "dense_h_to_4h": "mlp_in", "fc1": "mlp_in",
    "dense_4h_to_h": "mlp_out", "fc2": "mlp_out",
}


def projection_family(name: str) -> str | None:
    """Which input a projection reads: attention input, attention output, MLP input or MLP output.

    `name` is the path inside the decoder block (e.g. "self_attn.o_proj", GPT-2's "attn.c_proj").
    The four families differ most in how much sparsity they tolerate, so allocation is per family.
    None for a name no family is known for.
    """
    parts = name.replace(".inner", "").split(".")
    leaf = parts[-1]
    in_attention = any("attn" in p or "attention" in p for p in parts[:-1])
    if leaf == "c_proj":  # GPT-2 names both output projections c_proj; the parent tells them apart
        return "attn_out" if in_attention else "mlp_out"
    if leaf == "dense":  # GPT-NeoX's attention.dense, Falcon's self_attention.dense; too generic elsewhere
        return "attn_out" if in_attention else None
    return _FAMILY_OF.get(leaf)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def in_out(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    n_in, n_out = module.weight.shape
    return int(n_in), int(n_out)


def weight_transposed(module: nn.Module) -> torch.Tensor:
    """W^T as an (in, out) tensor; Conv1D already stores it so, an nn.Linear needs a transpose."""
    if is_conv1d(module):
        return module.weight.detach()
    return module.weight.detach().t()


def score_scale(module: nn.Module, score: str) -> torch.Tensor:
    """Per input channel factor of the score: ones for magnitude, ||W[:, i]||_2 for WINA (float32, CPU)."""
    n_in, _ = in_out(module)
    if score == "magnitude":
        return torch.ones(n_in, dtype=torch.float32)
    if score == "wina":
        norms = torch.linalg.vector_norm(weight_transposed(module).float(), dim=1)  # (in,)
        return norms.cpu().contiguous()
    raise ValueError(f"score must be 'magnitude' or 'wina', got {score!r}")


# Names too generic to mean one projection everywhere: a target only where projection_family places them.
_AMBIGUOUS = frozenset({"dense"})


def _is_target(name: str, module: nn.Module, projections: Sequence[str]) -> bool:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        return False
    matched = [part for part in name.replace(".inner", "").split(".") if part in projections]
    if not matched:
        return False
    return any(part not in _AMBIGUOUS for part in matched) or projection_family(name) is not None


def layer_key(layer: int, name: str) -> str:
    """How a (decoder block, projection path) pair is named in calibrations, e.g. '3:mlp.down_proj'."""
    return f"{layer}:{name}"


class LinearWrapper(nn.Module):
    """A module that computes a wrapped linear layer itself (prunewatch.engine.sparse.module.SparseLinear).

    Declared here, where targets are found, so that finding them needs no import of the wrapper's
    module (which imports this one): a wrapper is reported under the key of the layer it wraps.
    """

    linear: nn.Module
    kernel_threads: int

    def __getattr__(self, name: str):
        # model code reads attributes such as `weight` or `in_features` off the layers it calls.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("linear"), name)

    def init_compiled_call(self) -> None:
        """No compiled decode step counts this wrapper's kernel calls until `attach_counter`."""
        self._compiled_stats: torch.Tensor | None = None
        self._compiled_controls: tuple[torch.Tensor, torch.Tensor] | None = None
        self._compiled_slot = 0

    def attach_counter(self, stats: torch.Tensor, thresholds: torch.Tensor, keeps: torch.Tensor, slot: int) -> None:
        """What the wrapper's kernel call reads inside a compiled decode step (prunewatch.engine.compiled_decode): its
        threshold thresholds[slot] and top-k size keeps[slot] in force (tensors, so a new request's values
        need no new graph), and where it counts: stats[slot] = (rows of W^T read, kept entries, calls).
        The three tensors are the step's, shared by every call site."""
        from prunewatch.engine.sparse.kernel import counted_op

        self._compiled_stats, self._compiled_controls, self._compiled_slot = stats, (thresholds, keeps), slot
        self._counted_op = counted_op()  # resolved here: the traced forward must not take the build lock

    @property
    def counting(self) -> bool:
        """Whether a compiled decode step counts this wrapper's kernel calls (a counter is attached)."""
        return self._compiled_stats is not None

    def counted_call(self, flat: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
                     scale: torch.Tensor, weight_scale: torch.Tensor | None = None,
                     by_output: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel on (rows, in) inputs at the threshold and top-k in force, counted in the attached row;
        weight_scale: the scales of quantized weight_t (None for floating-point weights); by_output: int4 weights
        laid out by output, which a dense call (no threshold, no top-k) multiplies as the eager layer does."""
        thresholds, keeps = self._compiled_controls
        return self._counted_op(flat, weight_t, bias, scale, thresholds, keeps, self.kernel_threads,
                                self._compiled_stats, self._compiled_slot, weight_scale, by_output)


def find_sparse_targets(instrumented: InstrumentedModel, projections: Sequence[str] = DEFAULT_PROJECTIONS,
                        ) -> dict[str, tuple[int, nn.Module]]:
    """layer_key -> (block index, linear module) for every target linear of every decoder block.

    When a block already holds a SparseLinear (a LinearWrapper), its inner linear is returned under the same key, so
    calibration and installation see the same names whether sparsity is installed or not. Keys
    leave out the `.inner` of a head-gating wrapper (prunewatch.engine.heads) for the same reason.
    """
    targets: dict[str, tuple[int, nn.Module]] = {}
    for block in instrumented.blocks:
        wrapped = {id(m.linear) for m in block.block.modules() if isinstance(m, LinearWrapper)}
        for name, module in block.block.named_modules():
            key = layer_key(block.index, name.replace(".inner", ""))
            if isinstance(module, LinearWrapper):
                targets[key] = (block.index, module.linear)
            elif id(module) not in wrapped and _is_target(name, module, projections):
                targets[key] = (block.index, module)
    if not targets:
        raise UnsupportedArchitectureError(
            f"no linear layers named {', '.join(projections)} in the decoder blocks of "
            f"{type(instrumented.model).__name__}; activation sparsity cannot be installed")
    return targets
