"""Layer bypass: dense at sensitivity 0, a measured ratio that matches an independent count, a KV cache
consistent with the plan, and typed errors for bad requests."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from prunewatch.engine import CalibrationMismatchError, InvalidRequestError
from prunewatch.probes import load_probes

PROBES = load_probes().probes


def test_sensitivity_zero_is_token_identical_to_the_unwrapped_dense_model(probe_engine, probe_model_dir):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32).eval()
    for probe in PROBES[:3]:
        prompt_ids = probe_engine.render_prompt(probe.prompt, probe.system)
        with torch.no_grad():
            expected = dense.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                      pad_token_id=dense.config.pad_token_id)[0, len(prompt_ids):].tolist()
        result = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=24, sensitivity=0.0)
        assert result.token_ids == expected
        assert result.stats.pruning_ratio == 0.0
        assert result.stats.executed_flops == result.stats.dense_flops > 0
        assert result.stats.layers_bypassed == []


def _per_row_flops(module: torch.nn.Module) -> int:
    """2 x in x out summed over 2-D weights: computed from the parameters, not from the engine's hooks."""
    return sum(2 * p.numel() for name, p in module.named_parameters() if p.dim() == 2 and name.endswith("weight"))


def _gated_flops_per_row(block: torch.nn.Module, gated: frozenset[int], heads: int, kv_heads: int) -> int:
    """Linear work of gated heads in one Llama block, from the projection weights' shapes alone."""
    attention = block.self_attn
    hidden = attention.q_proj.weight.shape[1]
    head_dim = attention.q_proj.weight.shape[0] // heads
    group = heads // kv_heads
    kv_off = sum(1 for k in range(kv_heads) if set(range(k * group, (k + 1) * group)) <= gated)
    return 2 * hidden * head_dim * (2 * len(gated) + 2 * kv_off)  # q rows + o columns, k and v rows


def test_ratio_equals_the_share_of_work_really_skipped(probe_engine):
    blocks = probe_engine.instrumented.blocks
    model = probe_engine.loaded.model
    rows_seen: Counter[int] = Counter()
    head_rows = Counter()
    handles = [b.block.register_forward_hook(
        lambda m, args, out, i=b.index: rows_seen.update({i: args[0].shape[0] * args[0].shape[1]}))
        for b in blocks]
    handles.append(model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: head_rows.update({"head": args[0].shape[0] * args[0].shape[1]})))
    probe = PROBES[2]
    plan, _ = probe_engine.plan(probe_engine.render_prompt(probe.prompt, probe.system), 0.8, [])
    try:
        result = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=16, sensitivity=0.8)
    finally:
        for handle in handles:
            handle.remove()
    stats = result.stats
    skipped = [b.index for b in blocks if rows_seen[b.index] == 0]
    assert skipped and stats.layers_bypassed == skipped
    tokens = rows_seen[0]  # block 0 always runs: it sees every token the model processed
    assert tokens == stats.prompt_tokens + stats.completion_tokens - 1
    head = _per_row_flops(model.get_output_embeddings()) * head_rows["head"]
    dense = sum(_per_row_flops(b.block) for b in blocks) * tokens + head
    config = model.config
    gated = [_gated_flops_per_row(b.block, plan.plan.heads_gated_in(b.index), config.num_attention_heads,
                                  config.num_key_value_heads) for b in blocks]
    assert stats.heads_gated == sum(len(plan.plan.heads_gated_in(b.index)) for b in blocks if rows_seen[b.index])
    executed = sum((_per_row_flops(b.block) - gated[b.index]) * rows_seen[b.index] for b in blocks) + head
    assert stats.dense_flops == dense
    assert stats.executed_flops == executed
    assert stats.pruning_ratio == pytest.approx(1 - executed / dense, abs=1e-6)
    assert stats.pruning_ratio > 0.05  # the plan skips real work, so the equalities above are not 0 == 0


def test_ratio_agrees_with_torch_profiler_flops(probe_engine):
    probe = PROBES[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        result = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=8, sensitivity=0.8)
    matmul_flops = sum(e.flops for e in prof.events() if e.name in ("aten::mm", "aten::addmm") and e.flops)
    # The profiler sees the whole request's matmuls; the engine's executed count must match it within 1 %.
    assert result.stats.executed_flops == pytest.approx(matmul_flops, rel=0.01)
    assert result.stats.pruning_ratio > 0.1


def test_cached_and_uncached_generation_agree_under_the_same_plan(probe_engine):
    for probe in PROBES[:2]:
        cached = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=20, sensitivity=0.8)
        uncached = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=20, sensitivity=0.8,
                                         use_cache=False)
        assert cached.stats.layers_bypassed == uncached.stats.layers_bypassed != []
        assert cached.token_ids == uncached.token_ids


