"""The local stack end to end: `stack up` as a user runs it, data flowing through every service, `stack down`.

One real run: PostgreSQL, two engine servers, the collector probing both, Prometheus scraping
all three, Alertmanager posting to the local Slack sink, the ROI app. Kept short (two 8-token
probes, 3 s rounds, 1 s scrapes) because it is the most expensive test of the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from prunewatch.services import LocalPostgres
from prunewatch.stack.configs import COLLECTOR_JOB, ENGINE_JOB
from prunewatch.stack.slack_sink import read_messages

pytestmark = pytest.mark.integration

PROBES = Path(__file__).resolve().parent / "stack_probes.yaml"
ENGINES = ("engine-a", "engine-b")
SERVICES = {"postgres", "prometheus", "alertmanager", "slack-sink", "roi", "collector", *ENGINES}


def _poll(what: str, probe: Callable[[], Any], timeout_s: float = 60.0, poll_s: float = 0.5) -> Any:
    """The first truthy value of `probe()`; fails the test naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except OSError as exc:  # a server between two states
            last = exc
        if last:
            return last
        time.sleep(poll_s)
    pytest.fail(f"{what} not seen within {timeout_s}s (last: {last!r})")


def _promql(base: str, query: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def _stack(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prunewatch.stack", *args], check=False, capture_output=True,
                          text=True, timeout=timeout_s)


def _gone(record: dict) -> bool:
    """The recorded process exited (a zombie awaiting its parent counts as exited) and left no group member."""
    try:
        process = psutil.Process(record["pid"])
        if abs(process.create_time() - record["create_time"]) <= 1.0 and process.status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        pass
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.info["pid"]) == record["pid"]:
                return False
        except (ProcessLookupError, psutil.Error):
            continue
    return True


