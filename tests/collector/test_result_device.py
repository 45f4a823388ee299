"""Each result records where its timings were measured: device type and name, stored and read back."""

from __future__ import annotations

import httpx
import pytest
import torch
from sqlalchemy.orm import Session

from prunewatch.collector.exporters import SqlExporter
from prunewatch.collector.http_target import observation_from_response
from prunewatch.collector.probe_round import run_round
from prunewatch.engine.hardware import device_model_name, processor_name
from prunewatch.records.store import ResultRepository, connect, create_schema
from tests.collector.factories import PROBE
from tests.collector.prod_helpers import PROBES, FakeTarget


def test_in_process_results_carry_the_device_and_its_name_into_the_store(tmp_path):
    target = FakeTarget()  # its stats say device="cpu", as the engine's do on a CPU
    target.device_name = "Test CPU 9000"  # what InProcessTarget reads from the engine's device
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    create_schema(engine)
    summary = run_round(target, PROBES, [SqlExporter(engine)])
    with Session(engine) as session:
        stored = ResultRepository(session).list()
    assert len(stored) == len(PROBES.probes)
    assert {(r.device, r.device_name) for r in summary.results} == {("cpu", "Test CPU 9000")}
    assert {(r.device, r.device_name) for r in stored} == {("cpu", "Test CPU 9000")}
    engine.dispose()


def test_a_target_without_a_device_name_records_none():
    (result, *_) = run_round(FakeTarget(), PROBES, []).results
    assert (result.device, result.device_name) == ("cpu", None)


def test_cpu_device_label_is_the_processor_name():
    assert device_model_name(torch.device("cpu")) == processor_name()
    name = processor_name()
    assert name is None or (name.strip() == name and 0 < len(name) <= 128)


def _response(prunewatch: dict | None) -> httpx.Response:
    body = {"model": "m", "choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3}}
    if prunewatch is not None:
        body["prunewatch"] = prunewatch
    return httpx.Response(200, json=body)


@pytest.mark.parametrize("prunewatch, expected", [
    ({"pruning_ratio": 0.3, "device": "cuda", "device_name": "NVIDIA H200"}, ("cuda", "NVIDIA H200")),
    ({"pruning_ratio": 0.3, "device": "cpu"}, ("cpu", None)),  # today's engine sends the type only
    ({"pruning_ratio": 0.3}, (None, None)),
    (None, (None, None)),  # a baseline server (vLLM, TGI): nothing reported, nothing invented
    ({"device": 7, "device_name": ["x"]}, (None, None)),  # not text: not a device
    ({"device": "  cuda-with-a-very-long-name  ", "device_name": "G" * 300}, ("cuda-with-a-very", "G" * 128)),
])
def test_http_results_read_the_device_from_the_prunewatch_body(prunewatch, expected):
    observation = observation_from_response(_response(prunewatch), configured_model="m", requested_sensitivity=None)
    result = observation.to_result(target="remote", probe=PROBE, round_id="r" * 32, duration_ms=1.0)
    assert (result.device, result.device_name) == expected
