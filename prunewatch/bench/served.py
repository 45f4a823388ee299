"""The served path of `bench speed`: `prunewatch serve` on 127.0.0.1 in a process of its own, streamed and
timed by the client, as a user of the API meets it.

The server runs the same model folder with the same intra-op threads as the in-process runs beside it, eagerly
(compiled decode off), with its default pruning (the engine's defaults, as the in-process "pruned" run) or dense
(`X-Pruning-Sensitivity: 0`). A run streams one chat completion of the bench's prompt and times, on the client,
the server-sent chunks that carry text: one per generated token, the first token's to the last's, so the rate
covers the same decode steps the in-process timer does (first generated token to last), plus what serving adds to
each token (the streaming bridge, the event loop, HTTP).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

from prunewatch.bench.llama_cpp import LlamaCpp, PeerUnavailableError, server_command

logger = logging.getLogger("prunewatch.bench.speed")

_DROPPED_ENV = ("PRUNEWATCH_API_KEYS", "PRUNEWATCH_API_KEYS_FILE")  # a loopback server for the bench only: no auth


@dataclass(frozen=True)
class ServedDecode:
    """One streamed completion, timed by the client."""

    tokens_per_s: float  # (text chunks - 1) / (last chunk's arrival - first's)
    chunks: int  # chunks that carried text: one per generated token
    completion_tokens: int  # as the server's usage reports them
    prompt_tokens: int
    decode_pruning_ratio: float | None  # from the final chunk's prunewatch stats
    finish_reason: str | None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LoopbackServer:
    """A server in a child process on 127.0.0.1, on a free port: a context manager (started on entry, stopped on
    exit). Its log goes to a temporary file, whose end is shown when it fails to start. Subclasses say how to
    start it (`command`, `environment`) and when it is ready (`ready`)."""

    HOST = "127.0.0.1"
    label = "server"

    def __init__(self, startup_timeout_s: float = 900.0) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.model_name = ""
        self._process: subprocess.Popen | None = None
        self._log: tempfile._TemporaryFileWrapper | None = None
        self._client: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"http://{self.HOST}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def ready(self, client: httpx.Client) -> bool:
        """Whether the server answers; sets `model_name` when it does."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.port = _free_port(self.HOST)
        self._log = tempfile.NamedTemporaryFile(prefix=f"prunewatch-bench-{self.label}-", suffix=".log", delete=False)
        started = time.perf_counter()
        self._process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         env=self.environment(), stdin=subprocess.DEVNULL)
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=5.0))
        try:
            self._wait_until_listening()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        logger.info("%s (%s) listening on %s after %.0f s", self.label, self.describe(), self.url,
                    time.perf_counter() - started)
        return self

    def describe(self) -> str:
        return self.model_name

    def _wait_until_listening(self) -> None:
        assert self._process is not None and self._client is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self._process.returncode} before listening:\n"
                                   f"{self.log_tail()}")
            try:
                if self.ready(self._client):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label} did not listen within {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None:
            return ""
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def __exit__(self, *exc: object) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)  # a graceful stop (uvicorn, llama-server)
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(30)
        self._process = None
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None


