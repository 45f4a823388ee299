"""Serving under load: `prunewatch bench load` (or `python -m prunewatch.bench.load`).

N concurrent clients (1, 2, 4 and 8 by default) stream chat completions back to back from `prunewatch serve` on
127.0.0.1, with the server's default settings, for a fixed window per level, dense (X-Pruning-Sensitivity: 0)
and at the server's default pruning, in the same run (the two alternate first from level to level). With
`--peer llama.cpp`, llama.cpp's `llama-server -np N` (N slots, continuous batching) on the F32 GGUF of the same
model (the engine's fp32 weights), the same threads and prompts, runs each level beside them.

Every figure is measured on the client, from the arrival times of the streamed text chunks (one per generated
token):
- aggregate decode throughput: text chunks that arrived inside the window, over the window's length; a request
  still running when the window ends keeps the tokens it got by then and is closed (the server cancels it);
- time per output token (TPOT) of a request: (last chunk - first chunk) / (chunks - 1), over the requests with at
  least two chunks inside the window; p50 and p99, nearest rank;
- time to first token (TTFT): request sent to its first chunk, over the requests that got one inside the window
  (queueing behind other clients shows here); requests that got none are counted apart.
The evaluation prompts (held out from calibration) are cycled, so concurrent clients ask different questions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prunewatch.bench._common import RESULTS_DIR, invocation, machine_info
from prunewatch.bench.llama_cpp import LlamaCpp, PeerUnavailableError, peer_gguf, report
from prunewatch.bench.served import LlamaServer, LoopbackServer, ServedModel
from prunewatch.engine.batching import STEPPER_ACTIVITIES
from prunewatch.engine.model_store import DEFAULT_MODEL, models_root

logger = logging.getLogger("prunewatch.bench.load")

REAL_MODEL_DIR = models_root() / DEFAULT_MODEL
LEVELS = (1, 2, 4, 8)
PEER = "llama.cpp"
DENSE_HEADERS = {"X-Pruning-Sensitivity": "0"}

METHOD = {
    "aggregate_tokens_per_s": "measured: streamed text chunks (one per token) that reached the clients inside the "
                              "window, over the window's seconds",
    "per_client_tokens_per_s": "measured: aggregate_tokens_per_s / clients",
    "scaling_vs_1_client": "measured: aggregate_tokens_per_s over the same server's at 1 client in this run",
    "tpot_p50_ms, tpot_p99_ms": "measured: per request (last chunk - first chunk) / (chunks - 1), requests with >= 2 "
                                "chunks in the window; nearest-rank percentiles",
    "ttft_p50_ms, ttft_p99_ms": "measured: request sent -> first chunk, requests that got one in the window",
    "unserved": "measured: requests sent inside the window that got no token before it ended (queued)",
    "cut": "measured: requests still streaming when the window ended (closed by the client)",
    "default_vs_dense": "measured: default's aggregate_tokens_per_s over dense's at the same clients, same run",
    "mean_decode_pruning_ratio": "measured by the server: decode_pruning_ratio of its final chunks (finished "
                                 "requests)",
    "mean_batch_size": "measured by the server: mean over finished requests of the rows per decode step each ran in",
    "stepper": "measured by the server (prunewatch serve's /metrics before and after the level, its drain included): "
               "share of the batcher's stepper time in decode steps, packed passes (a prefill chunk with the due "
               "decode rows riding along), jobs run alone (prefill chunks with no row due, quality passes), gather "
               "(waiting for due rows) and idle; steps and mean ms per step by rows in the step; packed passes and "
               "the decode rows they took along",
}


@dataclass
class StreamedRequest:
    """One streamed chat completion as a client saw it (times on the client's perf_counter clock)."""

    client: int
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per text chunk
    status: int = 0  # HTTP status; 0 until the response starts (or a transport error)
    finished: bool = False  # the stream ended with its final chunk ([DONE]); False: cut, failed or queued
    error: str | None = None
    decode_pruning_ratio: float | None = None
    mean_batch_size: float | None = None  # rows per decode step the server ran it in (prunewatch serve only)

    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def tpot_s(self) -> float | None:
        if len(self.arrivals) < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (len(self.arrivals) - 1)


def nearest_rank(values: list[float], quantile: float) -> float | None:
    """The nearest-rank percentile: an observed value, never an interpolation between two requests."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 1)


def summarise(requests: list[StreamedRequest], window: tuple[float, float], clients: int) -> dict[str, Any]:
    """The level's figures from its requests, counting only what arrived inside `window` (start, end)."""
    start, end = window
    seconds = end - start
    inside = [[t for t in r.arrivals if start <= t <= end] for r in requests]
    tokens = sum(len(a) for a in inside)
    tpots = [(a[-1] - a[0]) / (len(a) - 1) for a in inside if len(a) >= 2]
    ttfts = [a[0] - r.sent for r, a in zip(requests, inside, strict=True) if a]
    errors = Counter(r.error.split(":")[0] for r in requests if r.error)
    ratios = [r.decode_pruning_ratio for r in requests if r.decode_pruning_ratio is not None]
    batches = [r.mean_batch_size for r in requests if r.mean_batch_size is not None]
    return {
        "clients": clients,
        "window_s": round(seconds, 3),
        "requests": len(requests),
        "finished": sum(r.finished for r in requests),
        "cut": sum(1 for r in requests if not r.finished and r.arrivals and r.error is None),
        "unserved": sum(1 for a in inside if not a),
        "errors": dict(errors),
        "tokens": tokens,
        "aggregate_tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
        "per_client_tokens_per_s": round(tokens / seconds / clients, 3) if seconds > 0 else None,
        "tpot_p50_ms": _ms(nearest_rank(tpots, 0.50)),
        "tpot_p99_ms": _ms(nearest_rank(tpots, 0.99)),
        "ttft_p50_ms": _ms(nearest_rank(ttfts, 0.50)),
        "ttft_p99_ms": _ms(nearest_rank(ttfts, 0.99)),
        "mean_decode_pruning_ratio": round(statistics.fmean(ratios), 4) if ratios else None,
        "mean_batch_size": round(statistics.fmean(batches), 2) if batches else None,
    }


async def _stream(http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                  record: StreamedRequest) -> None:
    """Stream one completion into `record`, chunk by chunk, so that what arrived is kept if it is cancelled."""
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    record.finished = True
                    return
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"stream error: {event['error']}"
                    return
                choices = event.get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    record.arrivals.append(now)
                stats = event.get("prunewatch")
                if stats:
                    record.decode_pruning_ratio = stats.get("decode_pruning_ratio")
                    record.mean_batch_size = stats.get("mean_batch_size")
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def _drive(url: str, model: str, prompts: list[list[dict[str, str]]], *, clients: int, window_s: float,
                 max_tokens: int, headers: dict[str, str], first_prompt: int) -> tuple[list[StreamedRequest],
                                                                                         tuple[float, float]]:
    requests: list[StreamedRequest] = []
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=10.0), limits=limits) as http:

        async def client(index: int) -> None:
            n = first_prompt + index
            while True:
                record = StreamedRequest(client=index, sent=time.perf_counter())
                requests.append(record)  # before it is sent: a request cancelled while queued still counts
                body = {"model": model, "messages": prompts[n % len(prompts)], "max_tokens": max_tokens,
                        "stream": True}
                n += clients
                await _stream(http, body, headers, record)

        start = time.perf_counter()
        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.sleep(window_s)
        end = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return requests, (start, end)


