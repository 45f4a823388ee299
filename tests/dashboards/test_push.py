"""`prunewatch dashboards push` speaks Grafana's documented HTTP API, is idempotent, and fails clearly.

The server is tests/dashboards/fake_grafana.py (no Grafana installs from the package registries
here); it checks paths, payload shapes and the Authorization header against the documentation.
"""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from prunewatch.commands.dashboards import export_command, push_command
from prunewatch.dashboards import build_dashboards
from prunewatch.dashboards.push import (
    PUSH_MESSAGE,
    GrafanaPushError,
    PushSettings,
    push_dashboards,
)
from prunewatch.dashboards.settings import DashboardSettings
from tests.dashboards.fake_grafana import fake_grafana

UIDS = ["prunewatch-overview", "prunewatch-engine", "prunewatch-history"]


def _settings(grafana, **overrides) -> PushSettings:
    values = dict(url=grafana.url, token=grafana.token, folder="prunewatch", timeout_s=5.0)
    values.update(overrides)
    return PushSettings(**values)


def test_first_push_creates_folder_and_dashboards_with_documented_requests():
    with fake_grafana() as grafana:
        report = push_dashboards(_settings(grafana))
    assert grafana.violations == []
    assert (report.grafana_version, report.folder_uid, report.folder_created) == ("11.3.1", "prunewatch", True)
    assert (report.created, report.updated, report.unchanged) == (UIDS, [], [])
    expected = [("GET", "/api/health"), ("GET", "/api/folders"), ("POST", "/api/folders")]
    for uid in UIDS:
        expected += [("GET", f"/api/dashboards/uid/{uid}"), ("POST", "/api/dashboards/db")]
    assert grafana.calls() == expected
    authenticated = [r for r in grafana.requests if r.path != "/api/health"]
    assert {r.authorization for r in authenticated} == {f"Bearer {grafana.token}"}
    assert grafana.requests[2].body == {"title": "prunewatch", "uid": "prunewatch"}
    posts = [r for r in grafana.requests if r.path == "/api/dashboards/db"]
    generated = build_dashboards()
    for post, dashboard in zip(posts, generated.values()):
        assert post.content_type.startswith("application/json")
        assert post.body == {"dashboard": dashboard, "folderUid": "prunewatch", "overwrite": True,
                             "message": PUSH_MESSAGE}
    assert {uid: d["folderUid"] for uid, d in grafana.dashboards.items()} == dict.fromkeys(UIDS, "prunewatch")


def test_second_push_changes_nothing_and_a_changed_dashboard_is_overwritten():
    with fake_grafana() as grafana:
        push_dashboards(_settings(grafana))
        before = len(grafana.requests)
        again = push_dashboards(_settings(grafana))
        second_calls = grafana.calls()[before:]
        changed = build_dashboards(DashboardSettings(gpu_usd_per_hour=4.0))
        third = push_dashboards(_settings(grafana), changed)
        versions = {uid: d["dashboard"]["version"] for uid, d in grafana.dashboards.items()}
    assert grafana.violations == []
    assert (again.folder_created, again.created, again.updated, again.unchanged) == (False, [], [], UIDS)
    assert [c for c in second_calls if c[0] == "POST"] == []
    # only the overview carries the GPU price (a dashboard variable); the others stay untouched
    assert (third.created, third.updated, third.unchanged) == ([], ["prunewatch-overview"],
                                                               ["prunewatch-engine", "prunewatch-history"])
    assert versions == {"prunewatch-overview": 2, "prunewatch-engine": 1, "prunewatch-history": 1}


def test_existing_folder_with_the_title_is_reused():
    with fake_grafana() as grafana:
        grafana.folders["abc123"] = {"id": 7, "uid": "abc123", "title": "Model observability"}
        report = push_dashboards(_settings(grafana, folder="Model observability"))
    assert grafana.violations == []
    assert (report.folder_uid, report.folder_created) == ("abc123", False)
    assert ("POST", "/api/folders") not in grafana.calls()


def test_sub_path_deployment_uses_the_prefixed_api():
    with fake_grafana(prefix="/grafana") as grafana:
        report = push_dashboards(_settings(grafana))
    assert grafana.violations == [] and report.created == UIDS
    assert all(path.startswith("/grafana/api/") for _method, path in grafana.calls())


