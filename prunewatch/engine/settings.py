"""Engine configuration: typed, ranged, read from arguments or PRUNEWATCH_ENGINE_* variables."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prunewatch.engine.anomaly import AnomalyLimits
from prunewatch.engine.signals import SignalWeights

WeightFormat = Literal["fp32", "int8", "int4"]
"""How the engine holds the weights of the linear layers it computes: fp32, int8 per output channel, or int4 in
groups of 32 input channels (GGUF Q4_1 blocks; the output head stays int8)."""

DEFAULT_ACTIVATION_SPARSITY = 0.6
"""At the default sensitivity 0.5 and typical prompt signals, a mean input sparsity of up to 0.3 spread by
the greedy plan. On SmolLM2-135M-Instruct's 63 evaluation prompts (bench/results/frontier-SmolLM2-135M-Instruct.json,
reference-scored agreement of the served answers, 95% intervals over prompts): greedy at a mean sparsity of 0.3,
decode ratio 0.076, kept 0.977 [0.971, 0.982] where TEAL's uniform thresholds kept 0.946 [0.936, 0.955] at
0.078. With the output-head shortlist (DEFAULT_OUTPUT_HEAD_SPARSITY) the engine default measured decode ratio
0.187 at 0.977 [0.971, 0.982]."""

QUANTIZED_SPARSE_FROM = 0.8
"""The layer sparsity from which int8 and int4 layers read only their active rows. On SmolLM2-135M's four layer
shapes, one token, two threads (`prunewatch bench kernels`, break_even), the sparse kernel caught up with the dense
integer products on no shape by 0.85 sparsity in the committed run (bench/results/weight-kernels-cpu.json), and in
the run before it (77146ba) at 0.83 for int8 on 576 x 1536 and at 0.67 (576 x 1536) and 0.72 (1536 x 576) for
int4, nowhere else by 0.85: weighted by the layers' multiply-adds, at least 0.84 (int8) and 0.73 (int4), counting
a shape not caught up by 0.85 at 0.85. Before the dense products read their weights row by row (the run committed
with 3312c37) they were 0.47-0.79 and 0.61-0.65; the break-evens move by up to 0.1 between runs. Near them a
skipped row saves no time and still costs quality; the default sits between the two formats."""

DEFAULT_OUTPUT_HEAD_SPARSITY = 0.6
"""Output-head input sparsity (prunewatch/engine/sparse/output_head.py) with a 1024-logit exact shortlist: on
SmolLM2-135M-Instruct, alone, it kept reference-scored agreement 1.000 [1.000, 1.000] on the 63 evaluation
prompts and held-out perplexity +0.14%, skipping 0.122 of the decode work, where the head is a fifth of it
(bench/results/frontier-SmolLM2-135M-Instruct.json)."""
OUTPUT_HEAD_FULL_AT = 0.25
"""Effective sensitivity from which the output head runs at its target; below it the target scales down
linearly to 0 at sensitivity 0. The exact shortlist keeps the argmax, so the head does not need the whole
sensitivity range to grade it (a request at the default sensitivity 0.5 has an effective one of ~0.33 on the
canonical probes), while lowering sensitivity (the governor's lever) still backs it off."""


def output_head_target(setting: float, effective_sensitivity: float) -> float:
    """The output head's input sparsity for a request: `setting` from OUTPUT_HEAD_FULL_AT up, linear below."""
    return float(setting) * min(1.0, max(0.0, float(effective_sensitivity)) / OUTPUT_HEAD_FULL_AT)


class LogLevel(str, Enum):
    """How much the engine logs about each request's pruning decisions."""

    NONE = "NONE"  # nothing per request
    SUMMARY = "SUMMARY"  # one line: layers bypassed, heads gated, activation sparsity, ratio
    DETAILED = "DETAILED"  # per layer: influence, threshold, KEEP / BYPASS, heads gated


class EngineSettings(BaseSettings):
    """How the engine loads its model and how hard it prunes by default."""

    model_config = SettingsConfigDict(env_prefix="PRUNEWATCH_ENGINE_", extra="forbid")

    model_dir: Path = Field(description="Local Hugging Face model folder (config.json + weights).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA when present (bf16 there), else the CPU (fp32)."
    )
    sensitivity: float = Field(
        0.5, ge=0.0, le=1.0,
        description="How much of the calibrated skippable influence a request may drop; 0 is dense.",
    )
    layer_blacklist: list[int] = Field(default_factory=list, description="Layers never pruned.")
    log_level: LogLevel = Field(LogLevel.SUMMARY, description="Per-request pruning log detail.")
    influence_budget: float = Field(
        0.0, ge=0.0, le=1.0,
        description=(
            "Layer bypass: at sensitivity 1, the share of the calibrated influence of the blocks that "
            "may be bypassed (protected, blacklisted and transition blocks excluded) that is bypassed; "
            "sensitivity scales it linearly. 0 (the default) bypasses nothing: on SmolLM2-135M-Instruct "
            "0.15 already drops token agreement with the dense model to 0.77 "
            "(bench/results/mechanisms-smollm2-cpu.json)."
        ),
    )
    protect_edge_layers: bool = Field(
        True,
        description=(
            "Never bypass the first and last block: they are the model's transition layers (the "
            "first also anchors the KV cache length that transformers reads from layer 0)."
        ),
    )
    head_gating: bool = Field(
        False,
        description=(
            "Gate attention heads of low calibrated influence (prunewatch/engine/heads.py). Off by default: on "
            "SmolLM2-135M-Instruct a head budget of 0.05 costs ~14% token agreement."),
    )
    head_budget: float = Field(
        0.05, ge=0.0, le=1.0,
        description=(
            "At sensitivity 1, the share of the model's total calibrated head influence that may be "
            "gated in the blocks that run; sensitivity scales it linearly."
        ),
    )
    max_new_tokens: int = Field(64, ge=1, le=8192, description="Default completion length.")
    activation_sparsity: float = Field(
        DEFAULT_ACTIVATION_SPARSITY, ge=0.0, lt=1.0,
        description=(
            "Activation-sparsity target of the linear inputs at effective sensitivity 1 (scaled by it per "
            "request); 0 leaves the sparse kernel out. Compiled kernel on the CPU, Triton on CUDA; "
            "thresholds are calibrated with the blocks. The default, with the greedy allocation, keeps "
            "reference-scored agreement 0.977 [0.971, 0.982] and held-out perplexity within +2% (-0.07%) on "
            "SmolLM2-135M-Instruct at decode ratio 0.076; with the default output-head shortlist the engine "
            "default measured decode ratio 0.187 at 0.977 [0.971, 0.982] "
            "(bench/results/frontier-SmolLM2-135M-Instruct.json, 63 evaluation prompts)."
        ),
    )
    output_head_sparsity: float = Field(
        DEFAULT_OUTPUT_HEAD_SPARSITY, ge=0.0, le=0.9,
        description=(
            "Input sparsity of the output head (LM head) from effective sensitivity 0.25 up (linear below): "
            "approximate logits from the largest entries of its input, then exact logits for the "
            "output_head_candidates highest. 0 runs the head dense. The default kept the dense argmax on every "
            "held-out token of SmolLM2-135M-Instruct (perplexity +0.1% to +0.5%)."),
    )
    quantized_output_head_sparsity: float = Field(
        0.0, ge=0.0, le=0.9,
        description=(
            "output_head_sparsity for int8 and int4 weights (whose head is int8); 0 runs the head dense. Its "
            "shortlist (approximate logits through the sparse kernel, then exact ones for the candidates) was slower "
            "than the int8 head's dense integer product at every sparsity timed, up to 0.9, on SmolLM2-135M's "
            "576 x 49152 head (`prunewatch bench kernels`, `head` in bench/results/weight-kernels-cpu.json)."),
    )
    output_head_candidates: int = Field(
        1024, ge=1, le=1_000_000,
        description="How many of the highest approximate logits the output head recomputes exactly per token.",
    )
    sparsity_family_scale: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Factor on the activation-sparsity target per projection family (attn_in, attn_out, mlp_in, "
            "mlp_out); a family not named keeps factor 1."),
    )
    sparsity_allocation: Literal["uniform", "greedy"] = Field(
        "greedy",
        description=(
            "How a request's activation-sparsity target is spread over layers and projections: 'uniform' "
            "(TEAL's rule) gives each the target; 'greedy' follows the plan calibrated with the thresholds "
            "(prunewatch/engine/sparse/allocation.py), which sparsifies first where the estimated output error grows "
            "least per skipped FLOP, at the same total skipped work. Transition and blacklisted blocks stay dense. "
            "Default 'greedy': at decode ratio 0.08 on SmolLM2-135M-Instruct, reference-scored agreement 0.977 "
            "[0.971, 0.982] against uniform's 0.946 [0.936, 0.955] "
            "(bench/results/frontier-SmolLM2-135M-Instruct.json)."),
    )
    sparsity_score: Literal["magnitude", "wina"] = Field(
        "magnitude",
        description="Input score thresholded: |x_i| (TEAL) or |x_i| * ||W[:, i]|| (WINA).",
    )
    fallback_on_anomaly: bool = Field(
        True, description="Run dense (and say why) on anomalous input or a prompt outside every domain."
    )
    anomaly_limits: AnomalyLimits = Field(default_factory=AnomalyLimits, description="Fallback thresholds.")
    signal_weights: SignalWeights = Field(default_factory=SignalWeights, description="Adaptive-threshold weights.")
    ratio_red_line: float = Field(
        0.44, ge=0.0, le=1.0,
        description=("Pruning ratio above which a request is flagged as a quality risk: a configured default, not "
                     "a measurement; token agreement (quality=True) is the measured quality figure."),
    )
    agreement_floor: float = Field(
        0.90, ge=0.0, le=1.0, description="Token agreement with the dense model below which a request is flagged."
    )
    compile_decode: bool = Field(
        False,
        description=(
            "Run decode steps as one torch.compile graph on the CPU (prunewatch/engine/compiled_decode.py): no per-operator "
            "Python overhead and the same counted work. Dense plans decode the same tokens as eager; with activation "
            "sparsity fused arithmetic can move an activation across its threshold and flip a near-tie, so tokens may "
            "differ: the committed benchmark's pruned compiled run on SmolLM2-135M-Instruct agreed with eager on 22 "
            "of 32 tokens (agreement_with_eager 0.69, bench/results/speed-cpu.json); in bench/results/precision-cpu.json "
            "the default plan's compiled run gave eager's tokens on a share of 1.00 with fp32, int8 and int4 weights "
            "(dense plans: 1.00 at every precision; earlier runs had 0.77 with fp32, and 1.00, 0.94 and 0.30: how often "
            "a near-tie flips depends on the host's arithmetic). Dense plans, plans with activation "
            "sparsity and plans with the output-head shortlist compile; bypass, head gating and the shared policy decode "
            "eagerly. Each graph compiles on its first step (about a minute for SmolLM2-135M on two cores; "
            "`prunewatch serve` warms them up before it listens). Needs a C++ compiler, as the sparse kernel does."),
    )
    weights: WeightFormat = Field(
        "fp32",
        description=(
            "How the linear layers' weights are held and read: 'fp32' as loaded, or 'int8' with one scale per "
            "output channel (prunewatch/engine/sparse/quantize.py): a quarter of the bytes per step, on the CPU "
            "only; or 'int4' in groups of 32 input channels with an fp16 scale and minimum each (GGUF's Q4_1 block: "
            "a model shipped as Q4_1 keeps its exact weights), the output head int8, and a layer whose sizes are "
            "not multiples of 32 int8 too. Sparse decode calls read the active quantized rows through the sparse "
            "kernel (from quantized_sparse_from up); dense ones round their inputs to int16 per group of 32 and "
            "multiply a copy of the weights laid out by output as integers. "
            "The quality of each against fp32 dense is measured by `prunewatch bench precision`."),
    )
    quantized_sparse_from: float = Field(
        QUANTIZED_SPARSE_FROM, ge=0.0, le=1.0,
        description=(
            "With int8 or int4 weights, the sparsity a layer's share of a request's target must reach before the "
            "layer reads only its active rows; below it the layer multiplies dense (its integer product of the "
            "weights laid out by output) and counts as dense work, so the pruning ratio reports what was really "
            "skipped. The sparse kernel widens each weight it reads to fp32, the dense product multiplies them as "
            "integers, so skipping rows only saves time once most are skipped: `prunewatch bench kernels` measures "
            "where the two meet per layer shape (break_even in bench/results/weight-kernels-cpu.json). "
            "1 keeps quantized layers dense; 0 prunes them at any target. fp32 weights prune at any target."),
    )
    threads: int | None = Field(
        None, ge=1, le=1024,
        description=(
            "CPU threads of the forward passes: torch's intra-op threads on the long-lived thread they run on "
            "(prunewatch/engine/threads.py: a server's batcher stepper, or with one worker its generation thread), set "
            "when that thread starts. Default: the cores torch uses. Generations never run on the thread that loaded the model, whose OpenMP team is "
            "released first: two teams on two cores make GNU OpenMP sleep and wake its threads at every parallel "
            "region of every decode step (prunewatch/engine/threads.py says how)."),
    )
    prefix_cache_entries: int = Field(
        8, ge=0, le=1024,
        description=(
            "Computed chat-prompt heads kept for reuse (prunewatch/engine/prefix_cache.py): a chat prompt's head is "
            "everything up to its last user turn (the system prompt, default or its own, and any earlier turns). "
            "Heads are computed without activation sparsity (a prefill's products run dense either way), under the "
            "rest of the request's plan; a prompt whose head was computed before with the same bypassed blocks and "
            "gated heads prefills the rest only, after the head's keys and values copied from the store. One entry "
            "per head, cache shape and thread count, least recently used evicted; each holds its head's keys and "
            "values at every layer (SmolLM2-135M: 45 KiB per token). Chat prompts are always "
            "prefilled split at the head, so a request gets the same tokens whether its head was stored or not. "
            "0 turns it off."),
    )
    prefix_cache_mib: int = Field(
        256, ge=0, le=1_048_576,
        description=(
            "Memory the prefix cache's heads may hold together, in MiB, beside prefix_cache_entries: least recently "
            "used heads are evicted until both bounds hold, and a head larger than the whole budget is computed for "
            "its request and not kept. An entry grows with its head (SmolLM2-135M: 45 KiB per token, so 256 MiB hold "
            "about 5800 positions of heads), which a count alone does not bound. 0 turns the cache off."),
    )
    prefix_cache_min_tokens: int = Field(
        64, ge=1, le=1_000_000,
        description=(
            "The shortest head the prefix cache splits off and keeps. A prefill pays a whole forward pass however few "
            "its rows, so a shorter head's own pass, whenever it is not stored yet, costs more than later hits save "
            "(bench/results/prefix-cache-cpu.json: `prunewatch bench prefix-cache`). The chat template's own head "
            "(what it renders before the user's text when a request sends no system message, e.g. a default system "
            "prompt) is split off at any length: every such request shares it, so it misses once."),
    )
    dram_profile: Path | None = Field(
        None,
        description=(
            "DRAM profile measured with Nsight Compute (`prunewatch profile-dram`); requests of the "
            "profiled shape on the profiled GPU then report dram_source=ncu instead of the estimate."),
    )
    calibration_dir: Path | None = Field(
        None, description="Where calibrations are cached; default ~/.cache/prunewatch/calibration."
    )

    @field_validator("sparsity_family_scale")
    @classmethod
    def _known_families(cls, value: dict[str, float]) -> dict[str, float]:
        from prunewatch.engine.sparse.targets import PROJECTION_FAMILIES

        unknown = sorted(set(value) - set(PROJECTION_FAMILIES))
        if unknown:
            raise ValueError(f"unknown projection families {unknown}; known: {list(PROJECTION_FAMILIES)}")
        if any(not 0.0 <= f <= 4.0 for f in value.values()):
            raise ValueError("family factors must be within [0, 4]")
        return value

    @field_validator("layer_blacklist")
    @classmethod
    def _no_negative_layers(cls, value: list[int]) -> list[int]:
        if any(i < 0 for i in value):
            raise ValueError("layer_blacklist holds layer indices, which are >= 0")
        return sorted(set(value))
