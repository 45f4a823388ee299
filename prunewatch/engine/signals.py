"""The adaptive threshold: four signals that scale a request's sensitivity before its plan is made.

- semantic density: share of distinct tokens in the prompt. Dense prompts (figures, names, code)
  carry more information per token, so they are pruned less.
- task entropy: normalised entropy of the prompt's softmax match over the calibrated domains. A
  prompt that matches no domain confidently is pruned less.
- inter-layer change rate: blocks whose calibrated influence jumps relative to the previous block
  are transition layers; they are protected (never bypassed) rather than scaled.
- hardware watermark: memory pressure of the host (or GPU). Under pressure the engine sheds more
  work, up to the requested sensitivity x (1 + boost).

Each signal's value and contribution is returned, so DETAILED logs can say why a request was pruned
the way it was. The weights are configuration (engine settings), not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class SignalWeights:
    """How strongly each signal moves the sensitivity; 0 disables a signal."""

    density_weight: float = 0.5  # factor = 1 - w * max(0, density - density_knee) / (1 - density_knee)
    density_knee: float = 0.6  # below this share of distinct tokens a prompt is ordinary prose
    entropy_weight: float = 0.5  # factor = 1 - w * normalised domain entropy
    transition_change_rate: float = 1.5  # |influence_i - influence_i-1| / mean influence above this: protected
    memory_knee: float = 0.85  # memory use share where shedding starts
    memory_boost: float = 0.5  # at 100 % memory use, sensitivity x (1 + boost)


@dataclass(frozen=True)
class Signals:
    semantic_density: float
    density_factor: float
    task_entropy: float
    entropy_factor: float
    memory_pressure: float
    memory_factor: float
    effective_sensitivity: float
    transition_layers: tuple[int, ...]

    def as_dict(self) -> dict[str, float | list[int]]:
        return {
            "semantic_density": round(self.semantic_density, 4), "density_factor": round(self.density_factor, 4),
            "task_entropy": round(self.task_entropy, 4), "entropy_factor": round(self.entropy_factor, 4),
            "memory_pressure": round(self.memory_pressure, 4), "memory_factor": round(self.memory_factor, 4),
            "effective_sensitivity": round(self.effective_sensitivity, 4),
            "transition_layers": list(self.transition_layers),
        }


def semantic_density(prompt_ids: list[int]) -> float:
    return len(set(prompt_ids)) / len(prompt_ids) if prompt_ids else 0.0


def normalised_entropy(weights: list[float]) -> float:
    if len(weights) < 2:
        return 0.0
    entropy = -sum(w * math.log(w) for w in weights if w > 0)
    return entropy / math.log(len(weights))


def memory_pressure(device: torch.device) -> float:
    """Share of memory in use: the GPU's when running on CUDA, else the host's."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return 1.0 - free / total
    return psutil.virtual_memory().percent / 100.0


def transition_layers(influence: list[float], threshold: float) -> tuple[int, ...]:
    """Blocks whose influence changes sharply from the previous block's, relative to the mean."""
    mean = sum(influence) / len(influence) if influence else 0.0
    if mean <= 0:
        return ()
    return tuple(i for i in range(1, len(influence))
                 if abs(influence[i] - influence[i - 1]) / mean > threshold)


def combine(sensitivity: float, prompt_ids: list[int], domain_weights: list[float], influence: list[float],
            pressure: float, weights: SignalWeights) -> Signals:
    """Effective sensitivity = sensitivity x density x entropy x memory factors, clamped to [0, 1]."""
    density = semantic_density(prompt_ids)
    span = max(1e-9, 1.0 - weights.density_knee)
    density_factor = 1.0 - weights.density_weight * max(0.0, density - weights.density_knee) / span
    entropy = normalised_entropy(domain_weights)
    entropy_factor = 1.0 - weights.entropy_weight * entropy
    memory_span = max(1e-9, 1.0 - weights.memory_knee)
    memory_factor = 1.0 + weights.memory_boost * min(1.0, max(0.0, pressure - weights.memory_knee) / memory_span)
    effective = min(1.0, max(0.0, sensitivity * density_factor * entropy_factor * memory_factor))
    return Signals(density, density_factor, entropy, entropy_factor, pressure, memory_factor, effective,
                   transition_layers(influence, weights.transition_change_rate))
