"""The prefix cache: the chat template's head is computed once per plan and thread count, and a request gets the same
tokens and logits whether its head came from the store or was computed for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan
from prunewatch.engine.kv_cache import reserved_cache
from prunewatch.engine.prefix_cache import PrefixCache
from prunewatch.server import ServerSettings, create_app

QUESTION = "How do you list open network ports?"
SYSTEM = "You are a Linux system administrator."


def _filled_cache(config, length: int, seed: int):
    """A reserved cache whose layers hold `length` positions of random keys and values."""
    generator = torch.Generator().manual_seed(seed)
    cache = reserved_cache(config, length + 4)
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, length, 8, generator=generator), torch.randn(1, 2, length, 8, generator=generator))
    return cache


def test_the_head_ends_after_the_last_user_turn_marker_and_leaves_a_token() -> None:
    cache = PrefixCache([7, 8], max_entries=2)
    assert cache.head_length([1, 7, 8, 5]) == 3
    assert cache.head_length([1, 7, 8, 5, 7, 8, 6, 6]) == 6  # the last turn: earlier ones belong to the head
    assert cache.head_length([1, 7, 8]) == 0  # nothing after the head: no logits to compute from a copy alone
    assert cache.head_length([1, 8, 7, 5]) == 0
    assert cache.head_length([7, 8, 5]) == 2
    assert PrefixCache([], max_entries=2).head_length([7, 8, 5]) == 0
    assert PrefixCache([7, 8], max_entries=0).head_length([7, 8, 5]) == 0
    assert PrefixCache([7, 8], max_entries=2, min_tokens=4).head_length([1, 7, 8, 5, 7, 8, 6]) == 6
    assert PrefixCache([7, 8], max_entries=2, min_tokens=4).head_length([1, 7, 8, 5]) == 0  # too short to split
    assert PrefixCache([7, 8], max_entries=2, min_tokens=3).head_length([1, 7, 8, 5]) == 3
    # A shared head (the chat template's own) splits at any length; another head of its length does not.
    shared = PrefixCache([7, 8], max_entries=2, min_tokens=64, shared_heads=[[1, 7, 8], []])
    assert shared.head_length([1, 7, 8, 5, 6]) == 3
    assert shared.head_length([2, 7, 8, 5, 6]) == 0
    assert shared.head_length([1, 7, 8, 5, 7, 8, 6]) == 0  # a later turn: the head is the whole conversation
    with pytest.raises(ValueError, match="max_entries"):
        PrefixCache([5], max_entries=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixCache([5], max_entries=1, min_tokens=0)


def test_entries_are_copies_evicted_least_recently_used_first(probe_engine) -> None:
    config = probe_engine.loaded.model.config
    store = PrefixCache([2, 3], max_entries=2)
    sources = {name: _filled_cache(config, 3, seed) for seed, name in enumerate("abc")}
    store.store("a", sources["a"], 3)
    store.store("b", sources["b"], 3)
    assert store.lookup("a") is not None  # a is now the most recently used
    store.store("c", sources["c"], 3)  # evicts b
    assert store.lookup("b") is None and store.entries == 2
    entry = store.lookup("a")
    assert entry is not None
    sources["a"].layers[0].key_buffer.zero_()  # the entry is a copy, not a view of the request's cache
    target = reserved_cache(config, 8)
    store.fill(target, entry)
    assert all(layer.get_seq_length() == 3 for layer in target.layers)
    assert torch.equal(target.layers[-1].values, sources["a"].layers[-1].values)
    first = entry.keys[0]
    assert first is not None and torch.equal(target.layers[0].keys, first) and first.abs().sum() > 0
    with pytest.raises(ValueError, match="empty cache"):
        store.fill(target, entry)
    with pytest.raises(ValueError, match="head's 3"):
        store.store("d", _filled_cache(config, 4, 9), 3)
    store.clear()
    assert store.entries == 0 and store.lookup("a") is None


def test_the_store_holds_at_most_its_bytes_evicting_least_recently_used(probe_engine) -> None:
    config = probe_engine.loaded.model.config
    entry_bytes = sum(2 * layer.keys.numel() * 4 for layer in _filled_cache(config, 3, 0).layers)  # keys and values
    store = PrefixCache([2, 3], max_entries=8, max_bytes=2 * entry_bytes + entry_bytes // 2)  # room for two
    for seed, name in enumerate("abc"):
        store.store(name, _filled_cache(config, 3, seed), 3)
        if name == "a":
            assert store.bytes == entry_bytes and store.entries == 1
        if name == "b":
            assert store.lookup("a") is not None  # a is now the most recently used
    assert store.entries == 2 and store.bytes == 2 * entry_bytes  # b went, under the count but over the bytes
    assert store.lookup("b") is None and store.lookup("a") is not None and store.lookup("c") is not None
    store.store("c", _filled_cache(config, 3, 7), 3)  # stored again: counted once
    assert store.entries == 2 and store.bytes == 2 * entry_bytes
    store.store("long", _filled_cache(config, 9, 8), 9)  # three entries' bytes: over the whole budget, not kept
    assert store.lookup("long") is None and store.entries == 2 and store.bytes == 2 * entry_bytes
    store.clear()
    assert store.bytes == 0
    assert PrefixCache([7, 8], max_entries=8, max_bytes=0).head_length([1, 7, 8, 5]) == 0  # 0 bytes: off
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache([5], max_entries=1, max_bytes=-1)


def test_the_engine_bounds_its_store_by_the_setting_and_serves_its_size(probe_engine) -> None:
    assert probe_engine.prefix_cache.max_bytes == probe_engine.settings.prefix_cache_mib * 2**20
    probe_engine.prefix_cache.min_tokens = 1
    probe_engine.prefix_cache.clear()
    try:
        probe_engine.generate(QUESTION, system=SYSTEM, max_new_tokens=2)
        held = probe_engine.prefix_cache.bytes
        assert probe_engine.prefix_cache.entries == 1 and held > 0
        with TestClient(create_app(probe_engine, ServerSettings(), registry=CollectorRegistry())) as client:
            metrics = client.get("/metrics").text
        scraped = {sample.name: sample.value for family in text_string_to_metric_families(metrics)
                   for sample in family.samples if sample.labels.get("model") == probe_engine.name}
        assert scraped["prunewatch_prefix_cache_bytes"] == held
        assert scraped["prunewatch_prefix_cache_entries"] == 1
        assert scraped["prunewatch_prefix_cache_budget_bytes"] == probe_engine.settings.prefix_cache_mib * 2**20
    finally:
        probe_engine.prefix_cache.min_tokens = probe_engine.settings.prefix_cache_min_tokens
        probe_engine.prefix_cache.clear()


@pytest.fixture
def probe_engine(probe_engine):
    """The session's probe engine with every head split off: its system prompts' heads are shorter than the
    setting's default minimum (tests/engine/test_prefix_cache.py checks that minimum on its own)."""
    min_tokens = probe_engine.prefix_cache.min_tokens
    probe_engine.prefix_cache.min_tokens = 1
    yield probe_engine
    probe_engine.prefix_cache.min_tokens = min_tokens
    probe_engine.prefix_cache.clear()


