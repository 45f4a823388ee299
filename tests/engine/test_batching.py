"""Continuous batching (prunewatch.engine.batching): requests share decode steps and keep their own answers,
stops and counts; no timings asserted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from prunewatch.engine import batching
from prunewatch.engine.batching import DecodeBatcher, batch_key, batch_plan, split_ledger
from prunewatch.engine.errors import KVBudgetError
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.kv_cache import PREFILL_CHUNK, reserved_cache
from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.engine.stats import GenerationResult
from prunewatch.server.app import create_app
from prunewatch.server.run import serve_in_background
from prunewatch.server.settings import ServerSettings
from tests.conftest import load_probe_engine

PROMPTS = ["Explain how a CPU cache works.", "What is a contract?", "Describe bond yields in simple words.",
           "Write a haiku about the sea.", "List three uses of Python.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def engine(probe_model_dir: Path, calibration_dir: Path) -> PruningEngine:
    """The probe model with the engine's default pruning (activation sparsity and the output-head shortlist)."""
    return load_probe_engine(probe_model_dir, calibration_dir)


@pytest.fixture()
def batcher(engine: PruningEngine) -> Iterator[DecodeBatcher]:
    batcher = engine.new_batcher(8, threads=2)
    yield batcher
    batcher.close()


def generate_together(engine: PruningEngine, batcher: DecodeBatcher, requests: list[dict]) -> list[GenerationResult]:
    """Each request on its own thread (one intra-op thread, as the server's), all through `batcher`."""
    results: list[GenerationResult | BaseException | None] = [None] * len(requests)

    def run(index: int) -> None:
        torch.set_num_threads(1)
        try:
            results[index] = engine.generate(batcher=batcher, **requests[index])
        except BaseException as exc:  # raised below, in the test
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, GenerationResult)]


def assert_same_scores(in_process: GenerationResult, batched: GenerationResult) -> None:
    """The same tokens, and the same bits of every log-probability and of the top alternatives'."""
    assert in_process.token_ids == batched.token_ids
    assert in_process.logprobs is not None and batched.logprobs is not None
    assert [t.logprob for t in in_process.logprobs] == [t.logprob for t in batched.logprobs]
    assert [[a.logprob for a in t.top] for t in in_process.logprobs] == \
        [[a.logprob for a in t.top] for t in batched.logprobs]


def test_dense_requests_decode_the_tokens_they_get_alone_in_any_batch(engine: PruningEngine,
                                                                      batcher: DecodeBatcher) -> None:
    requests = [{"prompt": p, "max_new_tokens": 8 + 3 * i, "sensitivity": 0.0} for i, p in enumerate(PROMPTS)]
    alone = [engine.generate(batcher=batcher, **r).token_ids for r in requests]
    assert set(batcher.batch_sizes) == {1}
    together = generate_together(engine, batcher, requests)
    assert [r.token_ids for r in together] == alone
    assert max(batcher.batch_sizes) >= 3, batcher.batch_sizes  # they did share steps
    shared = [r.stats for r in together]
    assert all(s.mean_batch_size > 1.0 for s in shared)
    assert batcher.decoding == 0


def test_a_dense_request_scores_its_tokens_the_same_in_process_as_through_the_batcher(
        engine: PruningEngine, batcher: DecodeBatcher) -> None:
    """Eager CPU decoding computes dense products through the kernel, as batched steps do, so the two paths agree to
    the bit (BLAS's products differ in their last bits from the kernel's at 1 row, and BLAS is not row-invariant)."""
    for prompt in PROMPTS[:3]:
        request = {"prompt": prompt, "max_new_tokens": 10, "sensitivity": 0.0, "logprobs": 3}
        assert_same_scores(engine.generate(**request), engine.generate(batcher=batcher, **request))


