"""Hardware figures per request: peak memory and DRAM bytes per instruction (estimate on CPU)."""

from __future__ import annotations

import functools
import platform
import resource
from pathlib import Path

import torch

DEVICE_NAME_MAX = 128  # the result store's column width

# AVX2 FMA on fp32: 8 lanes x 2 FLOPs per instruction. The estimate assumes the matmuls are fully
# vectorised, so it is a lower bound on instructions and an upper bound on bytes per instruction.
CPU_FLOPS_PER_INSTRUCTION = 16


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name (what a DRAM profile is tied to), or 'cpu'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.lru_cache(maxsize=1)
def processor_name() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo, else the platform's answer); None when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()[:DEVICE_NAME_MAX]
    except OSError:
        pass
    return (platform.processor() or "").strip()[:DEVICE_NAME_MAX] or None


def device_model_name(device: torch.device) -> str | None:
    """Where a request's timings were measured: the GPU's marketing name on CUDA, the processor's on a CPU;
    stored with every result (in-process) and published in the HTTP API's `prunewatch` field."""
    if device.type == "cpu":
        return processor_name()
    return (device_name(device) or "")[:DEVICE_NAME_MAX] or None


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak memory of one request: CUDA max allocated on a GPU, growth of peak RSS on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source = "cuda_max_allocated" if device.type == "cuda" else "rss_delta"
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._start = peak_rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        return None

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss_bytes() - self._start)


def estimate_dram_bytes_per_instruction(weight_bytes_read: int, kv_bytes_read: int, executed_flops: int) -> float | None:
    """Model-level estimate: bytes the executed layers must stream / vectorised instruction count.

    weight_bytes_read counts each executed linear's weights once per call (no cache reuse across
    calls: true for decode, where weights dwarf the caches). Labelled source="estimate".
    """
    instructions = executed_flops / CPU_FLOPS_PER_INSTRUCTION
    if instructions <= 0:
        return None
    return (weight_bytes_read + kv_bytes_read) / instructions
