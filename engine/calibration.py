"""Calibration: how much each decoder block changes the residual stream, per domain.

Block influence = mean over tokens of 1 - cos(h_in, h_out) for the block's input and output
hidden states, measured on the dense model. Blocks with low influence are the ones a request may
bypass. A domain centroid (mean unit-normalised token embedding of the domain's texts) lets the
engine match a prompt to the domains it was calibrated on before any block runs.

A calibration is an artifact tied to one model's weights fingerprint; the engine refuses one made
for another model.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from engine.errors import CalibrationMismatchError
from engine.execution import ExecutionLedger, ExecutionPlan, InstrumentedModel, executing

CALIBRATION_FORMAT_VERSION = 1


@dataclass(frozen=True)
class DomainProfile:
    """Calibrated statistics of one domain."""

    influence: list[float]  # per block: mean 1 - cos(in, out)
    centroid: list[float]  # unit vector: mean normalised input embedding of the domain's tokens
    texts: int  # how many texts were measured
    tokens: int  # how many tokens were measured


@dataclass(frozen=True)
class Calibration:
    """Per-domain block influence for one model, saved as JSON."""

    model_name: str
    model_fingerprint: str
    num_layers: int
    domains: dict[str, DomainProfile]
    corpus_digest: str  # identifies the texts it was measured on (e.g. the probe set's hash)
    created_at: float = field(default_factory=time.time)
    format_version: int = CALIBRATION_FORMAT_VERSION

    def check_model(self, fingerprint: str, num_layers: int) -> None:
        if self.model_fingerprint != fingerprint or self.num_layers != num_layers:
            raise CalibrationMismatchError(
                f"calibration was made for model {self.model_name!r} (fingerprint "
                f"{self.model_fingerprint[:12]}, {self.num_layers} layers), not for this model "
                f"(fingerprint {fingerprint[:12]}, {num_layers} layers); run `prunewatch calibrate`"
            )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.{threading.get_ident()}.tmp")  # writers never collide
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)  # atomic: a crash never leaves half a calibration

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CalibrationMismatchError(f"cannot read calibration {path}: {exc}") from exc
        if raw.get("format_version") != CALIBRATION_FORMAT_VERSION:
            raise CalibrationMismatchError(
                f"calibration {path} has format {raw.get('format_version')}, expected "
                f"{CALIBRATION_FORMAT_VERSION}; recalibrate"
            )
        raw["domains"] = {name: DomainProfile(**profile) for name, profile in raw["domains"].items()}
        return cls(**raw)


def mean_token_direction(embeddings: torch.Tensor) -> torch.Tensor:
    """Mean of unit-normalised token embeddings, renormalised: a cheap, pre-block prompt signature."""
    unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)  # (T, C)
    return torch.nn.functional.normalize(unit.mean(dim=0), dim=0)  # (C,)


@torch.no_grad()
def measure_block_influence(instrumented: InstrumentedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum over tokens of 1 - cos(in, out) per block for one dense forward; returns (sums, tokens)."""
    sums = torch.zeros(instrumented.num_layers, dtype=torch.float64)
    handles = []

    def make_hook(index: int):
        def hook(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(h_in.float(), h_out.float(), dim=-1)  # (B, T)
            sums[index] += (1.0 - cos).sum().double().cpu()

        return hook

    for block in instrumented.blocks:
        handles.append(block.register_forward_hook(make_hook(block.index), with_kwargs=True))
    try:
        with executing(ExecutionPlan(), ExecutionLedger()):
            instrumented.model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return sums, int(input_ids.numel())


def calibrate(
    instrumented: InstrumentedModel,
    tokenizer,
    texts_by_domain: Mapping[str, Sequence[str]],
    *,
    model_name: str,
    model_fingerprint: str,
    corpus_digest: str,
    max_tokens_per_text: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> Calibration:
    """Measure every domain's block influence and centroid on the dense model."""
    if not texts_by_domain or not any(texts_by_domain.values()):
        raise ValueError("calibration needs at least one text in at least one domain")
    model = instrumented.model
    device = next(model.parameters()).device
    embed = model.get_input_embeddings()
    total = sum(len(texts) for texts in texts_by_domain.values())
    done = 0
    domains: dict[str, DomainProfile] = {}
    for domain, texts in sorted(texts_by_domain.items()):
        sums = torch.zeros(instrumented.num_layers, dtype=torch.float64)
        tokens = 0
        directions = []
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :max_tokens_per_text]
            ids = ids.to(device)
            if ids.numel() == 0:
                continue
            block_sums, n = measure_block_influence(instrumented, ids)
            sums += block_sums
            tokens += n
            with torch.no_grad():
                directions.append(mean_token_direction(embed(ids)[0]))
            done += 1
            if progress is not None:
                progress(done, total)
        if tokens == 0:
            continue
        centroid = torch.nn.functional.normalize(torch.stack(directions).mean(dim=0), dim=0)
        domains[domain] = DomainProfile(
            influence=[float(f"{float(v):.6g}") for v in (sums / tokens)],
            centroid=[round(float(v), 6) for v in centroid.cpu()],
            texts=len(directions),
            tokens=tokens,
        )
    return Calibration(
        model_name=model_name,
        model_fingerprint=model_fingerprint,
        num_layers=instrumented.num_layers,
        domains=domains,
        corpus_digest=corpus_digest,
    )
