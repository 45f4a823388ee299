"""Load a Hugging Face causal LM from a local folder and fingerprint its weights."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.errors import ModelLoadError
from engine.execution import find_decoder_blocks

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
    if config.get("num_local_experts") or config.get("num_experts"):
        raise ModelLoadError(
            f"{path} is a mixture-of-experts model; its per-token work varies by routing, which the "
            "pruning ratio does not yet account for"
        )
    try:
        with quiet_transformers_progress():
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"transformers could not load {path}: {exc}".splitlines()[0]) from exc
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