def test_a_long_prompt_is_prefilled_in_the_batchers_chunks_in_process_too(engine: PruningEngine,
                                                                          batcher: DecodeBatcher) -> None:
    """A prompt longer than one prefill chunk gets the same bits in process as through the batcher, which prefills
    it in chunks between decode steps: both run the same chunks, and count the same cache reads."""
    prompt = " ".join(["The supplier ships within ten days of the order and the buyer pays within thirty."] * 14)
    ids = engine.render_prompt(prompt)
    assert len(ids) - engine.prefix_cache.head_length(ids) > 2 * PREFILL_CHUNK  # three chunks after any head
    request = {"prompt": prompt, "max_new_tokens": 6, "sensitivity": 0.0, "logprobs": 3}
    in_process = engine.generate(**request)
    batched = engine.generate(batcher=batcher, **request)
    assert_same_scores(in_process, batched)
    assert in_process.stats.dense_flops == batched.stats.dense_flops
    assert in_process.stats.executed_flops == batched.stats.executed_flops
    # estimated from the weight and cache bytes the request read: equal only if the chunks' cache reads are counted alike
    assert in_process.stats.dram_bytes_per_instruction == batched.stats.dram_bytes_per_instruction


def test_a_request_joins_and_leaves_mid_stream_without_changing_the_others(engine: PruningEngine,
                                                                            batcher: DecodeBatcher) -> None:
    long = {"prompt": PROMPTS[0], "max_new_tokens": 24, "sensitivity": 0.0}
    short = {"prompt": PROMPTS[1], "max_new_tokens": 4, "sensitivity": 0.0}
    alone_long = engine.generate(batcher=batcher, **long).token_ids
    alone_short = engine.generate(batcher=batcher, **short).token_ids
    before = dict(batcher.batch_sizes)
    decoding = threading.Event()
    items: list = []

    def consume_long() -> None:  # on its own thread, as a served request's generator runs
        torch.set_num_threads(1)
        for item in engine.stream(batcher=batcher, **long):
            items.append(item)
            if len(items) == 4:
                decoding.set()  # the long request is decoding when the short one arrives

    consumer = threading.Thread(target=consume_long)
    consumer.start()
    assert decoding.wait(60)
    [short_result] = generate_together(engine, batcher, [short])
    consumer.join(120)
    result = items[-1]
    assert isinstance(result, GenerationResult)
    assert result.token_ids == alone_long
    assert short_result.token_ids == alone_short
    during = {rows: count - before.get(rows, 0) for rows, count in batcher.batch_sizes.items()}
    assert during.get(2, 0) >= 1 and during.get(1, 0) >= 1  # shared steps, and steps alone before and after


def test_a_prompt_prefilled_in_packed_chunks_gets_the_logits_of_transformers_own_pass(engine: PruningEngine) -> None:
    """Each chunk after the first attends over the cached positions and its own, causally (the mask the packed
    pass builds): every prompt row's logits are those of the model's own forward pass over the whole prompt."""
    model = engine.loaded.model
    ids = engine.render_prompt(" ".join(["The buyer pays within thirty days of the invoice."] * 20))
    assert len(ids) > 2 * PREFILL_CHUNK
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        batching.install_ragged_attention(model)
        cache = reserved_cache(model.config, len(ids))
        with executing(ExecutionPlan(), ExecutionLedger()):
            chunks = [batching.packed_pass(model, ids[start:start + PREFILL_CHUNK], start, cache, keep_all=True)[0]
                      for start in range(0, len(ids), PREFILL_CHUNK)]
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=1e-4)
    assert cache.get_seq_length() == len(ids)