DEFAULT_SYSTEM = "{% if messages[0]['role'] != 'system' %}### System:\nYou are a helpful assistant.\n\n{% endif %}"


def test_the_templates_own_head_is_split_off_at_the_default_minimum_and_changes_no_bit(
        probe_model_dir, calibration_dir, tmp_path) -> None:
    """A request without a system message starts with the template's own head (here a default system prompt, as
    SmolLM2's template renders one), however short: the default settings split it off, and the second such request
    copies it, with the bits and counts of the first."""
    import shutil

    from tests.conftest import load_probe_engine

    model_dir = tmp_path / "probe-llama"
    shutil.copytree(probe_model_dir, model_dir)
    template = model_dir / "chat_template.jinja"
    template.write_text(DEFAULT_SYSTEM + template.read_text())
    engine = load_probe_engine(model_dir, calibration_dir)
    ids = engine.render_prompt(QUESTION)
    head = engine.prefix_cache.head_length(ids)
    assert 0 < head < engine.settings.prefix_cache_min_tokens  # shorter than the minimum, split anyway
    assert engine.prefix_cache.shared_heads == {tuple(ids[:head])}
    assert engine.prefix_cache.head_length(engine.render_prompt(QUESTION, SYSTEM)) == 0  # a one-off head: whole
    plan = engine.execution_plan(ids, 0.5, [], prompt_text=QUESTION)
    missed = _first_logits(engine, ids, plan)
    other = engine.render_prompt("Which port does SSH listen on?")
    assert engine.prefix_cache.head_length(other) == head
    hit = _first_logits(engine, ids, plan)
    assert (missed[2], hit[2]) == (0, head)
    assert hit[1] == missed[1] and torch.equal(hit[0], missed[0]) and hit[3] == missed[3]
    assert engine.generate("Which port does SSH listen on?", max_new_tokens=2).stats.cached_prompt_tokens == head


def test_a_template_that_insists_on_a_system_message_has_no_template_head(probe_model_dir, calibration_dir,
                                                                          tmp_path) -> None:
    import shutil

    from tests.conftest import load_probe_engine

    model_dir = tmp_path / "probe-llama"
    shutil.copytree(probe_model_dir, model_dir)
    template = model_dir / "chat_template.jinja"
    template.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
                        "{% endif %}" + template.read_text())
    engine = load_probe_engine(model_dir, calibration_dir)
    assert engine.prefix_cache.marker and engine.prefix_cache.shared_heads == frozenset()
    assert engine.generate(QUESTION, system=SYSTEM, max_new_tokens=2).token_ids  # system prompts still serve