class ServedModel(LoopbackServer):
    """`prunewatch serve --model DIR` on 127.0.0.1 in a child process, with `threads` intra-op threads per
    generation, eager (compiled decode off), without API keys."""

    label = "prunewatch serve"

    def __init__(self, model_dir: Path, *, threads: int, calibration_dir: Path | None = None, device: str = "cpu",
                 startup_timeout_s: float = 900.0, weights: str | None = None,
                 prefix_cache_entries: int | None = None) -> None:
        super().__init__(startup_timeout_s)
        self.model_dir, self.threads, self.device = Path(model_dir), threads, device
        self.weights = weights  # EngineSettings.weights of the server (None: the environment's, else fp32)
        self.prefix_cache_entries = prefix_cache_entries  # EngineSettings' (None: the environment's, else default)
        self.calibration_dir = calibration_dir

    def command(self) -> list[str]:
        return [sys.executable, "-m", "prunewatch", "serve", "--model", str(self.model_dir), "--host", self.HOST,
                "--port", str(self.port), "--device", self.device, "--threads", str(self.threads),
                *(["--weights", self.weights] if self.weights else [])]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env["PRUNEWATCH_ENGINE_COMPILE_DECODE"] = "false"  # the eager engine, as the in-process runs it is held to
        if self.calibration_dir is not None:
            env["PRUNEWATCH_ENGINE_CALIBRATION_DIR"] = str(self.calibration_dir)
        if self.prefix_cache_entries is not None:
            env["PRUNEWATCH_ENGINE_PREFIX_CACHE_ENTRIES"] = str(self.prefix_cache_entries)
        return env

    def ready(self, client: httpx.Client) -> bool:
        models = client.get("/v1/models", timeout=2.0)
        if models.status_code != 200:
            return False
        self.model_name = models.json()["data"][0]["id"]
        return True

    def describe(self) -> str:
        return f"{self.model_name}, {self.weights or 'default'} weights, {self.threads} threads"

    def decode(self, prompt: str, new_tokens: int, *, dense: bool) -> ServedDecode:
        """Stream one chat completion of `prompt` (`new_tokens` at most) and time its text chunks."""
        if self._client is None:
            raise RuntimeError("the server is not running (use ServedModel as a context manager)")
        body = {"model": self.model_name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": new_tokens, "stream": True}
        headers = {"X-Pruning-Sensitivity": "0"} if dense else {}
        arrivals: list[float] = []
        final: dict = {}
        with self._client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the served completion failed: HTTP {response.status_code} "
                                   f"{response.read().decode(errors='replace')[:300]}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise RuntimeError(f"the served completion failed mid-stream: {event['error']}")
                if event["choices"][0]["delta"].get("content"):
                    arrivals.append(now)
                if "usage" in event:
                    final = event
        if len(arrivals) < 2:
            raise RuntimeError(f"the served completion streamed {len(arrivals)} text chunks; at least 2 are needed "
                               "to time a decode step")
        stats = final.get("prunewatch") or {}
        return ServedDecode(
            tokens_per_s=(len(arrivals) - 1) / (arrivals[-1] - arrivals[0]), chunks=len(arrivals),
            completion_tokens=int(final.get("usage", {}).get("completion_tokens", 0)),
            prompt_tokens=int(final.get("usage", {}).get("prompt_tokens", 0)),
            decode_pruning_ratio=stats.get("decode_pruning_ratio"),
            finish_reason=(final.get("choices") or [{}])[0].get("finish_reason"))


class LlamaServer(LoopbackServer):
    """llama.cpp's `llama-server` on a GGUF with `slots` parallel sequences, on 127.0.0.1 in a child process."""

    label = "llama-server"

    def __init__(self, llama: LlamaCpp, gguf: Path, *, threads: int, slots: int, startup_timeout_s: float = 300.0
                 ) -> None:
        super().__init__(startup_timeout_s)
        if not llama.tool("llama-server").is_file():
            raise PeerUnavailableError(f"no llama-server in {llama.bin_dir}: build it with `bash bench/build-llama-cpp.sh`")
        self.llama, self.gguf, self.threads, self.slots = llama, gguf, threads, slots

    def command(self) -> list[str]:
        return server_command(self.llama, self.gguf, threads=self.threads, slots=self.slots, port=self.port,
                              host=self.HOST)

    def ready(self, client: httpx.Client) -> bool:
        if client.get("/health", timeout=2.0).status_code != 200:  # 503 while the model loads
            return False
        models = client.get("/v1/models", timeout=2.0)
        self.model_name = models.json()["data"][0]["id"] if models.status_code == 200 else self.gguf.name
        return True

    def describe(self) -> str:
        return f"{self.gguf.name}, {self.slots} slots, {self.threads} threads"
