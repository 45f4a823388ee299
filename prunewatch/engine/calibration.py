"""Calibration: how much each decoder block and attention head changes the residual stream, per domain.

Block influence = mean over tokens of 1 - cos(h_in, h_out) for the block's input and output
hidden states, measured on the dense model. Blocks with low influence are the ones a request may
bypass. Head influence = mean over tokens of ||W_o[:, head] . a_head|| / ||h_in||: the size of
one head's write into the residual stream relative to the stream it writes into (prunewatch.engine.heads
gates the smallest). A domain centroid (mean unit-normalised token embedding of the domain's texts) lets the
engine match a prompt to the domains it was calibrated on before any block runs.

A calibration is an artifact tied to one model's weights fingerprint; the engine refuses one made
for another model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from prunewatch.engine.errors import CalibrationMismatchError
from prunewatch.engine.execution import (
    ExecutionLedger,
    ExecutionPlan,
    InstrumentedModel,
    executing,
)
from prunewatch.engine.heads import HeadGatedProjection, HeadGating
from prunewatch.engine.paths import write_text_atomically
from prunewatch.engine.sparse.targets import is_conv1d

CALIBRATION_FORMAT_VERSION = 2


@dataclass(frozen=True)
class DomainProfile:
    """Calibrated statistics of one domain."""

    influence: list[float]  # per block: mean 1 - cos(in, out)
    centroid: list[float]  # unit vector: mean normalised input embedding of the domain's tokens
    texts: int  # how many texts were measured
    tokens: int  # how many tokens were measured
    head_influence: list[list[float]] = field(default_factory=list)  # per block, per query head; [] without head gating


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
        write_text_atomically(path, json.dumps(asdict(self), indent=1) + "\n")  # a crash never leaves half of it

    @classmethod
    def load(cls, path: Path) -> Calibration:
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


def _head_writes(x: torch.Tensor, projection: HeadGatedProjection, heads: int, head_dim: int) -> torch.Tensor:
    """Norm of each head's write into the residual stream: (B, T, H) from o_proj's input (B, T, H*d)."""
    linear = projection.dense_layer()
    weight = linear.weight.float()
    per_head = x.float().reshape(*x.shape[:-1], heads, head_dim)  # (B, T, H, d)
    if is_conv1d(linear):  # (in, out)
        w = weight.reshape(heads, head_dim, -1)  # (H, d, out)
        writes = torch.einsum("bthd,hdo->btho", per_head, w)
    else:  # (out, in)
        w = weight.reshape(weight.shape[0], heads, head_dim)  # (out, H, d)
        writes = torch.einsum("bthd,ohd->btho", per_head, w)
    return torch.linalg.vector_norm(writes, dim=-1)


@torch.no_grad()
def measure_block_influence(instrumented: InstrumentedModel, input_ids: torch.Tensor,
                            heads: HeadGating | None = None) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """One dense forward: per-block sums over tokens of 1 - cos(in, out), the token count, and
    (with `heads`) per-block, per-head sums over tokens of the head's write / ||h_in||."""
    sums = torch.zeros(instrumented.num_layers, dtype=torch.float64)
    head_sums = None if heads is None else torch.zeros(instrumented.num_layers, heads.num_heads, dtype=torch.float64)
    inputs_norm: dict[int, torch.Tensor] = {}
    handles = []

    def make_hook(index: int):
        def hook(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(h_in.float(), h_out.float(), dim=-1)  # (B, T)
            sums[index] += (1.0 - cos).sum().double().cpu()

        return hook

    def make_input_hook(index: int):
        def hook(module, args, kwargs):
            h_in = args[0] if args else kwargs["hidden_states"]
            inputs_norm[index] = torch.linalg.vector_norm(h_in.float(), dim=-1).clamp_min(1e-6)  # (B, T)

        return hook

    def make_head_hook(index: int, projection):
        def hook(module, args):
            writes = _head_writes(args[0], projection, heads.shape.heads, heads.shape.head_dim)  # (B, T, H)
            relative = writes / inputs_norm[index].unsqueeze(-1)
            head_sums[index] += relative.reshape(-1, heads.shape.heads).sum(dim=0).double().cpu()

        return hook

    for block in instrumented.blocks:
        handles.append(block.register_forward_hook(make_hook(block.index), with_kwargs=True))
        if heads is not None:
            handles.append(block.register_forward_pre_hook(make_input_hook(block.index), with_kwargs=True))
            for projection in heads.projections[block.index]:
                if projection.role == "input":
                    handles.append(projection.register_forward_pre_hook(make_head_hook(block.index, projection)))
    try:
        with executing(ExecutionPlan(), ExecutionLedger()):
            instrumented.model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return sums, int(input_ids.numel()), head_sums


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
    heads: HeadGating | None = None,
) -> Calibration:
    """Measure every domain's block influence, centroid and (with `heads`) head influence on the
    dense model."""
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
        head_sums = None if heads is None else torch.zeros(instrumented.num_layers, heads.num_heads, dtype=torch.float64)
        tokens = 0
        directions = []
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :max_tokens_per_text]
            ids = ids.to(device)
            if ids.numel() == 0:
                continue
            block_sums, n, block_head_sums = measure_block_influence(instrumented, ids, heads)
            sums += block_sums
            if head_sums is not None:
                head_sums += block_head_sums
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
            head_influence=[] if head_sums is None else [
                [float(f"{float(v):.6g}") for v in row] for row in (head_sums / tokens)],
        )
    return Calibration(
        model_name=model_name,
        model_fingerprint=model_fingerprint,
        num_layers=instrumented.num_layers,
        domains=domains,
        corpus_digest=corpus_digest,
    )
