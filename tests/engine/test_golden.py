"""Golden outputs of the bundled probe model: fail loudly when a transformers or torch upgrade changes
what the wrapped model computes. Regenerate deliberately with PRUNEWATCH_UPDATE_GOLDEN=1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "probe-llama.json"
PROMPTS = [
    ("You are a Linux system administrator.", "How do you list open network ports?"),
    ("You are a contract lawyer.", "Who is liable when the licensor was grossly negligent?"),
]


def observe(probe_engine) -> dict:
    cases = []
    for system, prompt in PROMPTS:
        ids = probe_engine.render_prompt(prompt, system)
        with torch.no_grad():
            logits = probe_engine.loaded.model(input_ids=torch.tensor([ids])).logits[0, -1]
        dense = probe_engine.generate(prompt, system=system, max_new_tokens=12, sensitivity=0.0)
        pruned = probe_engine.generate(prompt, system=system, max_new_tokens=12, sensitivity=0.8)
        pruned_plan, _ = probe_engine.plan(ids, 0.8, [])
        cases.append({
            "prompt_ids": ids,
            "last_logits_top5": [[int(i), round(float(v), 3)] for v, i in zip(*torch.topk(logits, 5))],
            "dense_tokens": dense.token_ids,
            "pruned_layers": pruned.stats.layers_bypassed,
            "pruned_heads": [sorted(pruned_plan.plan.heads_gated_in(i)) for i in range(probe_engine.num_layers)],
            "pruned_tokens": pruned.token_ids,
        })
    return {"model_fingerprint": probe_engine.loaded.fingerprint, "cases": cases}


def test_probe_model_outputs_match_golden(probe_engine):
    observed = observe(probe_engine)
    if os.environ.get("PRUNEWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(observed, indent=1) + "\n")
        pytest.skip("golden file rewritten")
    golden = json.loads(GOLDEN.read_text())
    assert observed["model_fingerprint"] == golden["model_fingerprint"], "the bundled model changed"
    for got, want in zip(observed["cases"], golden["cases"], strict=True):
        assert got["prompt_ids"] == want["prompt_ids"]
        assert [i for i, _ in got["last_logits_top5"]] == [i for i, _ in want["last_logits_top5"]]
        for (_, a), (_, b) in zip(got["last_logits_top5"], want["last_logits_top5"]):
            assert a == pytest.approx(b, abs=2e-3)
        assert got["dense_tokens"] == want["dense_tokens"]
        assert got["pruned_layers"] == want["pruned_layers"]
        assert got["pruned_heads"] == want["pruned_heads"]
        assert got["pruned_tokens"] == want["pruned_tokens"]
