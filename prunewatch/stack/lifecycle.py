"""`stack up` and `stack down`: the compose topology as local processes, started in dependency order.

Order, and why: PostgreSQL, Alertmanager, the Slack sink and the first engine start together
(independent); Prometheus follows as soon as Alertmanager answers, so its first alerts are not
dropped; the schema is migrated once PostgreSQL answers; engines start one after the other,
because each calibrates into the same cache on first start; the ROI app needs the migrated
schema; the collector starts last, when every engine it probes answers. Every wait is bounded and
a failure names the service and its log, after stopping whatever had started.
"""

from __future__ import annotations

import os
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prunewatch.records.settings import STORE_URL_ENV
from prunewatch.services import (
    ALERTMANAGER_BINARIES,
    PROMETHEUS_BINARIES,
    LocalPostgres,
    ProcessRecord,
    ServiceError,
    find_binary,
    free_port,
    is_running,
    launch,
    stop,
    wait_for_http,
    wait_until,
)
from prunewatch.stack import configs
from prunewatch.stack.settings import StackSettings
from prunewatch.stack.state import NoStackStateError, Service, StackState, StateError

# The order `stack up` lists the services in.
DISPLAY_ORDER = ("postgres", "engine-", "collector", "prometheus", "alertmanager", "slack-sink", "roi")
# Stopped in this order: readers and writers of the store first, PostgreSQL last.
STOP_PHASES = (("roi", "collector"), ("engine-", "prometheus", "alertmanager", "slack-sink"), ("postgres",))


class StackError(RuntimeError):
    """The stack could not be started or stopped; one line naming the service and its log."""


@dataclass(frozen=True)
class DownReport:
    stopped: list[str]  # services that were running and are gone now
    killed: list[str]  # of those, the ones that needed SIGKILL after stop_timeout_s
    already_gone: list[str]  # recorded but not running any more
    nothing_recorded: str | None = None  # why there was nothing to stop (no stack state in the dir)


def _matches(name: str, pattern: str) -> bool:
    """`engine-` stands for every engine; other patterns are exact names."""
    return name.startswith(pattern) if pattern.endswith("-") else name == pattern


def display_rank(name: str) -> tuple[int, str]:
    """Sort key listing services in DISPLAY_ORDER (engines by name)."""
    ranks = [i for i, pattern in enumerate(DISPLAY_ORDER) if _matches(name, pattern)]
    return (ranks[0] if ranks else len(DISPLAY_ORDER), name)


def engine_names(count: int) -> list[str]:
    return [f"engine-{letter}" for letter in string.ascii_lowercase[:count]]


def _child_env(**extra: str) -> dict[str, str]:
    """This process's environment without variables that would change what the services are told."""
    env = {k: v for k, v in os.environ.items() if k not in ("PRUNEWATCH_API_KEYS", "PRUNEWATCH_API_KEYS_FILE")}
    env.update(extra)
    return env


def _previous(state_dir: Path) -> StackState | None:
    try:
        return StackState.load(state_dir)
    except StateError:
        return None


def stack_up(settings: StackSettings, progress: Callable[[str], None] | None = None) -> StackState:
    """Start every service; return the state (ports, pids, URLs). StackError, with nothing left running, on failure."""
    def say(message: str) -> None:
        if progress is not None:
            try:
                progress(message)
            except OSError:  # a closed terminal must not stop the start, nor the clean-up
                pass

    state_dir = settings.state_dir.resolve()
    previous = _previous(state_dir)
    if previous is not None:
        alive = [s.record.name for s in previous.services if is_running(s.record)]
        if alive:
            raise StackError(f"a stack is already running from {state_dir} ({', '.join(alive)}); "
                             f"stop it first with `prunewatch stack down --state-dir {state_dir}`")
        previous.clear()  # its processes are gone: forget them, keep data and logs
    state_dir.mkdir(parents=True, exist_ok=True)
    state = StackState(state_dir=state_dir)
    try:
        _start(settings, state, say)
    except BaseException as exc:  # Ctrl-C included: never leave half a stack running
        say("stopping what had started")
        _stop_all(state, settings.stop_timeout_s)
        state.clear()
        if isinstance(exc, (ServiceError, OSError)):
            raise StackError(str(exc)) from None
        raise
    return state


@dataclass(frozen=True)
class _Files:
    """What `_write_configs` wrote: the files the services are started with."""

    key_file: Path
    prometheus_yml: Path
    alertmanager_yml: Path
    targets_yml: Path