def test_plan_respects_blacklist_protects_block_zero_and_grows_with_sensitivity(probe_engine):
    probe = PROBES[1]
    ids = probe_engine.render_prompt(probe.prompt, probe.system)
    previous: set[int] = set()
    for sensitivity in (0.1, 0.3, 0.5, 0.7, 1.0):
        plan, fallback = probe_engine.plan(ids, sensitivity, [])
        assert fallback is None
        bypass = set(plan.plan.bypass)
        assert previous <= bypass and 0 not in bypass and probe_engine.num_layers - 1 not in bypass
        previous = bypass
    assert previous, "sensitivity 1 must bypass at least one block of the probe model"
    victim = min(previous - {0})
    plan, _ = probe_engine.plan(ids, 1.0, [victim])
    assert victim not in plan.plan.bypass
    assert next(d for d in plan.decisions if d.layer == victim).decision == "BLACKLISTED"


@pytest.mark.parametrize("sensitivity", [-0.01, 1.5, float("nan")])
def test_sensitivity_out_of_range_is_rejected(probe_engine, sensitivity):
    with pytest.raises(InvalidRequestError, match="sensitivity must be within"):
        probe_engine.generate("hello", max_new_tokens=2, sensitivity=sensitivity)


def test_blacklist_naming_a_missing_layer_is_rejected(probe_engine):
    with pytest.raises(InvalidRequestError, match=r"layer_blacklist names layer\(s\) \[99\]"):
        probe_engine.generate("hello", max_new_tokens=2, layer_blacklist=[99])


def test_calibration_for_another_model_is_refused(probe_engine):
    foreign = replace(probe_engine.calibration, model_fingerprint="0" * 64, model_name="other")
    with pytest.raises(CalibrationMismatchError, match="calibration was made for model 'other'"):
        probe_engine.use_calibration(foreign)


def test_quality_report_scores_the_served_answer_and_in_full_the_dense_continuation(probe_engine):
    probe = PROBES[4]
    dense = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=16, sensitivity=0.0,
                                  quality="full")
    quality = dense.stats.quality
    assert (quality.reference_agreement, quality.continuation_agreement, quality.perplexity_delta_pct) == (1.0, 1.0, 0.0)
    assert quality.divergence_at is None and quality.reference_tokens == len(dense.served_ids)
    assert quality.served_nll == pytest.approx(quality.reference_nll, abs=1e-5)  # served the dense answer itself
    pruned = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=16, sensitivity=1.0,
                                   quality="full")
    checked = pruned.stats.quality
    assert checked.continuation_tokens == len(dense.token_ids)
    assert checked.dense_perplexity == pytest.approx(quality.dense_perplexity, rel=1e-4)
    assert checked.reference_nll == pytest.approx(quality.reference_nll, rel=1e-4)  # the same dense answer
    assert 0.0 <= checked.continuation_agreement <= 1.0 and 0.0 <= checked.reference_agreement <= 1.0
    # The served answer's own score: recomputed from its tokens with the engine run dense, it is the same figure.
    greedy, logprobs = probe_engine.answer_logprobs(probe_engine.render_prompt(probe.prompt, probe.system),
                                                    pruned.served_ids)
    assert checked.reference_agreement == pytest.approx(sum(greedy) / len(greedy), abs=1e-6)
    assert checked.served_nll == pytest.approx(-sum(logprobs) / len(logprobs), abs=1e-5)
    if pruned.served_ids != dense.served_ids:
        assert checked.divergence_at == next(i for i, (a, b) in enumerate(zip(pruned.served_ids, dense.served_ids))
                                             if a != b)
    cheap = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=16, sensitivity=1.0, quality="on")
    assert cheap.stats.quality.reference_agreement == checked.reference_agreement
    assert cheap.stats.quality.continuation_agreement is None  # no dense re-generation unless "full"


def test_stats_phases_and_rates_are_consistent(probe_engine):
    probe = PROBES[3]
    stats = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=12, sensitivity=0.5).stats
    assert stats.preprocessing_ms > 0 and stats.inference_ms > 0 and stats.postprocessing_ms > 0
    assert stats.preprocessing_ms <= stats.ttft_ms <= stats.preprocessing_ms + stats.inference_ms
    assert stats.tokens_per_s == pytest.approx(stats.completion_tokens / (stats.inference_ms / 1000), rel=0.01)
    assert stats.ratio_unit == "linear_flops" and stats.ratio_source == "measured"
    assert stats.dram_source == "estimate" and stats.dram_bytes_per_instruction > 0


def test_a_request_past_the_models_context_is_refused_before_it_decodes(probe_engine):
    """Past max_position_embeddings a model decodes garbage (positions it never saw): every path that uses
    the engine (in-process probes, the HTTP server) refuses the request instead."""
    window = probe_engine.context_window
    assert window == probe_engine.loaded.model.config.max_position_embeddings
    prompt_ids = probe_engine.render_prompt("Show the routing table.")
    fits = window - len(prompt_ids)
    assert probe_engine.generate(prompt_ids=prompt_ids, max_new_tokens=2).stats.completion_tokens <= 2
    with pytest.raises(InvalidRequestError, match=f"context is {window} tokens; the prompt's {len(prompt_ids)} "
                                                  f"plus {fits + 1} new tokens do not fit"):
        probe_engine.generate(prompt_ids=prompt_ids, max_new_tokens=fits + 1)