def test_heads_shorter_than_the_minimum_are_prefilled_whole(probe_engine) -> None:
    engine = probe_engine
    ids = engine.render_prompt(QUESTION, SYSTEM)
    head = engine.prefix_cache.head_length(ids)
    engine.prefix_cache.min_tokens = head + 1
    engine.prefix_cache.clear()
    assert engine.prefix_cache.head_length(ids) == 0
    runs = [engine.generate(QUESTION, system=SYSTEM, max_new_tokens=4) for _ in range(2)]
    assert [r.stats.cached_prompt_tokens for r in runs] == [0, 0] and engine.prefix_cache.entries == 0
    engine.prefix_cache.min_tokens = head
    assert engine.prefix_cache.head_length(ids) == head


def _first_logits(engine, ids: list[int], plan: ExecutionPlan) -> tuple[torch.Tensor, list[int], int, tuple]:
    """The first tokens' log-probabilities, the tokens, the positions the prefix cache filled, and the counts."""
    ledger = ExecutionLedger()
    scored = list(engine._decode(ids, plan, ledger, 6, True, logprobs=5))
    counts = (ledger.executed_flops, ledger.dense_flops, ledger.weight_bytes_read, ledger.kv_bytes_read,
              ledger.block_calls, ledger.block_bypasses)
    return (torch.tensor([[s.logprob, *s.top_logprobs] for s in scored]), [s.token_id for s in scored],
            ledger.cached_prompt_tokens, counts)


def test_a_hit_gives_the_bits_a_miss_computes(probe_engine) -> None:
    engine = probe_engine
    ids = engine.render_prompt(QUESTION, SYSTEM)
    head = engine.prefix_cache.head_length(ids)
    assert 0 < head < len(ids)
    plan = engine.execution_plan(ids, 0.5, [], prompt_text=QUESTION)
    engine.prefix_cache.clear()
    missed = _first_logits(engine, ids, plan)
    hit = _first_logits(engine, ids, plan)
    assert missed[2] == 0 and hit[2] == head
    assert hit[1] == missed[1] and torch.equal(hit[0], missed[0])
    assert hit[3] == missed[3]  # the head is the store's work: a request counts the same, stored or not
    # Heads run without activation sparsity: a plan that differs only in its targets shares the entry; one that
    # bypasses other blocks shapes the cache differently, and gets its own.
    retargeted = replace(plan, activation_sparsity=0.3, layer_sparsity=())
    assert _first_logits(engine, ids, retargeted)[2] == head
    assert plan.bypass and _first_logits(engine, ids, ExecutionPlan())[2] == 0
    assert engine.prefix_cache.entries == 2


def test_heads_are_shared_by_their_system_prompt_and_only_by_it(probe_engine) -> None:
    engine = probe_engine
    engine.prefix_cache.clear()

    def cached(prompt: str, system: str | None = SYSTEM, **kwargs) -> int:
        return engine.generate(prompt, system=system, max_new_tokens=2, **kwargs).stats.cached_prompt_tokens

    head = engine.prefix_cache.head_length(engine.render_prompt(QUESTION, SYSTEM))
    assert cached(QUESTION) == 0
    assert cached("Which port does SSH listen on?") == head  # another question after the same system prompt
    assert cached(QUESTION, "You are a contract lawyer.") == 0  # another system prompt: another head
    assert cached(QUESTION, "You are a contract lawyer.") > 0
    # Echo with logprobs scores every prompt position; a raw completion prompt has no user turn.
    assert cached(QUESTION, logprobs=1, echo=True) == 0
    raw = engine.render_raw("Open ports are listed by")
    assert engine.prefix_cache.head_length(raw) == 0
    assert engine.generate(prompt_ids=raw, max_new_tokens=2).stats.cached_prompt_tokens == 0


def test_turned_off_or_recalibrated_nothing_is_reused(probe_engine, probe_model_dir, calibration_dir) -> None:
    from tests.conftest import load_probe_engine

    off = load_probe_engine(probe_model_dir, calibration_dir, prefix_cache_entries=0)
    for _ in range(2):
        assert off.generate(QUESTION, system=SYSTEM, max_new_tokens=2).stats.cached_prompt_tokens == 0
    probe_engine.generate(QUESTION, system=SYSTEM, max_new_tokens=2)
    assert probe_engine.prefix_cache.entries > 0
    probe_engine.use_calibration(probe_engine.calibration)
    assert probe_engine.prefix_cache.entries == 0