@dataclass
class StepperCounters:
    """The batcher's stepper counters of a prunewatch serve, as scraped from its /metrics."""

    seconds: dict[str, float]  # activity -> seconds
    steps: dict[int, float]  # rows -> steps
    step_seconds: dict[int, float]  # rows -> seconds
    packed: dict[str, float] = field(default_factory=dict)  # "passes" / "rows" -> packed passes, rows taken along


_PACKED_COUNTERS = {"prunewatch_packed_passes_total": "passes", "prunewatch_packed_rows_total": "rows"}


def scrape_stepper(server: LoopbackServer) -> StepperCounters | None:
    """The stepper counters of `server` now; None when it publishes none (no batcher, or not prunewatch)."""
    response = httpx.get(f"{server.url}/metrics", timeout=30.0)
    return parse_stepper(response.text) if response.status_code == 200 else None


def parse_stepper(exposition: str) -> StepperCounters | None:
    """The stepper counters in a /metrics exposition (prunewatch.server.metrics.StepperTimeCollector's families);
    None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = StepperCounters({}, {}, {})
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "prunewatch_batcher_seconds_total":
                counters.seconds[sample.labels["activity"]] = sample.value
            elif sample.name == "prunewatch_decode_steps_total":
                counters.steps[int(sample.labels["rows"])] = sample.value
            elif sample.name == "prunewatch_decode_step_seconds_total":
                counters.step_seconds[int(sample.labels["rows"])] = sample.value
            elif sample.name in _PACKED_COUNTERS:
                counters.packed[_PACKED_COUNTERS[sample.name]] = sample.value
    return counters if counters.seconds else None


def stepper_between(before: StepperCounters | None, after: StepperCounters | None) -> dict[str, Any] | None:
    """What the stepper did between two scrapes: its time's shares by activity, and steps and mean ms per step
    by rows in the step."""
    if before is None or after is None:
        return None
    spent = {a: after.seconds.get(a, 0.0) - before.seconds.get(a, 0.0) for a in STEPPER_ACTIVITIES}
    total = sum(spent.values())
    steps = {rows: after.steps[rows] - before.steps.get(rows, 0.0) for rows in sorted(after.steps)}
    return {
        "seconds": round(total, 3),
        "share": {a: round(v / total, 4) if total > 0 else None for a, v in spent.items()},
        "steps_by_rows": {str(rows): int(n) for rows, n in steps.items() if n > 0},
        "ms_per_step_by_rows": {
            str(rows): round(1000.0 * (after.step_seconds.get(rows, 0.0) - before.step_seconds.get(rows, 0.0)) / n, 2)
            for rows, n in steps.items() if n > 0},
        "packed_passes": int(after.packed.get("passes", 0.0) - before.packed.get("passes", 0.0)),
        "packed_rows": int(after.packed.get("rows", 0.0) - before.packed.get("rows", 0.0)),
    }


def drive(server: LoopbackServer, prompts: list[list[dict[str, str]]], *, clients: int, window_s: float,
          max_tokens: int, headers: dict[str, str] | None = None, first_prompt: int = 0
          ) -> tuple[list[StreamedRequest], tuple[float, float]]:
    """`clients` concurrent streams, each sending its next request when the last ends, for `window_s` seconds;
    then every open stream is closed, and the server is drained (see `drain`) before this returns."""
    result = asyncio.run(_drive(server.url, server.model_name, prompts, clients=clients, window_s=window_s,
                                max_tokens=max_tokens, headers=headers or {}, first_prompt=first_prompt))
    drain(server)
    return result


def drain(server: LoopbackServer) -> None:
    """One one-token request, answered once the server has let go of the streams the clients closed (a queued
    request is served after them), so the next level starts on an idle server."""
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600.0)
    response.raise_for_status()


def load_prompts() -> list[list[dict[str, str]]]:
    """The held-out evaluation prompts as chat messages, rendered as the quality evaluation renders them: a probe
    without a system prompt sends none (the template's default applies), not an empty one."""
    from prunewatch.probes import EVALUATION_PATH, load_probes

    return [([{"role": "system", "content": p.system}] if p.system else []) + [{"role": "user", "content": p.prompt}]
            for p in load_probes(EVALUATION_PATH).probes]


def _series_order(level_index: int) -> tuple[str, str]:
    return ("dense", "default") if level_index % 2 == 0 else ("default", "dense")


def run_engine(server: LoopbackServer, prompts: list[list[dict[str, str]]], *, levels: tuple[int, ...],
               window_s: float, max_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """Dense and default at every level on one `prunewatch serve`, their order alternating from level to level."""
    from tqdm import tqdm

    series: dict[str, list[dict[str, Any]]] = {"dense": [], "default": []}
    steps = [(i, clients, name) for i, clients in enumerate(levels) for name in _series_order(i)]
    for i, clients, name in tqdm(steps, desc="engine levels", unit="level", file=sys.stderr):
        before = scrape_stepper(server)
        requests, window = drive(server, prompts, clients=clients, window_s=window_s, max_tokens=max_tokens,
                                 headers=DENSE_HEADERS if name == "dense" else {}, first_prompt=i)
        series[name].append({**summarise(requests, window, clients),
                             "stepper": stepper_between(before, scrape_stepper(server))})
    return series


def run_peer(llama: LlamaCpp, gguf: Path, prompts: list[list[dict[str, str]]], *, threads: int,
             levels: tuple[int, ...], window_s: float, max_tokens: int) -> list[dict[str, Any]]:
    """llama-server with N slots at each level N (slots are fixed when it starts)."""
    rows = []
    for i, clients in enumerate(levels):
        with LlamaServer(llama, gguf, threads=threads, slots=clients) as server:
            drain(server)  # warm
            requests, window = drive(server, prompts, clients=clients, window_s=window_s, max_tokens=max_tokens,
                                     first_prompt=i)
            command = shlex.join(server.command())
        rows.append({**summarise(requests, window, clients), "command": command})
    return rows


def _with_ratios(series: dict[str, list[dict[str, Any]]]) -> None:
    for rows in series.values():
        base = rows[0]["aggregate_tokens_per_s"] if rows and rows[0]["clients"] == 1 else None
        for row in rows:
            rate = row["aggregate_tokens_per_s"]
            row["scaling_vs_1_client"] = round(rate / base, 3) if base and rate is not None else None
    for dense, default in zip(series.get("dense", []), series.get("default", []), strict=False):
        if dense["aggregate_tokens_per_s"] and default["aggregate_tokens_per_s"] is not None:
            default["default_vs_dense"] = round(default["aggregate_tokens_per_s"] / dense["aggregate_tokens_per_s"], 3)


def run(model_dir: Path, *, levels: tuple[int, ...], window_s: float, max_tokens: int, threads: int,
        peer: str | None, llama_cpp_dir: Path | None, out: Path, plot: Path | None,
        calibration_dir: Path | None = None, gguf: Path | None = None,
        prefix_cache_entries: int | None = None) -> dict[str, Any]:
    prompts = load_prompts()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("load"),
        "machine": machine_info(),
        "model": {"name": model_dir.name, "path": str(model_dir)},
        "levels": list(levels), "window_s": window_s, "max_tokens": max_tokens, "threads": threads,
        "prompts": f"{len(prompts)} held-out evaluation prompts, cycled",
        "server": "prunewatch serve with its default settings (workers, queue depth, pruning), eager"
                  + ("" if prefix_cache_entries is None else f", prefix_cache_entries={prefix_cache_entries}"),
        "method": METHOD,
    }
    with ServedModel(model_dir, threads=threads, calibration_dir=calibration_dir,
                     prefix_cache_entries=prefix_cache_entries) as server:
        drain(server)  # warm
        series = run_engine(server, prompts, levels=levels, window_s=window_s, max_tokens=max_tokens)
    if peer is not None:
        from prunewatch.engine.model_store import source_gguf

        llama = LlamaCpp.find(llama_cpp_dir)
        source = gguf or source_gguf(model_dir)
        if source is None:
            raise PeerUnavailableError(f"{model_dir} keeps no GGUF to give llama.cpp (run `prunewatch models pull`, "
                                       "or name one with --gguf)")
        gguf = peer_gguf(llama, source, "fp32")
        series["llama.cpp F32"] = run_peer(llama, gguf, prompts, threads=threads, levels=levels, window_s=window_s,
                                           max_tokens=max_tokens)
        result["peer"] = {"name": PEER, "version": llama.version(), "gguf": str(gguf)}
    _with_ratios(series)
    result["series"] = series
    result["duration_s"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        write_plot(result, plot)
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = ["| server | clients | aggregate tok/s | x 1 client | per client tok/s | TPOT p50 / p99 ms | "
             "TTFT p50 / p99 ms | default / dense | rows per step | decode ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in result["series"].items():
        for row in rows:
            ratio = row.get("default_vs_dense")
            batch, pruned = row.get("mean_batch_size"), row.get("mean_decode_pruning_ratio")
            lines.append(
                f"| {name} | {row['clients']} | {row['aggregate_tokens_per_s']:.1f} | "
                f"{row['scaling_vs_1_client']:.2f}x | {row['per_client_tokens_per_s']:.1f} | "
                f"{row['tpot_p50_ms']} / {row['tpot_p99_ms']} | {row['ttft_p50_ms']} / {row['ttft_p99_ms']} | "
                f"{f'{ratio:.2f}x' if ratio is not None else ''} | {'' if batch is None else f'{batch:.2f}'} | "
                f"{'' if pruned is None else f'{pruned:.3f}'} |")
    stepper = format_stepper_table(result)
    return "\n".join(lines) + (f"\n\n{stepper}" if stepper else "")


def format_stepper_table(result: dict[str, Any]) -> str:
    """Where prunewatch serve's stepper spent each level (empty when no row has the server's counters)."""
    lines = ["| server | clients | decode | packed (prefill + rows) | jobs (alone) | gather | idle | ms per step by rows "
             "| packed passes / rows along |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, rows in result["series"].items():
        for row in rows:
            stepper = row.get("stepper")
            if not stepper:
                continue
            share = stepper["share"]
            packed = ("" if "packed_passes" not in stepper
                      else f"{stepper['packed_passes']} / {stepper['packed_rows']}")
            per_step = ", ".join(f"{rows_}: {ms:.1f}" for rows_, ms in stepper["ms_per_step_by_rows"].items()
                                 if stepper["steps_by_rows"][rows_] >= 0.05 * sum(stepper["steps_by_rows"].values()))
            lines.append(f"| {name} | {row['clients']} | "
                         + " | ".join("" if share.get(a) is None else f"{100 * share[a]:.0f}%"
                                      for a in STEPPER_ACTIVITIES)
                         + f" | {per_step} | {packed} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def write_plot(result: dict[str, Any], path: Path) -> None:
    """Aggregate decode throughput and p50 time per output token against concurrent clients, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in result["series"].items():
        clients = [r["clients"] for r in rows]
        rate.plot(clients, [r["aggregate_tokens_per_s"] for r in rows], marker="o", label=name)
        tpot.plot(clients, [r["tpot_p50_ms"] for r in rows], marker="o", label=name)
    for axis, label in ((rate, "aggregate decode tokens/s"), (tpot, "time per output token, p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(result["levels"], [str(n) for n in result["levels"]])
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    rate.legend()
    fig.suptitle(f"Serving under load, {result['model']['name']} ({result['threads']} threads, "
                 f"{result['max_tokens']}-token answers, {result['window_s']:g} s per level)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes comma-separated integers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"--clients takes integers >= 1, got {text!r}")
    return levels


@contextlib.contextmanager
def _quiet_http() -> Iterator[None]:
    level = logging.getLogger("httpx").level
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        yield
    finally:
        logging.getLogger("httpx").setLevel(level)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="prunewatch bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REAL_MODEL_DIR)
    parser.add_argument("--clients", type=_levels, default=LEVELS, help="concurrency levels (default 1,2,4,8)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of load per level and server")
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length asked for")
    parser.add_argument("--threads", type=int, default=None, help="threads per server (default: torch's)")
    parser.add_argument("--calibration-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "load-cpu.json")
    parser.add_argument("--plot", type=Path, default=RESULTS_DIR / "load-cpu.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--prefix-cache-entries", type=int, default=None,
                        help="the server's prefix_cache_entries (0: no prefix cache; default: the setting's default)")
    parser.add_argument("--peer", choices=[PEER], default=None,
                        help="llama.cpp's llama-server -np N on the model's F32 GGUF at each level")
    parser.add_argument("--llama-cpp-dir", type=Path, default=None,
                        help="llama.cpp build holding bin/llama-server (default: $PRUNEWATCH_LLAMA_CPP_DIR, else "
                             "the cache; bench/build-llama-cpp.sh makes one)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="GGUF of the same model for llama-server, made F32 with llama-quantize (default: the "
                             "one `models pull` kept in the model folder)")
    args = parser.parse_args(argv)
    if args.window <= 0 or args.max_tokens < 2:
        parser.error("--window must be > 0 and --max-tokens >= 2")
    if args.prefix_cache_entries is not None and args.prefix_cache_entries < 0:
        parser.error("--prefix-cache-entries must be >= 0")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `prunewatch models pull`)")
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"no GGUF at {args.gguf}")
    if args.peer is not None:
        try:
            if not LlamaCpp.find(args.llama_cpp_dir).tool("llama-server").is_file():
                parser.error("the llama.cpp build has no llama-server: build it with `bash bench/build-llama-cpp.sh`")
        except PeerUnavailableError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    threads = args.threads or torch.get_num_threads()
    with _quiet_http():
        return report(lambda: run(args.model_dir, levels=args.clients, window_s=args.window,
                                  max_tokens=args.max_tokens, threads=threads, peer=args.peer,
                                  llama_cpp_dir=args.llama_cpp_dir, out=args.out,
                                  plot=None if args.no_plot else args.plot, calibration_dir=args.calibration_dir,
                                  gguf=args.gguf, prefix_cache_entries=args.prefix_cache_entries),
                      format_table, args.out)

if __name__ == "__main__":
    sys.exit(main())