def test_wrong_token_is_a_clear_401_error_and_writes_nothing():
    with fake_grafana() as grafana, pytest.raises(GrafanaPushError) as error:
        push_dashboards(_settings(grafana, token="wrong"))
    assert str(error.value) == (f"Grafana at {grafana.url} rejected the token (401) while trying to list folders: "
                                "set GRAFANA_TOKEN to a valid service-account token")
    assert grafana.calls() == [("GET", "/api/health"), ("GET", "/api/folders")]


def test_wrong_url_is_a_clear_404_error():
    with fake_grafana(prefix="/grafana") as grafana:
        root = grafana.url.removesuffix("/grafana")
        with pytest.raises(GrafanaPushError) as error:
            push_dashboards(_settings(grafana, url=root))
    assert str(error.value) == (f"Grafana at {root} answered 404 while trying to read its health and version: "
                                "check --url (include the sub-path if Grafana is served under one)")
    assert grafana.calls() == [("GET", "/api/health")]


@pytest.mark.parametrize("version", ["9.5.2", "10.2.2", "13.0.0"])
def test_unsupported_grafana_version_is_refused_before_any_write(version):
    with fake_grafana(version=version) as grafana, pytest.raises(GrafanaPushError) as error:
        push_dashboards(_settings(grafana))
    assert str(error.value) == (f"Grafana {version} at {grafana.url} is not supported: these dashboards use the "
                                "classic JSON model that Grafana 10.2.3 up to (not including) 13.0 import")
    assert grafana.calls() == [("GET", "/api/health")]


@pytest.mark.parametrize("version", ["10.2.3", "12.0.0+security-01", "11.0.0-preview"])
def test_supported_versions_are_accepted(version):
    with fake_grafana(version=version) as grafana:
        assert push_dashboards(_settings(grafana)).created == UIDS


def test_health_without_version_is_refused():
    with fake_grafana(version=None) as grafana, pytest.raises(
            GrafanaPushError, match="without a version: either --url is not a Grafana"):
        push_dashboards(_settings(grafana))
    assert grafana.calls() == [("GET", "/api/health")]


def test_precondition_failure_names_grafanas_reason():
    with fake_grafana(plugin_owned={"prunewatch-engine"}) as grafana, pytest.raises(GrafanaPushError) as error:
        push_dashboards(_settings(grafana))
    assert str(error.value) == ("Grafana refused to save dashboard prunewatch-engine (plugin-dashboard): "
                                "The dashboard belongs to plugin Example")


def test_unreachable_grafana_is_a_clear_error():
    with fake_grafana() as grafana:
        url = grafana.url
    with pytest.raises(GrafanaPushError) as error:  # the server is gone: connection refused
        push_dashboards(PushSettings(url=url, token="t", timeout_s=2.0))
    assert str(error.value).startswith(f"cannot reach Grafana at {url} to read its health and version: ")


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("export")(export_command)
    app.command("push")(push_command)
    return app


def test_push_command_reads_the_token_from_the_environment(monkeypatch):
    runner = CliRunner()
    with fake_grafana() as grafana:
        monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
        missing = runner.invoke(_app(), ["push", "--url", grafana.url])
        monkeypatch.setenv("GRAFANA_TOKEN", grafana.token)
        ok = runner.invoke(_app(), ["push", "--url", grafana.url])
        monkeypatch.setenv("GRAFANA_TOKEN", "expired")
        denied = runner.invoke(_app(), ["push", "--url", grafana.url])
    assert missing.exit_code == 2
    assert missing.stderr == "error: set GRAFANA_TOKEN to a Grafana service-account token (Editor role)\n"
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == "Grafana 11.3.1: folder prunewatch (created); created 3, updated 0, unchanged 0\n"
    assert denied.exit_code == 2 and "rejected the token (401)" in denied.stderr
    assert "expired" not in denied.stderr and grafana.violations == []


def test_push_command_rejects_a_non_http_url(monkeypatch):
    monkeypatch.setenv("GRAFANA_TOKEN", "t")
    result = CliRunner().invoke(_app(), ["push", "--url", "localhost:3000"])
    assert result.exit_code == 2
    assert result.stderr == ("error: --url must be an http(s) URL such as http://localhost:3000, "
                             "got 'localhost:3000'\n")
