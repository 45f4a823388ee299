"""Counting without a per-linear tax: blocks count their linears, kernels report what they skipped,
and nothing hooks the linear layers on the decode path; PruningEngine.measure_decode for benchmarks."""

from __future__ import annotations

import pytest

from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.execution import (
    ExecutionLedger,
    ExecutionPlan,
    _linear_flops_per_row,
    executing,
    record_skipped_work,
)
from tests.engine.sparse_oracle import hook_count, oracle_ratio


def test_no_linear_inside_a_block_carries_a_hook(probe_engine):
    linears = [m for b in probe_engine.instrumented.blocks for m in b.block.modules()
               if _linear_flops_per_row(m) is not None]
    assert linears and not any(m._forward_hooks or m._forward_pre_hooks for m in linears)
    head = probe_engine.loaded.model.get_output_embeddings()
    assert len(head._forward_hooks) == 1  # one call per forward pass: the head's work


def test_blocks_count_the_linears_their_forward_calls(probe_engine):
    for block in probe_engine.instrumented.blocks:
        assert 0 < block.executed_flops_per_row <= block.dense_flops_per_row
        assert block.weight_bytes == block.executed_flops_per_row // 2 * 4  # fp32, one read per call


def test_skipped_work_comes_off_the_active_ledger_only():
    record_skipped_work(10, 10)  # no execution active: nothing to count into, nothing raised
    ledger = ExecutionLedger(executed_flops=100, dense_flops=100, weight_bytes_read=50)
    with executing(ExecutionPlan(), ledger):
        record_skipped_work(30, 20)
    assert (ledger.executed_flops, ledger.weight_bytes_read) == (70, 30)
    assert ledger.pruning_ratio == pytest.approx(0.3)


def test_measure_decode_runs_a_fixed_length_and_counts_decode_bytes(probe_engine):
    ids = probe_engine.render_prompt("Show the routing table.")
    model = probe_engine.loaded.model
    with hook_count(probe_engine.instrumented) as count:
        measured = probe_engine.measure_decode(ids, ExecutionPlan(), 5)
    assert len(measured.tokens) == 5 and measured.decode_tokens_per_s > 0
    ledger = measured.ledger
    assert ledger.executed_flops == ledger.dense_flops == count["executed"] == count["dense"]
    assert oracle_ratio(count) == ledger.pruning_ratio == 0.0
    linears = sum(p.numel() * p.element_size() for b in probe_engine.instrumented.blocks
                  for n, p in b.block.named_parameters() if p.dim() == 2 and n.endswith("weight"))
    head = model.get_output_embeddings().weight
    weights_per_step = linears + head.numel() * head.element_size()
    kv_of_decode = ledger.decode_bytes_read - 4 * weights_per_step  # 4 decode steps, each reads every weight once
    assert 0 < kv_of_decode < ledger.kv_bytes_read
    with pytest.raises(InvalidRequestError):
        probe_engine.measure_decode(ids, ExecutionPlan(), 1)
