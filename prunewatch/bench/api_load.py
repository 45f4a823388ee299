"""Load test of the engine's HTTP API: N concurrent clients for a bounded time, pruned vs dense.

Each phase runs `--clients` threads, each posting chat completions back to back for `--duration`
seconds (split into rounds that alternate the phases ABBA); the canonical probes are cycled as
prompts so several domains are exercised. The two phases differ only in the X-Pruning-Sensitivity
header: the server's default (or `--sensitivity`) versus 0, the dense model. Reported per phase:
throughput (requests/s and completion tokens/s), client-side latency p50/p99 (nearest rank), error
counts by status, the mean measured pruning ratio the server returned, and the server's own mean
inference and queueing times (so queueing behind other clients is not mistaken for compute).
Numbers measured on the bundled probe model are probe-model numbers.

    python -m prunewatch.bench.api_load --clients 4 --duration 10                # starts a local server
    python -m prunewatch.bench.api_load --url http://127.0.0.1:8000 --api-key K  # an already running one

Run it as a module from the repository root: `python prunewatch/bench/api_load.py` would put bench/ first on
the import path, where prunewatch/bench/engine.py shadows the `engine` package.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from prunewatch.engine.model_store import PROBE_MODEL_DIR

DEFAULT_MODEL = PROBE_MODEL_DIR


@dataclass
class Sample:
    seconds: float
    status: int
    completion_tokens: int = 0
    pruning_ratio: float | None = None
    inference_ms: float | None = None  # server-measured prefill + decode
    queue_ms: float | None = None  # server-measured wait for a free worker


@dataclass
class PhaseReport:
    phase: str
    sensitivity_header: str | None
    clients: int
    duration_s: float
    requests: int
    ok: int
    errors: dict[str, int] = field(default_factory=dict)
    requests_per_s: float = 0.0
    completion_tokens_per_s: float = 0.0
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    mean_pruning_ratio: float | None = None
    mean_inference_ms: float | None = None
    mean_queue_ms: float | None = None


def nearest_rank(sorted_values: list[float], quantile: float) -> float | None:
    """The nearest-rank percentile: an observed value, no interpolation between two requests."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(quantile * len(sorted_values)))
    return sorted_values[rank - 1]


def load_prompts() -> list[list[dict[str, str]]]:
    from prunewatch.probes import load_probes

    return [[{"role": "system", "content": p.system}, {"role": "user", "content": p.prompt}]
            for p in load_probes().probes]


