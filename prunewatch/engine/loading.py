"""Load a Hugging Face causal LM from a local folder and fingerprint its weights."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from prunewatch.engine.errors import ModelLoadError
from prunewatch.engine.execution import find_decoder_blocks

logger = logging.getLogger(__name__)

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_FINGERPRINT_DATA_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with the facts the engine reports about it."""

    model: torch.nn.Module
    tokenizer: object  # transformers PreTrainedTokenizerBase
    name: str  # folder name, used as the `model` label everywhere
    path: Path
    device: torch.device
    dtype: torch.dtype
    fingerprint: str  # see weights_fingerprint


def resolve_device(device: str) -> tuple[torch.device, torch.dtype]:
    """auto -> CUDA with bf16 when available, else CPU with fp32 (CPU bf16 is slow without AMX)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError("--device cuda was asked for but no CUDA device is visible to torch")
        return torch.device("cuda"), torch.bfloat16
    if device == "cpu":
        return torch.device("cpu"), torch.float32
    raise ModelLoadError(f"unknown device {device!r}: use auto, cpu or cuda")


def weight_files(path: Path) -> list[Path]:
    files: list[Path] = []
    for pattern in _WEIGHT_PATTERNS:
        files.extend(sorted(path.glob(pattern)))
    return files


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
"""Files one of which every tokenizer transformers can load needs (fast, SentencePiece, BPE, WordPiece)."""


def check_model_dir(path: Path) -> list[Path]:
    """Fail early, with a message naming the problem, before transformers gives a long traceback."""
    if not path.exists():
        raise ModelLoadError(f"model folder not found: {path}")
    if not path.is_dir():
        raise ModelLoadError(f"model path is not a folder: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {path}: not a Hugging Face model folder")
    files = weight_files(path)
    if not files:
        raise ModelLoadError(f"no weights (*.safetensors or pytorch_model*.bin) in {path}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        # transformers would fall back to converting a slow tokenizer and fail on a missing converter library
        raise ModelLoadError(f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}): copy the model's "
                             "tokenizer files next to its weights")
    return files


def weights_fingerprint(path: Path) -> str:
    """sha256 over config.json and, per weights file, its name, size and first 4 MiB.

    The safetensors header (tensor names, shapes, offsets) sits at the start of each file, so this
    changes whenever the architecture or any early tensor changes, without reading gigabytes on
    every start. Calibrations are tied to it.
    """
    files = check_model_dir(path)
    digest = hashlib.sha256()
    digest.update((path / "config.json").read_bytes())
    for file in files:
        digest.update(file.name.encode())
        digest.update(str(file.stat().st_size).encode())
        with file.open("rb") as fh:
            digest.update(fh.read(_FINGERPRINT_DATA_BYTES))
    return digest.hexdigest()


_MISMATCH_ROW = re.compile(r"^\s*(?P<key>\S+)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\((?P<ckpt>\[[^\]]*\])\)"
                           r"\s*vs\s*model:\s*torch\.Size\((?P<model>\[[^\]]*\])\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _HeldBack(logging.Handler):
    """Keeps transformers' log records while a model loads, so a failed load ends in one line."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _load_failure(model_dir: Path, exc: BaseException, held: list[logging.LogRecord]) -> str:
    """One line saying why the weights or config.json of `model_dir` could not be loaded."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = lines[-1] if lines else type(exc).__name__  # multi-line library errors end with the specific line
    if type(exc).__name__ == "SafetensorError":  # zero-byte, truncated or garbled *.safetensors
        return f"the weights in {model_dir} are damaged or truncated (safetensors: {detail})"
    for record in held:  # transformers logs which tensor mismatched before raising "look at the above report"
        for row in _ANSI.sub("", record.getMessage()).splitlines():
            match = _MISMATCH_ROW.match(row)
            if match:
                return (f"the weights in {model_dir} do not match its config.json: {match['key']} has shape "
                        f"{match['ckpt']} in the file, the model expects {match['model']}")
    if "mismatched_sizes" in detail or "size mismatch" in detail:
        return f"the weights in {model_dir} do not match its config.json (a tensor has another shape)"
    return f"cannot load the model in {model_dir}: {type(exc).__name__}: {detail}"


@contextlib.contextmanager
def _held_library_log() -> Iterator[_HeldBack]:
    """transformers' log records kept back while a model loads: replayed on success (they may name
    missing tensors), folded into the one-line error on failure."""
    from transformers.utils import logging as hf_logging

    library_logger = hf_logging.get_logger("transformers")  # configured now: its handler is added on first use
    held = _HeldBack()
    saved, saved_propagate = library_logger.handlers[:], library_logger.propagate
    library_logger.handlers = [held]
    library_logger.propagate = False  # transformers propagates to the root logger when CI=true is set
    failed = False
    try:
        yield held
    except BaseException:
        failed = True
        raise
    finally:
        library_logger.handlers, library_logger.propagate = saved, saved_propagate
        if not failed:
            for record in held.records:
                library_logger.handle(record)


@contextlib.contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """transformers' own progress bars off while the caller shows its own status (restored after)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layers_beyond_config(unexpected: Iterable[str], config) -> list[str]:
    """Tensors of the checkpoint that belong to decoder layers config.json does not have (index >= its
    layer count): weights of a deeper model, which loading would drop without an error."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return []
    return sorted(key for key in unexpected
                  if (match := _LAYER_INDEX.search(key)) is not None and int(match.group(1)) >= layers)


def load_model(path: Path, device: str = "auto") -> LoadedModel:
    """Load model and tokenizer; raise ModelLoadError with a one-line reason on failure, and
    UnsupportedArchitectureError (one line) for a model whose decoder blocks the engine cannot find."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    check_model_dir(path)
    torch_device, dtype = resolve_device(device)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"config.json in {path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"config.json in {path} is not a JSON object (it holds a {type(config).__name__})")
    if config.get("num_local_experts") or config.get("num_experts"):
        raise ModelLoadError(
            f"{path} is a mixture-of-experts model; its per-token work varies by routing, which the "
            "pruning ratio does not yet account for"
        )
    held = _HeldBack()
    try:
        with quiet_transformers_progress(), _held_library_log() as held:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model, report = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
            missing = sorted(report.get("missing_keys") or ())
            if missing:  # transformers initialises them at random and only logs it: a damaged model
                raise ModelLoadError(f"the weights in {path} lack {len(missing)} tensor(s) that config.json "
                                     f"describes ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
            extra = _layers_beyond_config(report.get("unexpected_keys") or (), model.config)
            if extra:  # transformers drops them and only logs it: config.json describes a smaller model
                raise ModelLoadError(f"the weights in {path} hold layers past the {model.config.num_hidden_layers} "
                                     f"that config.json describes ({', '.join(extra[:3])}"
                                     f"{', ...' if len(extra) > 3 else ''})")
    except ModelLoadError:
        raise
    except Exception as exc:  # a damaged input, not a bug of ours: only library code runs here
        # safetensors raises SafetensorError for a zero-byte or truncated file, transformers a RuntimeError
        # for a tensor whose shape differs from config.json (after logging a multi-line report), and
        # huggingface_hub a validation error for an inconsistent config.json: each becomes one line.
        logger.debug("loading the model in %s failed", path, exc_info=True)
        raise ModelLoadError(_load_failure(path, exc, held.records)) from exc
    find_decoder_blocks(model)  # UnsupportedArchitectureError (one line) for a family the engine cannot wrap
    model.to(torch_device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=path.name,
        path=path,
        device=torch_device,
        dtype=dtype,
        fingerprint=weights_fingerprint(path),
    )
