"""Build, load and call the sparse linear kernels: a torch C++ extension for CPU tensors, a Triton
kernel (prunewatch.engine.sparse.triton_kernel) for CUDA tensors, both with one signature and one contract.

The CPU kernel is compiled once per machine kind (torch version x CPU instruction set) into a cache
folder, by `python -m prunewatch.engine.sparse.build` at install time or on first use; the Triton kernel is
compiled by Triton on first use. When no kernel can run on a device the engine raises
`SparseKernelUnavailableError`: a request that asked for activation sparsity is never silently run
dense and reported as sparse.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import logging
import os
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from types import ModuleType

import torch

from prunewatch.engine.errors import EngineError
from prunewatch.engine.paths import cache_root

logger = logging.getLogger("prunewatch.engine.sparse")

def _csrc(name: str) -> Path:
    return Path(str(files("prunewatch.engine.sparse").joinpath("csrc", name)))


SOURCES = tuple(_csrc(name) for name in ("sparse_linear.cpp", "fp32_dense.cpp", "int4_dense.cpp", "int8_dense.cpp",
                                         "ragged_attention.cpp", "threshold_mask.cpp"))
"""The extension's sources, built together as one module: the sparse linear kernel, the dense products of few rows
of fp32 weights (csrc/fp32_dense.cpp) and of int4 and int8 weights laid out by output (csrc/int4_dense.cpp,
csrc/int8_dense.cpp), the attention of a decode step over reserved caches (csrc/ragged_attention.cpp, used by
prunewatch.engine.batching), and the row policy's mask of a call with many rows (csrc/threshold_mask.cpp)."""
HEADERS = tuple(_csrc(name) for name in ("fp32_dense.h", "int4_dense.h", "int8_dense.h", "integer_dense.h",
                                         "ragged_attention.h", "thread_count.h", "threshold_mask.h"))
"""Headers the sources include: part of the build's digest, so that changing one rebuilds the module."""
CACHE_ENV = "PRUNEWATCH_EXTENSIONS_DIR"
"""Environment variable naming the folder compiled kernels are cached in."""

_LOCK = threading.Lock()
_MODULE: ModuleType | None = None

RawKernel = Callable[..., tuple[torch.Tensor, int, int]]
"""(x, weight_t, bias, scale, threshold, keep, threads[, weight_scale]) -> (output, active channels, kept entries);
weight_scale: the per-output scales of int8 weight_t, or the per-group scales and minimums of int4 (uint8) weight_t
(CPU kernel only; prunewatch/engine/sparse/quantize.py), None for floating-point weights."""


class SparseKernelUnavailableError(EngineError):
    """No sparse kernel can run here (no compiler, no triton for CUDA tensors, unsupported device)."""


@dataclass(frozen=True)
class KernelOutput:
    """One kernel call: the output and the work it really did."""

    output: torch.Tensor  # (rows, out) in the input's dtype
    active_channels: int  # input channels whose weight rows were read (union over rows)
    kept_entries: int  # (row, channel) input entries that survived the mask


