"""The governor over HTTP: a real `prunewatch serve` process, probed by the production collector, policy pushed.

Same model and engine settings as test_governor_inprocess.py (layer bypass and head gating on hard, calibrated on
the calibration set), on the two canonical `legal` prompts cut to 12 tokens, each answer scored by the engine
against its own weights run dense (X-Pruning-Quality): reference-scored agreement 1.0 and 0.75 at sensitivity 1.0,
1.0 and 1.0 from 0.0 to 0.1, so the floor is the default 0.95 and the first round breaches it. Probes ask for the
governed sensitivity with X-Pruning-Sensitivity; the collector pushes each new setting to PUT /v1/pruning/policy,
which live requests without that header then follow (a legal prompt is matched to the calibrated legal domain).
"""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from prunewatch.collector.fleet import FleetSettings, run_collector
from prunewatch.collector.governor import BREACH, RELAX, GovernorSettings, governed
from prunewatch.collector.http_target import HttpTarget
from prunewatch.collector.scheduler import TargetJob
from prunewatch.probes import ProbeSet, load_probes
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import connect
from prunewatch.records.store.governor import GovernorRepository
from tests.support.servers import prunewatch_serve

pytestmark = pytest.mark.integration

API_KEY = "sk-governor-test-key-0123456789"
FLOOR = 0.95
SETTINGS = GovernorSettings(floor=FLOOR, margin=0.02, step_down=1.0, step_up=0.05, relax_after=1,
                            decisive_prompts=2)
ROUNDS = 3
DOMAIN = "legal"
POLICY = "/v1/pruning/policy"


@pytest.fixture(scope="module")
def server(probe_model_dir, calibration_dir):
    """`prunewatch serve` at sensitivity 1.0, pruning hard, with one API key; yields (base URL, path of its log)."""
    env = {"PRUNEWATCH_API_KEYS": API_KEY, "PRUNEWATCH_ENGINE_INFLUENCE_BUDGET": "0.5",
           "PRUNEWATCH_ENGINE_HEAD_GATING": "true", "PRUNEWATCH_ENGINE_HEAD_BUDGET": "0.1"}
    with prunewatch_serve(probe_model_dir, args=("--sensitivity", "1.0"), env=env,
                          calibration_dir=calibration_dir) as served:
        yield served


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_policy_endpoint_needs_a_key_and_checks_ranges(server):
    base, _ = server
    assert httpx.get(f"{base}{POLICY}").status_code == 401
    assert httpx.put(f"{base}{POLICY}", json={"domains": {"tech": 0.5}}).status_code == 401
    assert httpx.put(f"{base}{POLICY}", json={"domains": {"tech": 0.5}}, headers=auth("sk-wrong")).status_code == 401
    bad = httpx.put(f"{base}{POLICY}", json={"domains": {"tech": 1.5}}, headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "domains.tech"
    unknown = httpx.put(f"{base}{POLICY}", json={"domains": {"cooking": 0.5}}, headers=auth())
    assert unknown.status_code == 400 and "not calibrated on domain 'cooking'" in unknown.json()["error"]["message"]
    assert httpx.put(f"{base}{POLICY}", json={"tech": 0.5}, headers=auth()).status_code in (400, 422)


def test_governor_over_http_pushes_the_policy_live_traffic_follows(server, tmp_path):
    base, log = server
    probes = ProbeSet(tuple(replace(p, max_tokens=12) for p in load_probes().by_domain()[DOMAIN]), "governor http test")
    http = HttpTarget(name="serve", base_url=base, model="probe-llama", api_key=API_KEY, sensitivity=1.0,
                      timeout_s=120)
    (target,) = governed([http], {"serve": SETTINGS})
    metrics = CollectorMetrics(CollectorRegistry())
    url = f"sqlite:///{tmp_path / 'governed.db'}"
    outcome = run_collector(FleetSettings(db_url=url, buffer_path=tmp_path / "buffer.sqlite", rounds=ROUNDS,
                                          metrics_port=0), [TargetJob(target, probes, interval_s=1.0, timeout_s=120)],
                            metrics=metrics)
    assert (outcome.rounds, outcome.failures) == (ROUNDS, 0)
    store = connect(url)
    with Session(store) as session:
        decisions = GovernorRepository(session).history(target="serve")
    store.dispose()
    trail = [(d.old_setting, d.reason, d.new_setting) for d in decisions]
    assert decisions[0].agreement < FLOOR and trail[0] == (1.0, BREACH, 0.0), trail
    assert decisions[1].agreement >= FLOOR, trail  # back at the floor in the next round
    assert trail[1:] == [(0.0, RELAX, 0.05), (0.05, RELAX, 0.1)], trail
    labels = {"target": "serve", "domain": DOMAIN}
    assert metrics.registry.get_sample_value("prunewatch_governor_clamps_total", labels) == 1.0

    # The engine holds the last pushed policy, set by the collector's key (shown as a fingerprint only).
    policy = httpx.get(f"{base}{POLICY}", headers=auth()).json()
    assert policy["domains"] == {DOMAIN: 0.1} and policy["updated_by"].startswith("sha256:")

    # Live traffic: without X-Pruning-Sensitivity a legal prompt runs at the policy's 0.1 (the server's
    # default is 1.0); an explicit header still wins.
    prompt = probes.probes[0]
    body = {"model": "probe-llama", "max_tokens": 2,
            "messages": [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.prompt}]}
    plain = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth(), timeout=120).json()["prunewatch"]
    assert (plain["domain"], plain["sensitivity"]) == (DOMAIN, 0.1)
    explicit = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120,
                          headers={**auth(), "X-Pruning-Sensitivity": "1.0"}).json()["prunewatch"]
    assert explicit["sensitivity"] == 1.0

    # Audited: who (a key fingerprint) and what, in the server's log; the key itself never.
    text = log.read_text()
    changes = [line for line in text.splitlines() if "pruning policy changed by key sha256:" in line]
    assert len(changes) == ROUNDS and "{'legal': 0.05} -> {'legal': 0.1}" in changes[-1], changes
    assert API_KEY not in text
    assert json.loads(json.dumps(policy))["updated_by"] in changes[-1]