def test_batched_requests_use_the_store_and_decode_what_they_do_in_process(probe_engine) -> None:
    engine = probe_engine
    engine.prefix_cache.clear()
    alone = engine.generate(QUESTION, system=SYSTEM, max_new_tokens=8, sensitivity=0.0)
    batcher = engine.new_batcher(4, threads=torch.get_num_threads())
    try:
        served = [engine.generate(QUESTION, system=SYSTEM, max_new_tokens=8, sensitivity=0.0, batcher=batcher)
                  for _ in range(2)]
    finally:
        batcher.close()
    head = engine.prefix_cache.head_length(engine.render_prompt(QUESTION, SYSTEM))
    assert [r.token_ids for r in served] == [alone.token_ids] * 2
    assert [r.stats.cached_prompt_tokens for r in served] == [head] * 2


def test_the_bench_measures_each_configuration_on_the_stepper(probe_engine) -> None:
    from prunewatch.bench.prefix_cache import CONFIGURATIONS, LONG_SYSTEM, format_table, measure

    engine = probe_engine
    engine.prefix_cache.min_tokens = 64  # the setting's default: the long system prompt's head splits off
    questions = [QUESTION, "Which port does SSH listen on?"]
    prompts = [[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}] for q in questions]
    head = engine.prefix_cache.head_length(engine.render_prompt(messages=prompts[0]))
    assert head >= 64
    batcher = engine.new_batcher(2, threads=1)
    try:
        rows = measure(engine, batcher, prompts, rounds=1)
    finally:
        batcher.close()
    assert list(rows) == list(CONFIGURATIONS)
    assert rows["off"]["cached_share"] == rows["cold"]["cached_share"] == 0.0 and rows["off"]["vs_off"] == 1.0
    tokens = rows["off"]["mean_prompt_tokens"]
    assert rows["served"]["cached_share"] == rows["served, every head"]["cached_share"] == round(head / tokens, 3)
    assert all(row["prefill_ms_median"] > 0 and row["prompts"] == 2 for row in rows.values())
    assert (engine.prefix_cache.max_entries, engine.prefix_cache.min_tokens) == (8, 64)  # settings restored
    table = format_table({"sets": {"long": rows}})
    assert table.count("\n") == 1 + len(CONFIGURATIONS) and "| long | served |" in table


def test_a_head_is_computed_in_pieces_and_any_path_computes_the_same_entry(probe_engine, monkeypatch) -> None:
    """The batcher computes a head one piece per job; the entry one path stored serves the other with the tokens the
    other computes itself."""
    import math

    from prunewatch.engine import pruning_engine

    monkeypatch.setattr(pruning_engine, "PREFILL_CHUNK", 4)
    engine = probe_engine
    ids = engine.render_prompt(QUESTION, SYSTEM)
    head = engine.prefix_cache.head_length(ids)
    rest = math.ceil((len(ids) - head) / 4)  # the rest of the prompt's chunks
    threads = torch.get_num_threads()

    def batched() -> tuple[list[int], int, int]:
        batcher = engine.new_batcher(2, threads=threads)
        try:
            result = engine.generate(QUESTION, system=SYSTEM, max_new_tokens=6, sensitivity=0.0, batcher=batcher)
            return result.token_ids, result.stats.cached_prompt_tokens, batcher.stepper_time().jobs
        finally:
            batcher.close()

    engine.prefix_cache.clear()
    in_process = engine.generate(QUESTION, system=SYSTEM, max_new_tokens=6, sensitivity=0.0)
    assert in_process.stats.cached_prompt_tokens == 0
    copied = batched()  # the entry the request's own thread computed
    engine.prefix_cache.clear()
    computed = batched()
    assert copied[:2] == (in_process.token_ids, head) and computed[:2] == (in_process.token_ids, 0)
    # a lookup, the head's pieces, then the rest of the prompt in chunks of the same size
    assert rest > 1 and (copied[2], computed[2]) == (1 + rest, 1 + math.ceil(head / 4) + rest)


def test_a_template_that_refuses_system_prompts_leaves_the_cache_off(probe_model_dir, calibration_dir, tmp_path):
    """Some templates raise on a system message; the engine then loads without a prefix cache."""
    import shutil

    from prunewatch.engine import EngineSettings, PruningEngine

    model_dir = tmp_path / "model"
    shutil.copytree(probe_model_dir, model_dir)
    template = model_dir / "chat_template.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}"
                        "{{ m['content'] }}\n{% endfor %}")
    engine = PruningEngine.load(EngineSettings(model_dir=model_dir, device="cpu", calibration_dir=calibration_dir,
                                               log_level="NONE"))
    assert engine.prefix_cache.marker == () and engine.prefix_cache.head_length(engine.render_prompt("Hi")) == 0
    assert engine.generate("Hi", max_new_tokens=2).stats.cached_prompt_tokens == 0