def _isa_flags() -> list[str]:
    """Vector flags for the instruction set torch itself detected; portable code otherwise.

    With AVX-512 (torch's level needs F, BW, VL and DQ) the kernel's loops use 512-bit vectors: on
    SmolLM2-135M's real decode inputs (one thread) that ran 3.5-5% faster than the AVX2 build, fp32 and
    bf16 weights, sparse and full reads, with bit-identical outputs (the sums run in the same order:
    vectors span output channels, never the channels summed over). Where torch's CPU feature detection
    (cpuinfo) also reports AVX512-VNNI, the integer dense products multiply-add-accumulate in one instruction
    (csrc/integer_dense.h), with the same bits."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-mavx2", "-mfma", "-mf16c"] if capability in ("AVX2", "AVX512") else []
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
        if getattr(torch.cpu, "_is_vnni_supported", lambda: False)():
            flags.append("-mavx512vnni")
    return flags


def cache_dir() -> Path:
    """Where the kernel is compiled: one folder per torch version, instruction set, source and flags, and per torch
    and Python installation: the build's commands name their include folders, so two environments sharing one folder
    would rebuild it for each other (as two checkouts would, without _staged_sources)."""
    root = Path(os.environ.get(CACHE_ENV) or cache_root() / "extensions")
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    installation = f"{Path(torch.__file__).resolve().parent}\n{sysconfig.get_paths()['include']}".encode()
    build_digest = hashlib.sha256(sources + " ".join(_isa_flags()).encode() + installation).hexdigest()[:12]
    tag = f"torch{torch.__version__.replace('+', '-')}-{torch.backends.cpu.get_cpu_capability()}-{build_digest}"
    return root / "sparse_linear" / tag


@contextlib.contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Hold the build folder for this process, clearing a lock left by a build that died.

    torch's extension loader marks a build in progress with a plain `lock` file and waits, without
    a limit, for it to disappear; a build killed midway (a stopped CI job, a restarted machine)
    leaves that file behind and every later build hangs. An advisory `flock` is released by the
    kernel when its holder dies, so while this process holds it no other live build owns the
    folder, and a `lock` file found then is stale.
    """
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing a stale build lock left in %s by a build that did not finish", directory)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staged_sources(directory: Path) -> list[Path]:
    """Copies of the sources and headers in `directory`/src, written only where their bytes differ; returns the
    sources' copies. Call it holding the folder (_exclusive_build).

    Why: the folder is keyed by the sources' bytes (and the environment, cache_dir), but torch writes the paths it is
    given into the folder's ninja file, and ninja rebuilds whatever a changed command names. Two checkouts of one
    version in one environment (an editable install moved between working trees) would each rebuild the folder for
    the other, ~100 s on two cores, while a server starting meanwhile waits on the build. Built from copies inside
    the folder, they run the same commands, and the first build serves both."""
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    for source in (*SOURCES, *HEADERS):
        target = staged / source.name
        content = source.read_bytes()
        if target.is_file() and target.read_bytes() == content:
            continue  # unchanged: its modification time, which ninja compares, stays
        partial = staged / f".{source.name}.partial"
        partial.write_bytes(content)
        os.replace(partial, target)
    return [staged / source.name for source in SOURCES]


