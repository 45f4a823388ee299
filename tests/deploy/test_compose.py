"""docker-compose.yml as compose would see it: valid, complete, and consistent with the files it mounts.

Docker does not run here, so each check reproduces what `docker compose up` would find out the
hard way: the compose-spec schema, every ${VARIABLE} documented in .env.example, every mounted
file present in the repository, and the Prometheus / Alertmanager configs it mounts accepted by
promtool / amtool with the container paths mapped back to the files compose mounts there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from importlib.resources import files
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml

from prunewatch.stack.configs import COLLECTOR_JOB, ENGINE_JOB
from tests.deploy.compose_env import (
    MissingVariables,
    interpolate,
    read_env_file,
    variables_used,
)

REPO = Path(__file__).resolve().parents[2]
COMPOSE_PATH = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
SECRETS_DIR = REPO / "deploy" / "secrets"

SERVICES = {"postgres", "migrate", "engine", "collector", "prometheus", "alertmanager", "grafana", "roi"}
ONE_SHOT = {"migrate"}  # runs `prunewatch db upgrade` and exits: no port, no healthcheck
REQUIRED = {"PRUNEWATCH_POSTGRES_PASSWORD", "PRUNEWATCH_GRAFANA_ADMIN_PASSWORD", "PRUNEWATCH_ROI_PASSWORD"}
# Services whose state must survive `docker compose down` and so write to a named volume.
STATEFUL = {"postgres": "/var/lib/postgresql/data", "prometheus": "/prometheus", "alertmanager": "/alertmanager",
            "grafana": "/var/lib/grafana", "collector": "/var/lib/prunewatch", "engine": "/var/lib/prunewatch/.cache"}
CONTAINER_PORTS = {"postgres": 5432, "engine": 8000, "collector": 9464, "prometheus": 9090, "alertmanager": 9093,
                   "grafana": 3000, "roi": 8501}


def _example_env() -> dict[str, str]:
    """.env.example with the required passwords filled, as a user's .env would be."""
    env = read_env_file(ENV_EXAMPLE)
    return {**env, **{name: f"test-{name.lower()}" for name in REQUIRED}}


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE_PATH.read_text())


@pytest.fixture(scope="module")
def compose(raw: dict) -> dict:
    """The file after compose's interpolation with the example .env."""
    return interpolate(raw, _example_env())


def _binds(service: dict) -> list[tuple[str, str]]:
    """(host source, container target) of every bind mount (short syntax); named volumes excluded."""
    out = []
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if source.startswith((".", "/")):
            out.append((source, target))
    return out


def _named_volumes(service: dict) -> dict[str, str]:
    return {target: source for source, target in (e.split(":")[:2] for e in service.get("volumes", []))
            if not source.startswith((".", "/"))}


def _secret_targets(service: dict, compose: dict) -> dict[str, Path]:
    """Container path -> host file of every secret the service mounts (short syntax: /run/secrets/NAME)."""
    out = {}
    for entry in service.get("secrets", []):
        name, target = (entry, None) if isinstance(entry, str) else (entry["source"], entry.get("target"))
        container = target if target and target.startswith("/") else f"/run/secrets/{target or name}"
        out[container] = REPO / compose["secrets"][name]["file"]
    return out


