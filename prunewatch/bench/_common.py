"""What every benchmark shares: where results go, the machine they ran on, and waiting for a GPU."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the store benchmark runs without it
    import torch

RESULTS_DIR = Path("bench") / "results"
"""Default folder of result JSON and plots, relative to the working directory: in a checkout, the
committed `bench/results/`; elsewhere a new folder, never the installed package."""


def cpu_model_name() -> str:
    """The processor's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    """The facts a benchmark result is read against: device, processor, threads, torch, load at the start."""
    import torch

    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(torch.device(device)),
        "cpu": cpu_model_name(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work, so a wall-clock span covers the GPU time too; nothing on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def invocation(bench: str, argv: list[str] | None = None) -> str:
    """The command that reproduces this run, as `prunewatch bench <bench> ...` with its arguments quoted.

    Reached as `prunewatch bench <bench>` the process's argv starts with "bench <bench>"; as
    `python -m prunewatch.bench.<bench>` it does not; either way the recorded command names the CLI once."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["bench", bench]:
        args = args[2:]
    return shlex.join(["prunewatch", "bench", bench, *args])