def _write_configs(settings: StackSettings, root: Path, ports: dict[str, int], names: list[str]) -> _Files:
    """The generated configs and secrets (configs.py), written under the state dir."""
    config_dir, secrets_dir = root / "config", root / "secrets"
    key_file = configs.engine_api_key(secrets_dir)
    engines = [configs.EngineEndpoint(name, ports[name]) for name in names]
    engines_file = configs.write_json(config_dir / "engines.json", configs.engines_file_sd(engines))
    prometheus = configs.prometheus_config(
        collector_port=ports["collector"], engines_file=engines_file, alertmanager_port=ports["alertmanager"],
        key_file=key_file, scrape_interval_s=settings.scrape_interval_s)
    alertmanager, _ = configs.alertmanager_config(secrets_dir, ports["slack-sink"], settings.alert_group_wait_s)
    targets = configs.targets_config(
        engines, model=settings.model_dir.name, probes_path=settings.probes_path.resolve(),
        buffer_path=root / "collector" / "buffer.sqlite", metrics_port=ports["collector"],
        interval_s=settings.interval_s, timeout_s=settings.probe_timeout_s, sensitivity=settings.sensitivity,
        baseline_every=settings.baseline_every)
    return _Files(key_file=key_file,
                  prometheus_yml=configs.write_yaml(config_dir / "prometheus.yml", prometheus),
                  alertmanager_yml=configs.write_yaml(config_dir / "alertmanager.yml", alertmanager),
                  targets_yml=configs.write_yaml(config_dir / "targets.yaml", targets))


def _start(settings: StackSettings, state: StackState, say: Callable[[str], None]) -> None:
    root, logs = state.state_dir, state.state_dir / "logs"
    names = engine_names(settings.engines)
    state.ports = {name: free_port() for name in
                   ("postgres", "prometheus", "alertmanager", "slack-sink", "collector", "roi", *names)}
    ports = state.ports
    state.save()
    prometheus_bin = find_binary(PROMETHEUS_BINARIES, "prometheus", "prometheus")
    alertmanager_bin = find_binary(ALERTMANAGER_BINARIES, "prometheus-alertmanager", "alertmanager")
    files = _write_configs(settings, root, ports, names)
    python = sys.executable

    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    def start(name: str, argv: list[str], ready_url: str | None, **options) -> ProcessRecord:
        record = launch(name, argv, logs / f"{name}.log", cwd=root, **options)
        state.add(Service(record, port=ports.get(name), url=ready_url))
        say(f"started {name} (pid {record.pid})")
        return record

    def start_engine(name: str) -> ProcessRecord:
        argv = [python, "-m", "prunewatch.stack.runners", "serve", "--model", str(settings.model_dir.resolve()),
                "--host", "127.0.0.1", "--port", str(ports[name]), "--device", settings.device]
        if settings.calibration_dir is not None:
            argv += ["--calibration-dir", str(settings.calibration_dir.resolve())]
        return start(name, argv, url(name), env=_child_env(PRUNEWATCH_API_KEYS_FILE=str(files.key_file)))

    # -- independent services -----------------------------------------------------------------
    postgres = LocalPostgres(root / "postgres", ports["postgres"])
    if postgres.init():
        say("initialised the PostgreSQL cluster")
    pg = postgres.launch(logs / "postgres.log")
    state.add(Service(pg, port=ports["postgres"]))
    say(f"started postgres (pid {pg.pid})")
    alertmanager = start("alertmanager", [
        alertmanager_bin, f"--config.file={files.alertmanager_yml}", f"--storage.path={root / 'alertmanager-data'}",
        f"--web.listen-address=127.0.0.1:{ports['alertmanager']}", "--cluster.listen-address=",
    ], url("alertmanager"))
    sink = start("slack-sink", [python, "-m", "prunewatch.stack.slack_sink", "--port", str(ports["slack-sink"]),
                                "--out", str(root / "slack-messages.jsonl")], url("slack-sink"))
    first_engine = start_engine(names[0])
    # Prometheus once Alertmanager answers. An alert sent before Prometheus has discovered its
    # Alertmanager is dropped until the next resend (1m by default); resending every evaluation
    # interval keeps a local stack's first alerts (no probe data yet) from waiting a minute.
    wait_for_http(alertmanager, url("alertmanager") + "/-/ready", settings.start_timeout_s)
    prometheus = start("prometheus", [
        prometheus_bin, f"--config.file={files.prometheus_yml}", f"--storage.tsdb.path={root / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{ports['prometheus']}", "--web.enable-lifecycle",
        f"--rules.alert.resend-delay={settings.scrape_interval_s}s",
    ], url("prometheus"))

    # -- the store ----------------------------------------------------------------------------
    wait_until(pg, postgres.ready, "accept connections", settings.start_timeout_s)
    if postgres.ensure_database():
        say("created the prunewatch database")
    _migrate(postgres.url, pg)
    state.store_url = postgres.url.replace(postgres.password, "***")
    state.add(Service(pg, port=ports["postgres"], url=state.store_url))
    say("store schema is current")
    wait_for_http(prometheus, url("prometheus") + "/-/ready", settings.start_timeout_s)
    wait_for_http(sink, url("slack-sink") + "/", settings.start_timeout_s)

    # -- engines, the ROI app, the collector ----------------------------------------------------
    wait_for_http(first_engine, url(names[0]) + "/health", settings.start_timeout_s)
    roi = start("roi", [python, "-m", "prunewatch", "roi", "--db", postgres.url, "--host", "127.0.0.1",
                        "--port", str(ports["roi"])], url("roi"))
    for name in names[1:]:
        wait_for_http(start_engine(name), url(name) + "/health", settings.start_timeout_s)
    collector_env = _child_env(**{STORE_URL_ENV: postgres.url},
                               **{configs.TARGET_KEY_ENV: files.key_file.read_text().strip()})
    collector = start("collector", [python, "-m", "prunewatch.stack.runners", "collect", "--config",
                                    str(files.targets_yml)], url("collector") + "/metrics", env=collector_env)
    wait_for_http(collector, url("collector") + "/metrics", settings.start_timeout_s)
    wait_for_http(roi, url("roi") + "/_stcore/health", settings.start_timeout_s)
    say("every service answers")