def _kill_leftovers(records: list[dict]) -> None:
    """Last resort after a failed `stack down`, so one failure does not leak servers into the next tests."""
    for record in records:
        try:
            os.killpg(record["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_stack_up_probes_both_engines_into_postgres_and_prometheus_then_down(probe_model_dir, calibration_dir,
                                                                             collected_sqlite):
    # collected_sqlite ran the default engine with calibration_dir: both engines load that calibration instead
    # of calibrating at once on two shared cores (the subject here is the stack, not calibration time).
    # Under /tmp and created by `stack up` itself (mode 755): the postgres system user must reach it.
    state_dir = Path(tempfile.gettempdir()) / f"prunewatch-stack-test-{uuid.uuid4().hex[:8]}"
    records: list[dict] = []
    try:
        up = _stack("up", "--state-dir", str(state_dir), "--model", str(probe_model_dir), "--probes", str(PROBES),
                    "--interval", "3", "--baseline-every", "1", "--scrape-interval", "1", "--alert-group-wait", "1",
                    "--calibration-dir", str(calibration_dir), "--start-timeout", "240", timeout_s=420)
        state = json.loads((state_dir / "stack.json").read_text()) if (state_dir / "stack.json").exists() else {}
        records = state.get("services", [])
        assert up.returncode == 0, up.stderr[-3000:]
        services = {record["name"]: record for record in records}
        assert set(services) == SERVICES
        ports = state["ports"]
        assert len(set(ports.values())) == len(ports) == len(SERVICES)  # one free port each, recorded
        for name, record in services.items():
            assert (state_dir / "pids" / f"{name}.pid").read_text() == f"{record['pid']}\n"
            assert Path(record["log"]).is_file() and Path(record["log"]).parent == state_dir / "logs"
            if name != "postgres":
                assert f"  {name:<13} {record['url']}\n" in up.stdout  # the URLs are printed
        store_line = f"  postgres      postgresql+psycopg://prunewatch:***@127.0.0.1:{ports['postgres']}/prunewatch\n"
        assert store_line in up.stdout  # the store's URL is printed with its password masked

        again = _stack("up", "--state-dir", str(state_dir), timeout_s=120)  # one stack per state dir
        assert again.returncode == 1
        assert again.stderr.startswith(f"error: a stack is already running from {state_dir} (")

        # Prometheus scrapes both engines (discovered from the file_sd file) and the collector.
        prometheus = services["prometheus"]["url"]

        def all_up() -> dict | None:
            series = _promql(prometheus, "up")
            seen = {(s["metric"]["job"], s["metric"].get("engine", "")): s["value"][1] for s in series}
            expected = {(COLLECTOR_JOB, ""), *((ENGINE_JOB, name) for name in ENGINES)}
            return seen if set(seen) == expected and set(seen.values()) == {"1"} else None

        up_series = _poll("up == 1 for the collector and both engines", all_up)
        assert len(up_series) == 3
        engine_instances = {s["metric"]["engine"]: s["metric"]["instance"]
                            for s in _promql(prometheus, f'up{{job="{ENGINE_JOB}"}}')}
        assert engine_instances == {name: f"127.0.0.1:{ports[name]}" for name in ENGINES}

        # The collector's own metrics, scraped by Prometheus, name both engines as succeeding targets.
        last_success = f'prunewatch_last_success_timestamp_seconds{{job="{COLLECTOR_JOB}"}}'
        success = _poll("last-success samples of both targets", lambda: {
            s["metric"]["target"] for s in _promql(prometheus, last_success)} == set(ENGINES))
        assert success is True

        # PostgreSQL holds a probe result of every probe from each engine.
        store = LocalPostgres(state_dir / "postgres", ports["postgres"])
        from sqlalchemy import text

        from prunewatch.records.store import connect

        engine = connect(store.url)
        probe_ids = [p["id"] for p in yaml.safe_load(PROBES.read_text())["probes"]]

        def first_results() -> dict | None:
            with engine.connect() as connection:
                rows = connection.execute(text(
                    "SELECT DISTINCT ON (target, probe_id) target, probe_id, model, sensitivity, pruning_ratio, "
                    "prefill_pruning_ratio, decode_pruning_ratio, ratio_source, layers_total, executed_flops, "
                    "dense_flops, completion_tokens, output_text, reference_agreement, reference_tokens, served_nll, quality_ms "
                    "FROM probe_results WHERE status = 'ok' AND NOT baseline ORDER BY target, probe_id, created_at")
                ).mappings().all()
            found = {(r["target"], r["probe_id"]): dict(r) for r in rows}
            return found if set(found) == {(t, p) for t in ENGINES for p in probe_ids} else None

        try:
            results = _poll("an ok result of each probe from each engine in PostgreSQL", first_results)
            with engine.connect() as connection:  # quality over HTTP: every ok row, not only the first ones
                unscored = connection.execute(text(
                    "SELECT count(*) FROM probe_results WHERE status = 'ok' AND NOT baseline AND (reference_agreement "
                    "IS NULL OR served_nll IS NULL OR quality_ms IS NULL)")).scalar_one()
                scored = connection.execute(text(
                    "SELECT count(*) FROM probe_results WHERE status = 'ok' AND NOT baseline")).scalar_one()
        finally:
            engine.dispose()
        assert scored >= len(ENGINES) * len(probe_ids) and unscored == 0
        layers = json.loads((probe_model_dir / "config.json").read_text())["num_hidden_layers"]
        for (target, probe_id), row in results.items():
            assert (row["model"], row["sensitivity"], row["ratio_source"], row["layers_total"]) == (
                probe_model_dir.name, 0.5, "measured", layers), (target, probe_id)
            assert 0.0 < row["pruning_ratio"] < 1.0
            assert row["pruning_ratio"] == pytest.approx(1 - row["executed_flops"] / row["dense_flops"], abs=1e-6)
            assert 1 <= row["completion_tokens"] <= 8
            # The served answer, scored against the dense model (reference-scored agreement and its NLL).
            assert 0.0 <= row["reference_agreement"] <= 1.0 and row["quality_ms"] > 0.0 and row["served_nll"] >= 0.0
            assert 1 <= row["reference_tokens"] <= row["completion_tokens"]
            assert 0.0 <= row["prefill_pruning_ratio"] <= 1.0 and 0.0 <= row["decode_pruning_ratio"] <= 1.0
        for probe_id in probe_ids:  # same model, calibration and greedy decoding: the engines agree exactly
            a, b = results[("engine-a", probe_id)], results[("engine-b", probe_id)]
            assert (a["pruning_ratio"], a["output_text"], a["completion_tokens"]) == (
                b["pruning_ratio"], b["output_text"], b["completion_tokens"])

        # Dense baselines run on the same engines (every round here): the pruned-vs-dense panel's two
        # series exist for each target, each from its own runs, and the client timed every stream.
        def pruned_and_dense() -> dict | None:
            collector = f'{{job="{COLLECTOR_JOB}"}}'
            found = {name: {s["metric"].get("target") for s in _promql(prometheus, f"{name}_count{collector}")}
                     for name in ("prunewatch_inference_latency_seconds", "prunewatch_dense_inference_latency_seconds",
                                  "prunewatch_client_time_to_first_token_seconds")}
            return found if all(targets == set(ENGINES) for targets in found.values()) else None

        assert _poll("pruned and dense latency series of both engines", pruned_and_dense, timeout_s=90)

        # The dashboards' quality panels read data: the windowed reference-scored agreement, its interval's low
        # bound and the prompts behind it, expanded as Grafana would with every model and domain selected.
        from prunewatch.dashboards import promql as dashboard_promql

        def agreement_series() -> dict | None:
            found = {query: _promql(prometheus, query.replace("$model", ".*").replace("$domain", ".*"))
                     for query in (dashboard_promql.reference_agreement("estimate"),
                                   dashboard_promql.reference_agreement("low"), dashboard_promql.reference_agreement_prompts())}
            return found if all(found.values()) else None

        agreement = _poll("the dashboards' agreement queries return data", agreement_series, timeout_s=90)
        estimate, low, prompts = agreement.values()
        assert all(0.0 <= float(s["value"][1]) <= 1.0 for s in estimate + low)
        assert all(float(s["value"][1]) >= 1 for s in prompts)

        # Prometheus -> Alertmanager -> "Slack": ProbeDataAbsent fired before the first probe result
        # and was routed to the critical channel's webhook.
        sink_log = state_dir / "slack-messages.jsonl"
        messages = _poll("a Slack message in the sink", lambda: [
            m for m in read_messages(sink_log) if "ProbeDataAbsent" in m["body"].get("text", "")
            + json.dumps(m["body"].get("attachments", []))], timeout_s=30)
        assert messages[0]["path"] == "/slack-critical-webhook-url"
        assert json.dumps(messages[0]["body"]).count("FIRING") >= 1

        # The ROI app answers on its URL.
        with urllib.request.urlopen(services["roi"]["url"] + "/_stcore/health", timeout=5) as response:
            assert response.read() == b"ok"
    finally:
        down = _stack("down", "--state-dir", str(state_dir), "--stop-timeout", "20", timeout_s=180) \
            if (state_dir / "stack.json").exists() else None
        if down is None or down.returncode != 0:
            _kill_leftovers(records)
    assert down is not None and down.returncode == 0, down.stderr if down else "no stack state"
    assert down.stdout.startswith(f"stopped {len(SERVICES)} service(s)")
    leftovers = [r["name"] for r in records if not _gone(r)]
    assert leftovers == []
    assert not (state_dir / "stack.json").exists() and list((state_dir / "pids").iterdir()) == []
    again = _stack("down", "--state-dir", str(state_dir), timeout_s=60)  # nothing is recorded any more: a no-op
    assert (again.returncode, again.stdout.startswith(f"nothing to stop: no stack state in {state_dir}")) == (0, True)
    shutil.rmtree(state_dir, ignore_errors=True)


def test_a_service_that_fails_to_start_is_named_and_nothing_is_left_running(probe_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    shutil.copy(probe_model_dir / "config.json", broken / "config.json")  # passes the settings check, has no weights
    state_dir = Path(tempfile.gettempdir()) / f"prunewatch-stack-test-{uuid.uuid4().hex[:8]}"
    try:
        up = _stack("up", "--state-dir", str(state_dir), "--model", str(broken), "--engines", "1",
                    "--start-timeout", "60", timeout_s=180)
        assert up.returncode == 1, up.stderr[-2000:]
        error = up.stderr.strip().splitlines()[-1]
        assert error.startswith("error: engine-a exited before answer http://127.0.0.1:"), error
        assert f"; log: {state_dir / 'logs' / 'engine-a.log'} (last line: " in error
        assert "stopping what had started" in up.stderr
        assert not (state_dir / "stack.json").exists()
        started = [line.split("(pid ")[1].rstrip(")") for line in up.stderr.splitlines() if "(pid " in line]
        assert len(started) == 5  # postgres, alertmanager, slack sink, engine-a, prometheus
        for pid in map(int, started):
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