def run_clients(url: str, headers: dict[str, str], model: str, prompts: list[list[dict[str, str]]], *,
                clients: int, duration_s: float, max_tokens: int, timeout_s: float) -> tuple[list[Sample], float]:
    """`clients` threads posting back to back until the deadline; returns the samples and wall time."""
    samples: list[Sample] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def client(index: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as http:
            start.wait()
            n = index
            while time.perf_counter() < stop_at[0]:
                body = {"model": model, "messages": prompts[n % len(prompts)], "max_tokens": max_tokens}
                n += clients
                began = time.perf_counter()
                try:
                    response = http.post("/v1/chat/completions", json=body)
                    sample = Sample(time.perf_counter() - began, response.status_code)
                    if response.status_code == 200:
                        data = response.json()
                        sample.completion_tokens = data["usage"]["completion_tokens"]
                        stats = data["prunewatch"]
                        sample.pruning_ratio = stats["pruning_ratio"]
                        sample.inference_ms = stats["inference_ms"]
                        sample.queue_ms = stats["queue_ms"]
                except httpx.HTTPError as exc:
                    sample = Sample(time.perf_counter() - began, 0)
                    print(f"client {index}: {type(exc).__name__}: {exc}", file=sys.stderr)
                with lock:
                    samples.append(sample)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    stop_at[0] = began + duration_s
    start.wait()
    for thread in threads:
        thread.join()
    return samples, time.perf_counter() - began  # includes requests started before the deadline


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def summarise(phase: str, sensitivity: str | None, clients: int, samples: list[Sample],
              elapsed: float) -> PhaseReport:
    ok = [s for s in samples if s.status == 200]
    latencies = sorted(s.seconds * 1000.0 for s in ok)
    ratios = [s.pruning_ratio for s in ok if s.pruning_ratio is not None]
    inference = [s.inference_ms for s in ok if s.inference_ms is not None]
    queued = [s.queue_ms for s in ok if s.queue_ms is not None]
    errors = Counter(str(s.status) if s.status else "connection" for s in samples if s.status != 200)
    return PhaseReport(
        phase=phase, sensitivity_header=sensitivity, clients=clients, duration_s=round(elapsed, 3),
        requests=len(samples), ok=len(ok), errors=dict(errors),
        requests_per_s=round(len(ok) / elapsed, 3),
        completion_tokens_per_s=round(sum(s.completion_tokens for s in ok) / elapsed, 3),
        latency_p50_ms=_rounded(nearest_rank(latencies, 0.50), 1),
        latency_p99_ms=_rounded(nearest_rank(latencies, 0.99), 1),
        mean_pruning_ratio=round(sum(ratios) / len(ratios), 4) if ratios else None,
        mean_inference_ms=round(sum(inference) / len(inference), 1) if inference else None,
        mean_queue_ms=round(sum(queued) / len(queued), 1) if queued else None,
    )


def run_phases(url: str, api_key: str | None, model: str, prompts: list[list[dict[str, str]]], *,
               sensitivity: str | None, clients: int, duration_s: float, rounds: int, max_tokens: int,
               timeout_s: float) -> list[PhaseReport]:
    """Pruned and dense in ABBA order over `rounds` rounds, so a load drift on a shared machine
    (other jobs starting or stopping) weighs on both phases alike rather than on the second one."""
    base = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    phases = {"pruned": sensitivity, "dense": "0"}
    collected: dict[str, tuple[list[Sample], float]] = {name: ([], 0.0) for name in phases}
    for r in range(rounds):
        for name in (("pruned", "dense") if r % 2 == 0 else ("dense", "pruned")):
            headers = dict(base)
            phase_sensitivity = phases[name]
            if phase_sensitivity is not None:
                headers["X-Pruning-Sensitivity"] = phase_sensitivity
            samples, elapsed = run_clients(url, headers, model, prompts, clients=clients,
                                           duration_s=duration_s / rounds, max_tokens=max_tokens,
                                           timeout_s=timeout_s)
            done, seconds = collected[name]
            collected[name] = (done + samples, seconds + elapsed)
    return [summarise(name, phases[name], clients, *collected[name]) for name in phases]


def print_table(reports: list[PhaseReport]) -> None:
    columns = ["phase", "clients", "duration_s", "requests", "ok", "errors", "requests_per_s",
               "completion_tokens_per_s", "latency_p50_ms", "latency_p99_ms", "mean_pruning_ratio",
               "mean_inference_ms", "mean_queue_ms"]
    rows = [[str(getattr(r, c) if c != "errors" else (r.errors or 0)) for c in columns] for r in reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Base URL of a running server; default: start one on 127.0.0.1.")
    parser.add_argument("--api-key", help="Bearer key for --url (a local server gets a random one).")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL, help="Model to serve locally.")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--clients", type=int, default=4, help="Concurrent clients per phase.")
    parser.add_argument("--duration", type=float, default=10.0, help="Seconds per phase.")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Alternate the phases ABBA over this many rounds (duration is split).")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sensitivity", help="X-Pruning-Sensitivity of the pruned phase (default: server's).")
    parser.add_argument("--workers", type=int, default=1, help="Local server: generations at once.")
    parser.add_argument("--queue-depth", type=int, default=64, help="Local server: admission limit.")
    parser.add_argument("--timeout", type=float, default=120.0, help="Per-request client timeout, seconds.")
    parser.add_argument("--json", type=Path, help="Also write the reports here as JSON.")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.rounds < 1:
        parser.error("--clients and --rounds must be >= 1 and --duration > 0")

    prompts = load_prompts()
    with ExitStack() as stack:
        url, api_key = args.url, args.api_key
        if url is None:
            from prunewatch.server import (
                ServerSettings,
                build_engine,
                create_app,
                serve_in_background,
            )

            engine = build_engine(args.model_dir, device=args.device)
            api_key = secrets.token_urlsafe(16)
            settings = ServerSettings(api_keys=[api_key], workers=args.workers, queue_depth=args.queue_depth,
                                      max_tokens_limit=max(args.max_tokens, 16), default_max_tokens=16)
            url = stack.enter_context(serve_in_background(create_app(engine, settings)))
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = httpx.get(f"{url}/v1/models", headers=auth, timeout=args.timeout).json()["data"][0]["id"]
        warm = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=args.timeout,
                          json={"model": model, "messages": prompts[0], "max_tokens": 2})
        warm.raise_for_status()
        reports = run_phases(url, api_key, model, prompts, sensitivity=args.sensitivity, clients=args.clients,
                             duration_s=args.duration, rounds=args.rounds, max_tokens=args.max_tokens,
                             timeout_s=args.timeout)
    print(f"model {model} at {url}; {args.clients} clients x {args.duration:g} s per phase in {args.rounds} "
          f"ABBA rounds, max_tokens {args.max_tokens}; latency is client-side, nearest-rank percentiles")
    print_table(reports)
    pruned, dense = reports
    if pruned.completion_tokens_per_s and dense.completion_tokens_per_s:
        print(f"throughput pruned/dense: {pruned.completion_tokens_per_s / dense.completion_tokens_per_s:.3f}x "
              f"completion tokens/s at mean measured pruning ratio {pruned.mean_pruning_ratio} (linear FLOPs)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    return 0 if all(not r.errors for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
