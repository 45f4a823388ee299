"""One precedence for every command: flag > environment variable > config file > default.

The store URL has one variable (PRUNEWATCH_DB_URL) and the probe interval one (PRUNEWATCH_INTERVAL_S)
whatever the command. Each case runs the real command in a fresh process and reads which store it
used from what it printed; `run` is covered the same way in tests/test_cli_run.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prunewatch.records.store import connect, upgrade
from prunewatch.services import free_port

ENV_DB, ENV_INTERVAL = "PRUNEWATCH_DB_URL", "PRUNEWATCH_INTERVAL_S"
SOURCES = ("default", "file", "env", "env-over-file", "flag-over-env")


def _prunewatch(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in (ENV_DB, ENV_INTERVAL)}
    return subprocess.run([sys.executable, "-m", "prunewatch", *args], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=180, check=False)


def _targets_file(folder: Path, *, db_url: str | None, interval_s: float | None) -> Path:
    """A collector file with one OpenAI target on a port nothing listens on: every probe fails at once."""
    lines = ["collector:", "  metrics_port: 0", f"  buffer_path: {folder / 'buffer.sqlite'}"]
    if db_url:
        lines.append(f"  db_url: {db_url}")
    lines += ["defaults:", f"  interval_s: {interval_s or 60}", "  timeout_s: 5", "targets:",
              "  - name: nowhere", "    kind: openai", f"    base_url: http://127.0.0.1:{free_port()}",
              "    model: m", "    domains: [legal]"]
    path = folder / "targets.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _case(source: str, tmp_path: Path, has_file: bool) -> tuple[dict[str, str], list[str], str | None, str]:
    """(environment, flags, the file's store URL, the store the command must use) for one source."""
    url = {name: f"sqlite:///{tmp_path / name}.db" for name in ("flag", "env", "file")}
    env = {ENV_DB: url["env"]} if source in ("env", "env-over-file", "flag-over-env") else {}
    flags = ["--db", url["flag"]] if source == "flag-over-env" else []
    file_url = url["file"] if has_file and source in ("file", "env-over-file") else None
    expected = {"default": "sqlite:///prunewatch.db", "file": url["file"], "env": url["env"],
                "env-over-file": url["env"], "flag-over-env": url["flag"]}[source]
    return env, flags, file_url, expected


STORE_COMMANDS = {
    # command -> (arguments, reads a config file, where it names the store)
    "db upgrade": (["db", "upgrade"], False, "stdout"),
    "db prune": (["db", "prune", "--older-than", "1d", "--dry-run"], False, "stdout"),
    "alerts eval": (["alerts", "eval"], False, "stdout"),
    "report": (["report", "--out", "r.pdf"], False, "stderr"),
    "collect": (["collect", "--rounds", "1"], True, "stdout"),
}


@pytest.mark.parametrize("command, source", [(command, source) for command in sorted(STORE_COMMANDS)
                                             for source in SOURCES if STORE_COMMANDS[command][1] or "file" not in source])
def test_every_command_finds_its_store_by_one_precedence(tmp_path, command, source):
    args, has_file, stream = STORE_COMMANDS[command]
    env, flags, file_url, expected = _case(source, tmp_path, has_file)
    if command not in ("db upgrade", "collect"):  # readers need a store with the current schema
        for name in ("prunewatch", "flag", "env"):
            store = connect(f"sqlite:///{tmp_path / name}.db")
            upgrade(store)
            store.dispose()
    if has_file:
        args = [*args, "--config", str(_targets_file(tmp_path, db_url=file_url, interval_s=None))]
    done = _prunewatch([*args, *flags], tmp_path, env)
    printed = done.stdout if stream == "stdout" else done.stderr
    assert f"store {expected}" in printed, done.stdout + done.stderr
    others = {f"sqlite:///{tmp_path / name}.db" for name in ("flag", "env", "file")} - {expected}
    assert not any(f"store {url}" in printed for url in others)


def test_roi_app_reads_the_store_from_the_same_variable(tmp_path):
    """`prunewatch roi` checks the store before starting Streamlit: a missing one is named in the error."""
    env_store, flag_store = tmp_path / "env.db", tmp_path / "flag.db"
    from_env = _prunewatch(["roi", "--port", str(free_port())], tmp_path, {ENV_DB: f"sqlite:///{env_store}"})
    both = _prunewatch(["roi", "--port", str(free_port()), "--db", f"sqlite:///{flag_store}"], tmp_path,
                       {ENV_DB: f"sqlite:///{env_store}"})
    assert from_env.returncode == both.returncode == 2
    assert str(env_store) in from_env.stderr and str(flag_store) in both.stderr and str(env_store) not in both.stderr


@pytest.mark.parametrize("source, expected", [("default", 60.0), ("file", 9.0), ("env", 5.0),
                                              ("env-over-file", 5.0), ("flag-over-env", 7.0)])
def test_collect_interval_follows_the_same_precedence(tmp_path, source, expected):
    env = {ENV_INTERVAL: "5"} if source in ("env", "env-over-file", "flag-over-env") else {}
    flags = ["--interval", "7"] if source == "flag-over-env" else []
    config = _targets_file(tmp_path, db_url=f"sqlite:///{tmp_path / 'store'}.db",
                           interval_s=9.0 if source in ("file", "env-over-file") else None)
    done = _prunewatch(["collect", "--rounds", "1", "--config", str(config), *flags], tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert f"nowhere every {expected:g}s" in done.stdout, done.stdout


@pytest.mark.parametrize("source, expected", [("default", 30.0), ("env", 5.0), ("flag-over-env", 7.0)])
def test_stack_interval_follows_the_same_precedence(monkeypatch, source, expected):
    """`stack up` builds its settings from the flags it was given over StackSettings' environment."""
    from prunewatch.stack.settings import StackSettings

    monkeypatch.delenv(ENV_INTERVAL, raising=False)
    if source != "default":
        monkeypatch.setenv(ENV_INTERVAL, "5")
    flags = {"interval_s": 7.0} if source == "flag-over-env" else {}
    assert StackSettings(**flags).interval_s == expected