def _migrate(store_url: str, pg: ProcessRecord) -> None:
    """Bring the store to the newest schema, as `prunewatch db upgrade` does."""
    from prunewatch.records.store import StoreUnavailableError, connect
    from prunewatch.records.store.migrate import upgrade

    try:
        engine = connect(store_url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
    except StoreUnavailableError as exc:
        raise ServiceError(f"postgres: schema migration failed: {exc}; log: {pg.log}") from None
    except Exception as exc:  # alembic's own errors (a broken revision): still one line, not a traceback
        first = str(exc).strip().splitlines()
        raise ServiceError(f"postgres: schema migration failed: {type(exc).__name__}: "
                           f"{first[0] if first else ''}; log: {pg.log}") from None


def _stop_all(state: StackState, timeout_s: float) -> tuple[list[str], list[str]]:
    """Stop every recorded service phase by phase; (names stopped, names killed)."""
    stopped: list[str] = []
    killed: list[str] = []
    remaining = list(state.services)
    for phase in STOP_PHASES:
        batch = [s for s in remaining if any(_matches(s.record.name, pattern) for pattern in phase)]
        remaining = [s for s in remaining if s not in batch]
        records = [s.record for s in batch if is_running(s.record)]
        killed += stop(records, timeout_s)
        stopped += [r.name for r in records]
    leftovers = [s.record for s in remaining if is_running(s.record)]  # names no phase knows
    killed += stop(leftovers, timeout_s)
    stopped += [r.name for r in leftovers]
    return stopped, killed


def stack_down(state_dir: Path, stop_timeout_s: float = 20.0) -> DownReport:
    """Stop every service `stack up` recorded in `state_dir`; StackError when something survives. Nothing
    recorded (never started, or stopped already) is an empty report with `nothing_recorded` set, as stopping
    a stopped service succeeds."""
    try:
        state = StackState.load(state_dir.resolve())
    except NoStackStateError as exc:
        return DownReport(stopped=[], killed=[], already_gone=[], nothing_recorded=str(exc))
    except StateError as exc:
        raise StackError(str(exc)) from None
    gone = [s.record.name for s in state.services if not is_running(s.record)]
    stopped, killed = _stop_all(state, stop_timeout_s)
    survivors = [s.record for s in state.services if is_running(s.record)]
    if survivors:
        raise StackError("still running after SIGKILL: " + ", ".join(f"{r.name} (pid {r.pid})" for r in survivors))
    state.clear()
    return DownReport(stopped=stopped, killed=killed, already_gone=gone)