@pytest.mark.parametrize("sensitivity", [0.0, None], ids=["dense", "default"])
def test_prefill_chunks_take_the_decoding_rows_along_and_change_no_bit(engine: PruningEngine,
                                                                        sensitivity: float | None) -> None:
    """A request that arrives while another decodes prefills in packed passes that also run the other's due steps
    (the batcher waits for that row here: a long gather). Dense, both get every bit and count they get alone. At the
    default, requests that share decode steps run the batch's plan (the lowest targets), so only the packed part is
    the same: the arriving prompt's prefill, and the decoding request's steps taken along (their rows' own plans)."""
    batcher = engine.new_batcher(8, threads=2, gather_s=30.0)
    try:
        prompt = " ".join(["The supplier ships within ten days of the order and the buyer pays within thirty."] * 14)
        arriving = {"prompt": prompt, "max_new_tokens": 5, "sensitivity": sensitivity, "logprobs": 3}
        decoding = {"prompt": PROMPTS[0], "max_new_tokens": 40, "sensitivity": sensitivity, "logprobs": 3}
        ids = engine.render_prompt(prompt)
        chunks = -(-(len(ids) - engine.prefix_cache.head_length(ids)) // PREFILL_CHUNK)
        assert chunks >= 3
        alone = [engine.generate(batcher=batcher, **r) for r in (arriving, decoding)]
        assert batcher.stepper_time().packed == 0  # nothing was decoding when they prefilled
        started = threading.Event()
        items: list = []

        def consume() -> None:
            torch.set_num_threads(1)
            for item in engine.stream(batcher=batcher, **decoding):
                items.append(item)
                if len(items) == 4:
                    started.set()

        consumer = threading.Thread(target=consume)
        consumer.start()
        assert started.wait(60)
        [arrived] = generate_together(engine, batcher, [arriving])
        consumer.join(120)
        spent = batcher.stepper_time()
    finally:
        batcher.close()
    decoded = items[-1]
    assert isinstance(decoded, GenerationResult)
    assert spent.packed == chunks and spent.packed_rows == chunks  # each chunk took the decoding row along
    # The prefill's own figures, and its first token, whichever rows rode along.
    assert arrived.logprobs is not None and alone[0].logprobs is not None
    assert arrived.logprobs[0] == alone[0].logprobs[0]
    assert arrived.stats.prefill_pruning_ratio == alone[0].stats.prefill_pruning_ratio
    if sensitivity == 0.0:
        for one, shared in zip(alone, [arrived, decoded], strict=True):
            assert_same_scores(one, shared)
            assert (one.stats.dense_flops, one.stats.executed_flops) == (shared.stats.dense_flops,
                                                                         shared.stats.executed_flops)
    else:  # the steps taken along (tokens 4 to 3 + chunks, counting the prefill's) were the decoding row's own
        assert alone[1].logprobs is not None and decoded.logprobs is not None
        assert alone[1].logprobs[:4 + chunks] == decoded.logprobs[:4 + chunks]


@pytest.mark.parametrize("sensitivity", [0.0, 0.5], ids=["dense", "pruned"])
def test_a_short_chunk_and_the_rows_along_share_one_product_with_the_bits_and_counts_of_each_alone(
        engine: PruningEngine, monkeypatch: pytest.MonkeyPatch, sensitivity: float) -> None:
    """A chunk of at most ROW_INVARIANT_CHUNK_ROWS rows runs the row-invariant product, dense or masked at its
    targets, and the decode rows riding along a dense batch step: one call per layer for both parts (SparseLinear's
    `_joined`), and still each part's bits and counts of its own pass."""
    from prunewatch.engine.execution import PackedTail, packed_tail
    from prunewatch.engine.sparse.module import ROW_INVARIANT_CHUNK_ROWS, SparseLinear

    model = engine.loaded.model
    batching.install_ragged_attention(model)
    chunk_ids = (engine.render_prompt(PROMPTS[3]) * 4)[:ROW_INVARIANT_CHUNK_ROWS - 2]
    chunk_plan = replace(engine.execution_plan(chunk_ids, sensitivity, []), row_invariant=True)
    assert chunk_plan.skips_work == (sensitivity > 0)
    riders = [engine.render_prompt(p) for p in PROMPTS[:2]]
    step_plan = batch_plan([replace(engine.execution_plan(ids, sensitivity, []), row_invariant=True)
                            for ids in riders], engine.instrumented.num_layers)
    tokens, positions = [5, 9], [len(ids) for ids in riders]
    joined: list[bool] = []
    real = SparseLinear._joined

    def counted(self, chunk, tail):
        both = real(self, chunk, tail)
        joined.append(both is not None)
        return both

    monkeypatch.setattr(SparseLinear, "_joined", counted)

    def caches() -> list:
        made = []
        with executing(ExecutionPlan(row_invariant=True), ExecutionLedger()):
            for ids in riders:
                made.append(reserved_cache(model.config, len(ids) + 4))
                batching.packed_pass(model, ids, 0, made[-1])
        return made

    def counts(ledger: ExecutionLedger) -> tuple:
        return (ledger.dense_flops, ledger.executed_flops, ledger.weight_bytes_read, ledger.sparse_dense_flops,
                ledger.sparse_executed_flops, ledger.sparse_kept_entries, ledger.sparse_input_entries)

    with torch.no_grad():
        alone_chunk, alone_rows = ExecutionLedger(), ExecutionLedger()
        with executing(chunk_plan, alone_chunk):
            chunk_logits, _ = batching.packed_pass(model, chunk_ids, 0, reserved_cache(model.config, 40))
        with executing(step_plan, alone_rows):
            row_logits = batching.ragged_decode_step(model, tokens, positions, caches())
        assert not joined  # nothing rode along: no call was packed
        packed_chunk, packed_rows = ExecutionLedger(), ExecutionLedger()
        rider_caches = caches()
        with executing(chunk_plan, packed_chunk), packed_tail(PackedTail(2, step_plan, packed_rows)):
            logits, rows = batching.packed_pass(model, chunk_ids, 0, reserved_cache(model.config, 40), tokens,
                                                positions, rider_caches)
    assert joined and all(joined)  # every block linear took both parts in one call
    assert torch.equal(logits, chunk_logits) and rows is not None and torch.equal(rows, row_logits)
    assert counts(packed_chunk) == counts(alone_chunk) and counts(packed_rows) == counts(alone_rows)
    assert (packed_chunk.sparse_executed_flops > 0) == (sensitivity > 0)  # the pruned chunk was masked, then dense


def test_a_failed_packed_pass_fails_its_chunk_and_the_rows_it_took_along_and_the_batcher_goes_on(
        engine: PruningEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    batcher = engine.new_batcher(8, threads=2, gather_s=30.0)
    real = batching.packed_pass

    def failing(model, chunk_ids, start, cache, tokens=(), *args, **kwargs):
        if tokens:
            raise RuntimeError("packed pass broke")
        return real(model, chunk_ids, start, cache, tokens, *args, **kwargs)

    monkeypatch.setattr(batching, "packed_pass", failing)
    try:
        started = threading.Event()
        failures: list[BaseException] = []

        def consume() -> None:
            torch.set_num_threads(1)
            try:
                for index, _ in enumerate(engine.stream(PROMPTS[0], max_new_tokens=40, sensitivity=0.0,
                                                        batcher=batcher)):
                    if index == 3:
                        started.set()
            except RuntimeError as exc:
                failures.append(exc)

        consumer = threading.Thread(target=consume)
        consumer.start()
        assert started.wait(60)
        with pytest.raises(RuntimeError, match="packed pass broke"):
            engine.generate(PROMPTS[1], max_new_tokens=4, sensitivity=0.0, batcher=batcher)
        consumer.join(120)
        assert [str(f) for f in failures] == ["packed pass broke"]  # the row it took along failed with it
        assert batcher.decoding == 0 and batcher.kv_reserved_bytes == 0
        monkeypatch.setattr(batching, "packed_pass", real)
        assert engine.generate(PROMPTS[1], max_new_tokens=4, sensitivity=0.0, batcher=batcher).token_ids
    finally:
        batcher.close()


def test_the_stepper_accounts_its_time_by_activity_and_its_steps_by_rows(engine: PruningEngine) -> None:
    started = time.monotonic()
    batcher = engine.new_batcher(8, threads=2)
    try:
        requests = [{"prompt": p, "max_new_tokens": 6 + 2 * i, "sensitivity": 0.0} for i, p in enumerate(PROMPTS[:4])]
        results = generate_together(engine, batcher, requests)
        spent = batcher.stepper_time()
    finally:
        batcher.close()
    elapsed = time.monotonic() - started
    # one prefill chunk each (short prompts), alone or packed with decode rows; no quality pass
    assert spent.jobs + spent.packed == len(requests)
    assert spent.steps_by_rows == batcher.batch_sizes and max(spent.steps_by_rows) >= 2
    # every token after the prefill's is one row of one step, or a row a packed pass took along
    assert sum(rows * steps for rows, steps in spent.steps_by_rows.items()) + spent.packed_rows == sum(
        r.stats.completion_tokens - 1 for r in results)
    assert spent.packed_rows >= spent.packed
    assert set(spent.step_s_by_rows) == set(spent.steps_by_rows)
    assert list(spent.seconds_by_activity()) == list(batching.STEPPER_ACTIVITIES)
    assert min(spent.decode_s, spent.jobs_s) > 0 and min(spent.gather_s, spent.idle_s, spent.packed_s) >= 0
    assert sum(spent.seconds_by_activity().values()) <= elapsed


def test_one_requests_stop_sequence_does_not_end_another(engine: PruningEngine, batcher: DecodeBatcher) -> None:
    plain = {"prompt": PROMPTS[2], "max_new_tokens": 12, "sensitivity": 0.0}
    alone = engine.generate(batcher=batcher, **plain)
    first_piece = alone.text[2:4]
    assert first_piece, "the answer must be long enough to stop inside"
    stopped_request = {**plain, "prompt": PROMPTS[2], "stop": [first_piece]}
    stopped, other = generate_together(engine, batcher, [stopped_request, {**plain, "prompt": PROMPTS[3]}])
    assert stopped.stats.finish_reason == "stop"
    assert other.stats.finish_reason == "length"
    assert other.token_ids == engine.generate(batcher=batcher, **{**plain, "prompt": PROMPTS[3]}).token_ids


def test_each_request_counts_its_own_rows_and_the_shares_add_up(engine: PruningEngine, batcher: DecodeBatcher,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [engine.render_prompt(p) for p in PROMPTS[:4]]
    plans = [ExecutionPlan(), *(engine.execution_plan(i, s, []) for i, s in zip(ids[1:], (0.5, 0.5, 1.0)))]
    alone = [engine.measure_decode(i, plan, 10, batcher=batcher) for i, plan in zip(ids, plans)]
    steps: list[ExecutionLedger] = []  # every decode step's counts, as the stepper counted them
    split = batching.split_ledger

    def counting_split(total: ExecutionLedger, ledgers: list[ExecutionLedger]) -> None:
        steps.append(total)
        split(total, ledgers)

    monkeypatch.setattr(batching, "split_ledger", counting_split)
    together: list = [None] * 4

    def run(index: int) -> None:
        torch.set_num_threads(1)
        together[index] = engine.measure_decode(ids[index], plans[index], 10, batcher=batcher)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    ledgers = [m.ledger for m in together]
    assert max(ledger.mean_batch_size for ledger in ledgers) > 1.0
    # the requests' decode counts are the steps' counts split: nothing lost, nothing counted twice
    for name in ("executed_flops", "dense_flops", "sparse_executed_flops", "sparse_dense_flops"):
        decode = sum(getattr(ledger, name) - (getattr(ledger, "prefill_" + name) or 0) for ledger in ledgers)
        assert decode == sum(getattr(step, name) for step in steps), name
    assert sum(step.dense_flops for step in steps) > 0
    for solo, shared in zip(alone, together):
        # every token's dense cost is the same whoever shares its step; what ran is at most that
        assert shared.ledger.dense_flops == solo.ledger.dense_flops
        assert 0 <= shared.ledger.executed_flops <= shared.ledger.dense_flops


def test_split_ledger_gives_equal_shares_that_add_up_exactly() -> None:
    total = ExecutionLedger(executed_flops=1001, dense_flops=3000, weight_bytes_read=7, sparse_dense_flops=10,
                            sparse_executed_flops=5, sparse_input_entries=9, sparse_kept_entries=4,
                            block_calls={0: 1, 1: 1}, block_bypasses={2: 1})
    rows = [ExecutionLedger(executed_flops=5) for _ in range(3)]
    split_ledger(total, rows)
    assert [r.executed_flops for r in rows] == [5 + 334, 5 + 334, 5 + 333]
    assert [r.dense_flops for r in rows] == [1000, 1000, 1000]
    assert [r.weight_bytes_read for r in rows] == [3, 2, 2]
    assert sum(r.sparse_kept_entries for r in rows) == 4
    assert all(r.block_calls == {0: 1, 1: 1} and r.block_bypasses == {2: 1} for r in rows)
    assert [(r.batched_steps, r.batch_rows, r.mean_batch_size) for r in rows] == [(1, 3, 3.0)] * 3


def test_the_batch_plan_prunes_no_request_more_than_it_asked() -> None:
    a = ExecutionPlan(layer_sparsity=(0.4, 0.0, 0.5), output_head_sparsity=0.6)
    b = ExecutionPlan(layer_sparsity=(0.3, 0.2, 0.5), output_head_sparsity=0.7)
    assert batch_plan([a], 3, sparse_rows=1) is a
    both = batch_plan([a, b], 3, sparse_rows=2)
    assert both.layer_sparsity == (0.3, 0.0, 0.5) and both.row_invariant
    assert both.output_head_sparsity == 0.6  # 2 rows x 0.4 of the head: still fewer bytes than the dense head
    assert batch_plan([a, b, a], 3, sparse_rows=4).output_head_sparsity == 0.0  # 3 x 0.4 >= 1: dense head
    dense = batch_plan([a, b], 3, sparse_rows=1)  # more rows than sparse_rows: dense
    assert not dense.skips_work and dense.row_invariant
    bypassing = replace(a, bypass=frozenset({1}))
    assert batch_key(bypassing) != batch_key(a)  # a bypassed block's cache is absent: never in one step
    assert batch_plan([bypassing, bypassing], 3, sparse_rows=1).bypass == frozenset({1})


def test_closing_a_stream_frees_its_place_in_the_steps(engine: PruningEngine, batcher: DecodeBatcher) -> None:
    stream = engine.stream(PROMPTS[0], max_new_tokens=20, sensitivity=0.0, batcher=batcher)
    next(stream), next(stream)
    assert batcher.decoding == 1
    stream.close()  # as the server does when the client goes away
    assert batcher.decoding == 0
    result = engine.generate(PROMPTS[1], max_new_tokens=3, sensitivity=0.0, batcher=batcher)
    assert len(result.token_ids) == 3


def test_the_stepper_runs_forward_passes_on_its_configured_threads(engine: PruningEngine) -> None:
    batcher = engine.new_batcher(4, threads=1)
    try:
        name, threads = batcher.run(lambda: (threading.current_thread().name, torch.get_num_threads()))
    finally:
        batcher.close()
    assert (name, threads) == ("prunewatch-step", 1)
    with pytest.raises(RuntimeError, match="closed"):
        batcher.run(lambda: None)
    with pytest.raises(ValueError):
        engine.new_batcher(0)


def test_served_concurrent_dense_requests_answer_as_they_do_alone(engine: PruningEngine) -> None:
    """Through `serve` with four workers (a batch limit of four): four concurrent clients at sensitivity 0 get the
    answers each gets alone from the same server."""
    app = create_app(engine, ServerSettings(workers=4, max_tokens_limit=32), registry=CollectorRegistry())
    headers = {"X-Pruning-Sensitivity": "0"}

    def ask(client: httpx.Client, prompt: str) -> str:
        response = client.post("/v1/completions", headers=headers, json={
            "model": engine.name, "prompt": prompt, "max_tokens": 12})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        alone = [ask(client, p) for p in PROMPTS[:4]]
        answers: list[str] = [""] * 4

        def run(index: int) -> None:
            answers[index] = ask(client, PROMPTS[index])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert answers == alone
    batcher = app.state.service.batcher
    assert batcher is not None and max(batcher.batch_sizes) >= 2


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_its_place_in_the_steps(engine: PruningEngine) -> None:
    app = create_app(engine, ServerSettings(workers=4, max_tokens_limit=480), registry=CollectorRegistry())
    body = {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 480, "stream": True}
    headers = {"X-Pruning-Sensitivity": "0"}
    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # the client goes away with the answer unfinished
        batcher = app.state.service.batcher
        queue = app.state.queue
        for _ in range(600):  # the server notices at its next token
            if batcher.decoding == 0 and queue.in_flight == 0:
                break
            threading.Event().wait(0.05)
        assert (batcher.decoding, queue.in_flight) == (0, 0)
        assert sum(batcher.batch_sizes.values()) < 479  # it stopped decoding before its length
        answer = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3}, headers=headers)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_requests_past_the_kv_budget_wait_for_room_and_answer_as_alone(engine: PruningEngine) -> None:
    """Through `serve` with a 1 MiB KV budget, room for two of these requests (prompt plus 40 tokens each) and not
    three: four concurrent clients decode at most two at a time, get the answers they get alone, and the
    reservation, published in /metrics, never passes the budget and goes back to 0."""
    app = create_app(engine, ServerSettings(workers=4, max_tokens_limit=64, kv_cache_mib=1), registry=CollectorRegistry())
    batcher = app.state.service.batcher
    needs = [batcher.kv_bytes_for(len(engine.render_prompt(p, None, None)) + 40) for p in PROMPTS[:4]]
    assert 2 * max(needs) <= 2**20 < 3 * min(needs)  # the premise: two fit, three do not
    headers = {"X-Pruning-Sensitivity": "0"}

    def ask(client: httpx.Client, prompt: str) -> str:
        response = client.post("/v1/chat/completions", headers=headers, json={
            "model": engine.name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        alone = [ask(client, p) for p in PROMPTS[:4]]
        assert batcher.kv_waits == 0 and batcher.kv_peak_bytes == max(needs)
        answers: list[str] = [""] * 4
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(client, PROMPTS[i])))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        metrics = client.get("/metrics").text
    assert answers == alone
    assert max(batcher.batch_sizes) == 2  # two shared steps, never three
    assert batcher.kv_waits >= 2 and batcher.kv_peak_bytes <= 2**20
    assert batcher.kv_reserved_bytes == 0
    assert f'prunewatch_kv_cache_budget_bytes{{model="{engine.name}"}} 1.048576e+06' in metrics
    assert f'prunewatch_kv_cache_reserved_bytes{{model="{engine.name}"}} 0.0' in metrics
    for rows, steps in batcher.batch_sizes.items():  # the stepper's counts, as scraped
        assert f'prunewatch_decode_steps_total{{model="{engine.name}",rows="{rows}"}} {float(steps)}' in metrics
    assert f'prunewatch_batcher_seconds_total{{activity="decode",model="{engine.name}"}}' in metrics
    spent = batcher.stepper_time()
    assert f'prunewatch_packed_passes_total{{model="{engine.name}"}} {float(spent.packed)}' in metrics
    assert f'prunewatch_packed_rows_total{{model="{engine.name}"}} {float(spent.packed_rows)}' in metrics


def test_a_request_that_alone_needs_more_than_the_kv_budget_is_refused(engine: PruningEngine) -> None:
    batcher = engine.new_batcher(2, kv_budget_bytes=50_000)  # a few positions of the probe model's cache
    try:
        with pytest.raises(KVBudgetError, match=r"need .* MiB of KV cache, more than the server's whole KV budget"):
            engine.generate(PROMPTS[0], max_new_tokens=20, sensitivity=0.0, batcher=batcher)
        assert batcher.kv_reserved_bytes == 0 and batcher.decoding == 0
    finally:
        batcher.close()
    app = create_app(engine, ServerSettings(workers=2, max_tokens_limit=400, kv_cache_mib=1),
                     registry=CollectorRegistry())
    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        too_long = client.post("/v1/completions", json={"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 200})
        fits = client.post("/v1/completions", json={"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 100})
    assert too_long.status_code == 400, too_long.text
    error = too_long.json()["error"]
    assert error["code"] == "kv_budget_exceeded" and "1.0 MiB" in error["message"]
    assert fits.status_code == 200, fits.text