def _compose_schema() -> dict:
    """The compose-spec JSON schema as check-jsonschema vendors it (no network needed)."""
    try:
        vendor = files("check_jsonschema.builtin_schemas.vendor")
    except ModuleNotFoundError:
        pytest.fail("check-jsonschema is not installed (pip install 'check-jsonschema>=0.39,<1'): it ships the "
                    "compose-spec schema")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def test_compose_file_is_valid_compose_spec(raw, compose):
    schema = _compose_schema()
    validator = jsonschema.Draft202012Validator(schema)
    for document in (raw, compose):
        errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
        assert errors == [], [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_required_variables_stop_compose_until_set(raw):
    with pytest.raises(MissingVariables) as caught:
        interpolate(raw, read_env_file(ENV_EXAMPLE))
    assert caught.value.names == REQUIRED


def test_every_variable_is_documented_in_env_example(raw):
    used = variables_used(raw)
    lines = ENV_EXAMPLE.read_text().splitlines()
    documented = set(read_env_file(ENV_EXAMPLE))
    assert used == documented, {"undocumented": used - documented, "unused": documented - used}
    for index, line in enumerate(lines):
        if line and not line.startswith("#"):
            block = [previous for previous in lines[max(0, index - 8):index] if previous.strip()]
            assert any(p.startswith("#") and len(p) > 10 for p in block), f"no comment explains {line}"


def test_every_service_has_image_ports_volumes_and_healthcheck(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        assert service.get("image"), f"{name}: no image"
        if name in ONE_SHOT:
            assert service["restart"] == "no" and "healthcheck" not in service and "ports" not in service
            continue
        assert service["restart"] == "unless-stopped", name
        check = service.get("healthcheck", {})
        assert check.get("test") and check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: no healthcheck"
        assert check["start_period"] and check["interval"] and check["retries"] >= 3, name
        port = CONTAINER_PORTS[name]
        assert [int(spec.rsplit(":", 1)[1]) for spec in service["ports"]] == [port], (name, service["ports"])
        # The healthcheck asks the very port the service listens on (postgres: pg_isready's default 5432).
        assert name == "postgres" or f":{port}/" in " ".join(check["test"]), (name, check["test"])
    prunewatch = {n for n, s in services.items() if "build" in s}
    assert prunewatch == {"migrate", "engine", "collector", "roi"}
    assert {services[n]["image"] for n in prunewatch} == {"prunewatch:latest"}
    assert all(services[n]["build"]["context"] == "." for n in prunewatch)
    for name in SERVICES - prunewatch:  # third-party images are pinned, never :latest
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", services[name]["image"]) and not services[name]["image"].endswith(
            ":latest"), services[name]["image"]


def test_published_ports_bind_loopback_by_default(compose):
    for name in SERVICES - ONE_SHOT:
        (spec,) = compose["services"][name]["ports"]
        host, host_port, container_port = spec.split(":")
        assert host == "127.0.0.1" and int(container_port) == CONTAINER_PORTS[name], spec
        assert 1 <= int(host_port) <= 65535


def test_state_lives_in_named_volumes(compose):
    declared = set(compose["volumes"])
    for name, path in STATEFUL.items():
        volumes = _named_volumes(compose["services"][name])
        assert path in volumes, f"{name}: {path} is not on a named volume"
        assert volumes[path] in declared
    used = {v for s in compose["services"].values() for v in _named_volumes(s).values()}
    assert used == declared


def test_every_mounted_file_exists_in_the_repository(compose):
    mounted = []
    for name, service in compose["services"].items():
        for source, target in _binds(service):
            host = (REPO / source).resolve()
            assert host.exists(), f"{name}: {source} (mounted at {target}) is not in the repository"
            assert host.is_dir() == (PurePosixPath(target).suffix == ""), f"{name}: {source} vs {target}"
            mounted.append(host.relative_to(REPO).as_posix())
    assert sorted(mounted) == sorted([
        "prunewatch/engine/models/probe-llama", "deploy/collector/targets.yaml", "deploy/prometheus/prometheus.yml",
        "prunewatch/alerts/rules.yml", "prunewatch/alerts/alertmanager.yml", "prunewatch/dashboards/provisioning/datasources",
        "prunewatch/dashboards/provisioning/dashboards", "prunewatch/dashboards/json"])
    assert (REPO / "prunewatch/engine/models/probe-llama/config.json").is_file()
    assert sorted(p.name for p in (REPO / "prunewatch/dashboards/json").glob("*.json")) == [
        "prunewatch-engine.json", "prunewatch-history.json", "prunewatch-overview.json"]


def test_secrets_are_files_under_deploy_secrets_and_documented(compose):
    readme = (SECRETS_DIR / "README.md").read_text()
    assert set(compose["secrets"]) == {"engine_api_key", "slack_critical_webhook_url", "slack_warning_webhook_url"}
    for name, secret in compose["secrets"].items():
        path = (REPO / secret["file"]).resolve()
        assert path.parent == SECRETS_DIR, f"secret {name} outside deploy/secrets"
        assert f"`{path.name}`" in readme, f"deploy/secrets/README.md does not explain {path.name}"
    ignore = (SECRETS_DIR / ".gitignore").read_text().split()
    assert ignore[-3:] == ["*", "!.gitignore", "!README.md"]


def test_alertmanager_secrets_land_where_api_url_file_reads(compose):
    service = compose["services"]["alertmanager"]
    ((source, target),) = [b for b in _binds(service) if b[1].endswith(".yml")]
    assert f"--config.file={target}" in service["command"]
    config = yaml.safe_load((REPO / source).read_text())
    url_files = {c["api_url_file"] for r in config["receivers"] for c in r.get("slack_configs", [])}
    assert url_files == set(_secret_targets(service, compose)) == {
        "/etc/prunewatch/slack-critical-webhook-url", "/etc/prunewatch/slack-warning-webhook-url"}


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (apt-get install {package})")
    return path


def test_mounted_alertmanager_config_passes_amtool(compose):
    ((source, _),) = [b for b in _binds(compose["services"]["alertmanager"]) if b[1].endswith(".yml")]
    done = subprocess.run([_tool("amtool", "prometheus-alertmanager"), "check-config", str(REPO / source)],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout and " - 2 receivers" in done.stdout


def test_mounted_prometheus_config_passes_promtool_with_its_rules(compose, tmp_path):
    service = compose["services"]["prometheus"]
    mounts = {target: (REPO / source).resolve() for source, target in _binds(service)}
    for container, host in _secret_targets(service, compose).items():  # secrets are not in the repo: stand-ins
        stand_in = tmp_path / "secrets" / host.name
        stand_in.parent.mkdir(exist_ok=True)
        stand_in.write_text("stand-in\n")
        mounts[container] = stand_in
    config_path = next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(mounts[config_path].read_text())

    def host_path(container: str) -> str:
        assert container in mounts, f"prometheus.yml reads {container}, which compose does not mount"
        return str(mounts[container])

    config["rule_files"] = [host_path(p) for p in config["rule_files"]]
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = host_path(job["authorization"]["credentials_file"])
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    done = subprocess.run([_tool("promtool", "prometheus"), "check", "config", str(checked)],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = yaml.safe_load((REPO / "prunewatch" / "alerts" / "rules.yml").read_text())
    count = sum(len(group["rules"]) for group in rules["groups"])
    assert "SUCCESS: 1 rule files found" in done.stdout
    # 16 alerting (ratio, quality and latency rules each measured and fallback), 17 recording
    assert f"SUCCESS: {count} rules found" in done.stdout and count == 33


def test_prometheus_scrapes_the_compose_services(compose):
    service = compose["services"]["prometheus"]
    ((source, _),) = [b for b in _binds(service) if b[1] == "/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load((REPO / source).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {COLLECTOR_JOB, ENGINE_JOB} <= set(jobs)  # the local stack (prunewatch stack up) uses the same names
    assert jobs["prunewatch-collector"]["static_configs"] == [
        {"targets": [f"collector:{CONTAINER_PORTS['collector']}"]}]
    (dns,) = jobs["prunewatch-engine"]["dns_sd_configs"]
    assert dns["names"] == ["engine"] and dns["port"] == CONTAINER_PORTS["engine"]
    (alertmanagers,) = config["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"] == [{"targets": ["alertmanager:9093"]}]
    # Grafana derives $__rate_interval from its datasource's timeInterval: it must equal the scrape interval.
    datasources = yaml.safe_load((REPO / "prunewatch/dashboards/provisioning/datasources/prunewatch.yml").read_text())
    by_type = {d["type"]: d for d in datasources["datasources"]}
    assert by_type["prometheus"]["jsonData"]["timeInterval"] == config["global"]["scrape_interval"] == "15s"
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["grafana-postgresql-datasource"]["url"] == "postgres:5432"
    grafana_env = compose["services"]["grafana"]["environment"]
    assert grafana_env["PRUNEWATCH_POSTGRES_PASSWORD"] == "test-prunewatch_postgres_password"


def test_engine_key_reaches_engine_prometheus_and_collector(compose):
    services = compose["services"]
    key_path = "/run/secrets/engine_api_key"
    for name in ("engine", "collector", "prometheus"):
        assert key_path in _secret_targets(services[name], compose), name
    assert services["engine"]["environment"]["PRUNEWATCH_API_KEYS_FILE"] == key_path
    (script,) = services["collector"]["command"]
    assert services["collector"]["entrypoint"] == ["/bin/sh", "-c"]
    assert f'export PRUNEWATCH_TARGET_API_KEY="$(head -n 1 {key_path})"' in script  # $$ became $
    assert "exec prunewatch collect --config /etc/prunewatch/targets.yaml" in script


def test_collector_targets_point_at_the_engine_service(compose, monkeypatch):
    from prunewatch.collector.target_config import load_targets

    collector = compose["services"]["collector"]
    ((source, _),) = [b for b in _binds(collector) if b[1] == "/etc/prunewatch/targets.yaml"]
    monkeypatch.setenv("PRUNEWATCH_TARGET_API_KEY", "k")
    config = load_targets(REPO / source)
    (target,) = config.targets
    engine = compose["services"]["engine"]
    model_arg = engine["command"][engine["command"].index("--model") + 1]
    assert (target.kind, target.base_url, target.api_key()) == ("prunewatch", "http://engine:8000", "k")
    assert target.model == PurePosixPath(model_arg).name == read_env_file(ENV_EXAMPLE)["PRUNEWATCH_MODEL_NAME"]
    assert any(t.endswith(f":{model_arg}") for t in [v.rsplit(":", 1)[0] for v in engine["volumes"]])
    assert (config.collector.metrics_host, config.collector.metrics_port) == ("0.0.0.0", CONTAINER_PORTS["collector"])
    assert str(config.collector.buffer_path).startswith(STATEFUL["collector"] + "/")
    store_url = "postgresql+psycopg://prunewatch:test-prunewatch_postgres_password@postgres:5432/prunewatch"
    assert collector["environment"]["PRUNEWATCH_DB_URL"] == store_url
    assert compose["services"]["migrate"]["environment"]["PRUNEWATCH_DB_URL"] == store_url
    roi = compose["services"]["roi"]
    assert roi["environment"]["PRUNEWATCH_DB_URL"] == store_url and "--db" not in roi["command"]  # off `ps`


def test_start_order_waits_for_health_and_migrations(compose):
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("collector", "roi"):
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert services["collector"]["depends_on"]["engine"] == {"condition": "service_healthy"}
    assert services["migrate"]["command"] == ["db", "upgrade"]


def test_gpu_reservation_is_documented_but_off(raw):
    text = COMPOSE_PATH.read_text()
    assert "deploy" not in raw["services"]["engine"]
    block = re.search(r"# deploy:\n(\s*#.*\n)+", text).group(0)
    uncommented = yaml.safe_load(textwrap.dedent(re.sub(r"^(\s*)# ?", r"\1", block, flags=re.MULTILINE)))
    devices = uncommented["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_dockerfile_builds_what_compose_runs(compose):
    dockerfile = (REPO / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, flags=re.MULTILINE))
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"torch=={args["TORCH_VERSION"]}"' in pyproject
    assert args["TORCH_VARIANT"] == "cpu" and set(compose["services"]["engine"]["build"]["args"]) <= set(args)
    copied = re.findall(r"^COPY (\S+) \./\S*$", dockerfile, flags=re.MULTILINE)
    for source in copied:
        assert (REPO / source).exists(), source
    include = re.search(r"include = \[(.*?)\]", pyproject).group(1)
    packages = {p.strip(' "*').split(".")[0] for p in include.split(",")}
    assert packages <= set(copied), packages - set(copied)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", dockerfile, flags=re.MULTILINE).group(1).split()}
    assert exposed == {CONTAINER_PORTS[n] for n in ("engine", "collector", "roi")}
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv/", ".git/", "deploy/secrets/", ".env"} <= set(ignored)


def test_env_example_names_never_shadow_a_setting_by_accident(raw):
    """A .env variable named like a settings field must mean that field, in the container that reads it."""
    from pydantic_settings import BaseSettings

    from prunewatch.alerts.settings import AlertingSettings, RuleSettings
    from prunewatch.collector.fleet import FleetSettings
    from prunewatch.collector.settings import CollectorSettings
    from prunewatch.engine.settings import EngineSettings
    from prunewatch.roi.settings import RoiAppSettings
    from prunewatch.server.settings import ServerSettings
    from prunewatch.stack.settings import StackSettings

    setting_names: set[str] = set()
    classes: list[type[BaseSettings]] = [CollectorSettings, FleetSettings, EngineSettings, ServerSettings,
                                         RoiAppSettings, AlertingSettings, RuleSettings, StackSettings]
    for cls in classes:
        prefix = cls.model_config["env_prefix"]
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            setting_names.add(alias if isinstance(alias, str) else (prefix + name).upper())
    shadowing = set(read_env_file(ENV_EXAMPLE)) & setting_names
    assert shadowing == {"PRUNEWATCH_SERVER_WORKERS", "PRUNEWATCH_SERVER_KV_CACHE_MIB", "PRUNEWATCH_SERVER_QUEUE_DEPTH",
                         "PRUNEWATCH_SERVER_MAX_TOKENS_LIMIT", "PRUNEWATCH_ROI_PASSWORD",
                         "PRUNEWATCH_ENGINE_COMPILE_DECODE"}
    for name in shadowing:  # each is handed to a container under its own name, nothing else
        readers = [service for service, spec in raw["services"].items()
                   if str(spec.get("environment", {}).get(name, "")).startswith(f"${{{name}")]
        assert readers == (["roi"] if name.startswith("PRUNEWATCH_ROI_") else ["engine"]), (name, readers)
