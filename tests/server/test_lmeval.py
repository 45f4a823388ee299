"""lm-eval-harness against a real `prunewatch serve`: loglikelihood through echo + logprobs, generate_until.

A `prunewatch serve` process on 127.0.0.1 serves the probe model; lm-eval 0.4.13 runs the bundled tasks
(tests/server/lmeval_tasks: 5 multiple-choice questions, 3 generations) through its Python API, as
`local-completions` (token-id prompts, its default) and `local-chat-completions`, dense (X-Pruning-Sensitivity:
0) and pruned (the server's default sensitivity). The dense numbers are checked against transformers itself:
every loglikelihood lm-eval computed must equal the probe model's own teacher-forced log-probability of that
continuation, and every generation its own greedy answer, cut at the first stop string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.servers import prunewatch_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASKS = Path(__file__).parent / "lmeval_tasks"
API_KEY = "sk-prunewatch-lmeval-key"
MODEL = "probe-llama"


@pytest.fixture(scope="module")
def server(probe_model_dir: Path, calibration_dir: Path) -> Iterator[str]:
    """`prunewatch serve` at its defaults (sensitivity 0.5) with one API key; yields its base URL."""
    with prunewatch_serve(probe_model_dir, env={"PRUNEWATCH_API_KEYS": API_KEY},
                          calibration_dir=calibration_dir) as (base, _log):
        yield base


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The bundled task files, their data paths made absolute (lm-eval reads them relative to its working dir)."""
    out = tmp_path_factory.mktemp("lmeval_tasks")
    for source in TASKS.glob("*.yaml"):
        (out / source.name).write_text(source.read_text().replace("tests/server/lmeval_tasks/", f"{TASKS}/"))
    return out


@pytest.fixture(scope="module")
def evaluate(server: str, task_dir: Path, probe_model_dir: Path, tmp_path_factory) -> Iterator:
    """Run lm-eval (Python API) on the bundled tasks against the server, offline; returns its results with samples."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.setenv(name, "1")  # a task or tokenizer that is not local fails at once, not after a timeout
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))  # datasets' Arrow cache
        yield _runner(server, task_dir, probe_model_dir)


def _runner(server: str, task_dir: Path, probe_model_dir: Path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)

    def run(tasks: list[str], chat: bool = False, headers: dict[str, str] | None = None) -> dict[str, Any]:
        model_args: dict[str, Any] = {
            "model": MODEL, "max_retries": 1, "header": {"Authorization": f"Bearer {API_KEY}", **(headers or {})}}
        if chat:
            model_args["base_url"] = f"{server}/v1/chat/completions"
        else:  # token-id prompts (lm-eval's default), tokenized by the model's own tokenizer
            model_args.update(base_url=f"{server}/v1/completions", tokenizer=str(probe_model_dir),
                              tokenizer_backend="huggingface")
        return lm_eval.simple_evaluate(model="local-chat-completions" if chat else "local-completions",
                                       model_args=model_args, tasks=tasks, task_manager=manager, batch_size=1,
                                       log_samples=True, apply_chat_template=chat)

    return run


@pytest.fixture(scope="module")
def reference(probe_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(probe_model_dir)
    return tokenizer, AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32).eval()


def continuation_logprob(reference, context: str, continuation: str) -> tuple[float, bool]:
    """(summed log-probability, greedy) of `continuation` after `context`, split into tokens as lm-eval splits
    them (lm_eval/api/model.py, _encode_pair): trailing spaces of the context move into the continuation, the
    whole string is encoded, and the continuation is what follows the context's own tokens."""
    tokenizer, model = reference
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[start - 1:-1]  # (C, V): each predicts a continuation token
    targets = torch.tensor(whole[start:])
    return float(rows.gather(-1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())


def greedy_answer(reference, prompt_ids: list[int], max_tokens: int, stops: list[str]) -> str:
    """The model's own greedy continuation, decoded, cut before the first stop string."""
    tokenizer, model = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)
    cuts = [at for at in (text.find(s) for s in stops) if at >= 0]
    return text[:min(cuts)] if cuts else text


def loglikelihoods(results: dict[str, Any]) -> list[tuple[str, str, float, bool]]:
    """(context, continuation, loglikelihood, is_greedy) of every multiple-choice request lm-eval made."""
    out = []
    for sample in results["samples"]["prunewatch_mc"]:
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"]):
            out.append((context, continuation, ll, greedy))
    return out


def test_local_completions_dense_and_pruned(evaluate, reference) -> None:
    dense = evaluate(["prunewatch_mc", "prunewatch_gen"], headers={"X-Pruning-Sensitivity": "0"})
    assert set(dense["results"]["prunewatch_mc"]) >= {"acc,none", "acc_norm,none"}
    assert "exact_match,strict" in dense["results"]["prunewatch_gen"]
    dense_ll = loglikelihoods(dense)
    assert len(dense_ll) == 5 * 4  # every choice of every question was scored
    for context, continuation, ll, greedy in dense_ll:
        expected, expected_greedy = continuation_logprob(reference, context, continuation)
        assert ll == pytest.approx(expected, abs=1e-4), (context, continuation)
        assert greedy == expected_greedy, (context, continuation)

    # generate_until over completions: 4 `until` strings plus the tokenizer's end-of-sequence text, 5 stops.
    tokenizer = reference[0]
    for sample in dense["samples"]["prunewatch_gen"]:
        context, generation_kwargs = sample["arguments"][0]
        stops = [*generation_kwargs["until"], tokenizer.eos_token]
        ids = tokenizer(context, add_special_tokens=False).input_ids
        assert sample["resps"][0][0] == greedy_answer(reference, ids, generation_kwargs["max_gen_toks"], stops)

    pruned = evaluate(["prunewatch_mc", "prunewatch_gen"])
    assert set(pruned["results"]["prunewatch_mc"]) >= {"acc,none", "acc_norm,none"}
    assert "exact_match,strict" in pruned["results"]["prunewatch_gen"]
    pruned_ll = loglikelihoods(pruned)
    assert [(c, x) for c, x, _, _ in pruned_ll] == [(c, x) for c, x, _, _ in dense_ll]
    gaps = [abs(p[2] - d[2]) for p, d in zip(pruned_ll, dense_ll)]
    assert max(gaps) > 1e-3, "the pruned server scored exactly as the dense model"


def test_local_chat_completions_generates_until(evaluate, reference) -> None:
    dense = evaluate(["prunewatch_gen"], chat=True, headers={"X-Pruning-Sensitivity": "0"})
    assert "exact_match,strict" in dense["results"]["prunewatch_gen"]
    tokenizer = reference[0]
    samples = dense["samples"]["prunewatch_gen"]
    assert len(samples) == 3
    for sample in samples:
        (messages,), generation_kwargs = sample["arguments"][0]  # the chat as JSON text
        rendered = tokenizer.apply_chat_template(json.loads(messages), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
        answer = greedy_answer(reference, ids, generation_kwargs["max_gen_toks"], generation_kwargs["until"][:4])
        assert sample["resps"][0][0] == answer
    pruned = evaluate(["prunewatch_gen"], chat=True)
    assert "exact_match,strict" in pruned["results"]["prunewatch_gen"]
    assert all(isinstance(s["resps"][0][0], str) for s in pruned["samples"]["prunewatch_gen"])