def build(verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the kernel; raise SparseKernelUnavailableError on failure."""
    global _MODULE
    with _LOCK:
        if _MODULE is not None:
            return _MODULE
        from torch.utils import cpp_extension

        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        if not cpp_extension.is_ninja_available():
            raise SparseKernelUnavailableError(
                "cannot build the sparse kernel: ninja is not installed (pip install ninja)")
        try:
            with _exclusive_build(directory):
                module = cpp_extension.load(
                    name="prunewatch_sparse_linear",
                    sources=[str(source) for source in _staged_sources(directory)],
                    extra_cflags=["-O3", "-fopenmp", *_isa_flags()],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=verbose,
                )
        except Exception as exc:  # any compiler or loader failure becomes one typed, actionable error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SparseKernelUnavailableError(
                f"cannot build the sparse kernel in {directory}: {first}; "
                "install a C++ compiler (g++) and run `python -m prunewatch.engine.sparse.build`") from exc
        _MODULE = module
        logger.debug("sparse kernel loaded from %s", directory)
        return module


def _triton_kernel() -> RawKernel:
    """The Triton kernel, imported on first use so that the package works without triton."""
    try:
        triton_kernel = importlib.import_module("prunewatch.engine.sparse.triton_kernel")
    except ImportError as exc:
        raise SparseKernelUnavailableError(
            f"activation sparsity on CUDA needs triton, which cannot be imported ({exc}); "
            "install it with `pip install 'triton>=3.2'` (it ships with torch's CUDA wheels on Linux)") from exc
    return triton_kernel.sparse_linear


def device_kernel(device: torch.device | str) -> RawKernel:
    """The raw kernel for tensors on `device`: the compiled CPU kernel, or the Triton one for CUDA.

    Raises SparseKernelUnavailableError when neither can run there, so the failure is seen where a
    caller resolves the kernel (at install time) rather than at the first sparse request.
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return build().sparse_linear
    if kind == "cuda":
        return _triton_kernel()
    raise SparseKernelUnavailableError(
        f"no sparse kernel for {kind} tensors: there are kernels for CUDA (Triton) and the CPU only; "
        "move the model to one of them")


_FAKE_REGISTERED = False


def counted_op() -> Callable[..., torch.Tensor]:
    """The CPU kernel as the operator `prunewatch::sparse_linear_counted`, which torch.compile can place
    in a graph: (x, weight_t, bias, scale, thresholds: float32 (slots,), keeps: int64 (slots,), threads,
    stats: int64 (slots, 3), slot) -> output, at thresholds[slot] and keeps[slot] (both < 0: the dense
    product), adding (active channels, kept entries, 1 call) to stats[slot].
    Builds the kernel if needed; raises SparseKernelUnavailableError where it cannot be built."""
    global _FAKE_REGISTERED
    build()  # loading the extension registers the operator
    with _LOCK:
        if not _FAKE_REGISTERED:
            # What the compiler traces instead of the kernel: the output's shape and dtype only.
            @torch.library.register_fake("prunewatch::sparse_linear_counted")
            def _(x, wt, bias, scale, thresholds, keeps, threads, stats, slot, weight_scale=None, by_output=None):
                out = wt.shape[1] * 2 if wt.dtype == torch.uint8 else wt.shape[1]  # int4: two outputs per byte
                return x.new_empty((x.shape[0], out))

            _FAKE_REGISTERED = True
    return torch.ops.prunewatch.sparse_linear_counted


Fp32DenseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
"""(x, weight_t, bias, threads) -> y: the dense product of few rows of fp32 weights, row by row invariant."""


def fp32_dense_kernel(device: torch.device | str, dtype: torch.dtype) -> Fp32DenseKernel | None:
    """The dense product of few rows of fp32 weights (csrc/fp32_dense.cpp: each output one chain over the inputs,
    so a row's bits depend on that row alone), for weights of `dtype` on `device`; None elsewhere (other devices
    and dtypes read every row through the sparse kernel instead). Builds the extension where needed."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    return build().fp32_dense_linear


ThresholdMask = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, int]]
"""(x, scale, threshold) -> (x with the entries whose |x| * scale is not above threshold zeroed, entries kept)."""


def threshold_mask_kernel(device: torch.device | str, dtype: torch.dtype) -> ThresholdMask | None:
    """The row policy's mask of a call with many rows in one pass (csrc/threshold_mask.cpp), for inputs of `dtype`
    on `device`: float32 on the CPU; None elsewhere (tensor operators do it there)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    return build().threshold_mask


QuantizedDenseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
"""(x, by_output, scales, bias, threads) -> y: the dense product of int4 or int8 weights laid out by output."""


def int4_dense_kernel(device: torch.device | str) -> QuantizedDenseKernel:
    """The dense decode product of int4 weights laid out by output (quantize.pack_int4_by_output), multiplied as
    integers with each group of 32 inputs rounded to int16 (csrc/int4_dense.cpp). CPU only: raises
    SparseKernelUnavailableError for other devices or where the extension cannot be built."""
    return _quantized_dense_kernel("int4", device).int4_dense_linear


def int8_dense_kernel(device: torch.device | str) -> QuantizedDenseKernel:
    """The dense decode product of int8 weights laid out by output (quantize.pack_int8_by_output), multiplied as
    integers with each group of 32 inputs rounded to int16 (csrc/int8_dense.cpp). CPU only: raises
    SparseKernelUnavailableError for other devices or where the extension cannot be built."""
    return _quantized_dense_kernel("int8", device).int8_dense_linear


def _quantized_dense_kernel(weights: str, device: torch.device | str) -> ModuleType:
    """The built extension, where `weights` have a kernel on `device`."""
    if torch.device(device).type != "cpu":
        raise SparseKernelUnavailableError(f"{weights} weights have a CPU kernel only, not one for "
                                           f"{torch.device(device).type}")
    return build()


def sparse_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    threshold: float,
    keep: int = -1,
    threads: int = 0,
    weight_scale: torch.Tensor | None = None,
) -> KernelOutput:
    """y = masked(x) @ weight_t + bias, reading only the rows of weight_t for active channels.

    x: (rows, in); weight_t: contiguous (in, out), W transposed; scale: float32 (in,) per-channel
    score factor (ones for magnitude thresholds, column norms of W for WINA). With keep < 0 an
    entry survives when |x| * scale > threshold (per row; the weights read are the union over
    rows). With keep >= 0 the rows share the `keep` channels of largest summed score. threads: at
    most this many of torch's intra-op threads (0: all of them; 1: the calling thread only; unused
    on CUDA). weight_scale: with int8 weight_t, one float32 scale per output channel (y = the int8 product
    times it, then the bias); with int4 weight_t (uint8, two weights per byte), float16 (in / 32, 2, out)
    scales and minimums (quantize.quantize_int4); CPU only. CPU tensors run the compiled kernel, CUDA tensors the Triton kernel.
    """
    output, active, kept = device_kernel(x.device)(x, weight_t, bias, scale, float(threshold), int(keep), int(threads),
                                                   weight_scale)
    return KernelOutput(output=output, active_channels=int(active), kept_entries=int(kept))
