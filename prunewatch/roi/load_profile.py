"""Throughput under load: a `prunewatch bench load` results file, read for the cost model.

Why: a server under concurrent load decodes several requests in each step (continuous batching), so the compute
a request costs is its output tokens over the *aggregate* tokens per second at the deployment's concurrency, not
its single-stream time; and batching changes what pruning saves. This module reads the measured aggregate
throughput of the dense and default (pruned) configurations at each measured concurrency, and prices it:
cost per 1M output tokens = hourly price / (aggregate tokens/s x 3600) x 1e6.

Only measured levels are offered: a concurrency the run did not measure is an error naming the ones it did, never
an interpolation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prunewatch.roi.errors import RoiError
from prunewatch.roi.provenance import Provenance

DENSE, PRUNED = "dense", "default"  # series names `prunewatch bench load` writes
SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MTOK = 1e6


class LoadProfileError(RoiError):
    """The load results file cannot be used (missing, not JSON, missing series, nonpositive throughput)."""


class UnmeasuredConcurrencyError(LoadProfileError):
    """The asked concurrency is not one of the levels the load run measured."""


def cost_per_mtok(hourly_usd: float, tokens_per_s: float) -> float:
    """Dollars per 1M output tokens of a server that streams `tokens_per_s` in aggregate and costs `hourly_usd`.

    The server is paid by the hour whatever it computes, so a token costs the hour's price over the tokens the
    hour produces at that load."""
    if not tokens_per_s > 0:
        raise LoadProfileError(f"aggregate throughput must be positive to price a token, got {tokens_per_s}")
    return hourly_usd / (tokens_per_s * SECONDS_PER_HOUR) * TOKENS_PER_MTOK


class LoadLevel(BaseModel):
    """Measured aggregate output tokens/s of dense and pruned serving at one number of concurrent clients."""

    model_config = ConfigDict(frozen=True)

    clients: int = Field(ge=1)
    dense_tokens_per_s: float = Field(gt=0.0)
    pruned_tokens_per_s: float = Field(gt=0.0)

    @property
    def pruned_vs_dense(self) -> float:
        """Pruned aggregate throughput over dense's: above 1 pruning pays at this load, below 1 it costs."""
        return self.pruned_tokens_per_s / self.dense_tokens_per_s

    @property
    def time_factor(self) -> float:
        """Compute time per output token after / before pruning (the inverse of the throughput ratio)."""
        return self.dense_tokens_per_s / self.pruned_tokens_per_s


class LoadCostRow(BaseModel):
    """Cost per 1M output tokens dense vs pruned at one measured level (the 'where pruning stops paying' table)."""

    model_config = ConfigDict(frozen=True)

    level: LoadLevel
    hourly_usd: float
    dense_usd_per_mtok: float
    pruned_usd_per_mtok: float

    @property
    def pays(self) -> bool:
        """Whether a pruned token is cheaper than a dense one at this load."""
        return self.pruned_usd_per_mtok < self.dense_usd_per_mtok


class LoadProfile(BaseModel):
    """One load run: where it came from, and the dense and pruned aggregate throughput per concurrency."""

    model_config = ConfigDict(frozen=True)

    path: str  # as given, so messages and the report name the file the user passed
    created_at: str
    command: str
    device: str  # "cpu" or the GPU's name, as `prunewatch bench load` records machine.device
    machine: str  # where it ran, e.g. "cpu: AMD EPYC, 2 threads"
    model: str
    max_tokens: int | None = None
    window_s: float | None = None
    levels: tuple[LoadLevel, ...]

    @classmethod
    def from_file(cls, path: Path | str) -> LoadProfile:
        """Read a results file of `prunewatch bench load`; LoadProfileError with a one-line message otherwise."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise LoadProfileError(f"no load results file at {path}; run `prunewatch bench load` to write one") from None
        except OSError as exc:
            raise LoadProfileError(f"cannot read load results file {path}: {exc.strerror or exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LoadProfileError(f"load results file {path} is not JSON: {exc.msg} at line {exc.lineno}") from exc
        return cls.from_data(data, str(path))

    @classmethod
    def from_data(cls, data: Any, path: str) -> LoadProfile:
        """Build from the decoded JSON of a results file; `path` names it in messages."""
        if not isinstance(data, dict):
            raise LoadProfileError(f"load results file {path} must hold a JSON object (a `prunewatch bench load` result)")
        series = data.get("series")
        if not isinstance(series, dict):
            raise LoadProfileError(f"load results file {path} has no series; is it a `prunewatch bench load` result?")
        missing = [name for name in (DENSE, PRUNED) if not isinstance(series.get(name), list) or not series[name]]
        if missing:
            held = ", ".join(sorted(series)) or "none"
            raise LoadProfileError(f"load results file {path} has no {' and no '.join(missing)} series (it holds: "
                                   f"{held}); the ROI needs both, measured in the same run")
        dense, pruned = _rates(series[DENSE], DENSE, path), _rates(series[PRUNED], PRUNED, path)
        if set(dense) != set(pruned):
            raise LoadProfileError(f"load results file {path} measured dense at {_levels(dense)} clients but default "
                                   f"at {_levels(pruned)}; the ROI compares them at the same concurrency")
        machine, model = _mapping(data.get("machine")), _mapping(data.get("model"))
        device = str(machine.get("device") or "device not recorded")
        return cls(
            path=path, created_at=str(data.get("created_at") or "time not recorded"),
            command=str(data.get("command") or "command not recorded"), device=device,
            machine=_machine(device, machine, data.get("threads")), model=str(model.get("name") or "not recorded"),
            max_tokens=data.get("max_tokens") if isinstance(data.get("max_tokens"), int) else None,
            window_s=float(data["window_s"]) if isinstance(data.get("window_s"), int | float) else None,
            levels=tuple(LoadLevel(clients=c, dense_tokens_per_s=dense[c], pruned_tokens_per_s=pruned[c])
                         for c in sorted(dense)))

    @property
    def concurrencies(self) -> tuple[int, ...]:
        """The measured numbers of concurrent clients, ascending: the only ones a deployment can be priced at."""
        return tuple(level.clients for level in self.levels)

    @property
    def on_gpu(self) -> bool:
        return self.device not in ("cpu", "device not recorded")

    @property
    def time_noun(self) -> str:
        """What its time per token is: 'GPU time' only when the load ran on a GPU (priced at a GPU hour either way)."""
        if self.on_gpu:
            return "GPU time"
        return "CPU time" if self.device == "cpu" else "Time"

    @property
    def source(self) -> str:
        """Where the figures come from, in one phrase every measured figure's note repeats."""
        return f"{self.path}: measured by `{self.command}` at {self.created_at} on {self.machine}, model {self.model}"

    def at(self, clients: int) -> LoadLevel:
        """The measured level of `clients` concurrent clients; UnmeasuredConcurrencyError names the measured ones."""
        for level in self.levels:
            if level.clients == clients:
                return level
        raise UnmeasuredConcurrencyError(
            f"concurrency {clients} was not measured in {self.path}; measured levels: {_levels(self.concurrencies)} "
            f"(or measure it: prunewatch bench load --clients {clients})")

    def cost_rows(self, hourly_usd: float) -> list[LoadCostRow]:
        """Cost per 1M output tokens dense and pruned at every measured level, at one GPU hourly price."""
        return [LoadCostRow(level=level, hourly_usd=hourly_usd,
                            dense_usd_per_mtok=cost_per_mtok(hourly_usd, level.dense_tokens_per_s),
                            pruned_usd_per_mtok=cost_per_mtok(hourly_usd, level.pruned_tokens_per_s))
                for level in self.levels]


class LoadPoint(BaseModel):
    """A load profile at the deployment's concurrency, with how that concurrency was chosen."""

    model_config = ConfigDict(frozen=True)

    profile: LoadProfile
    concurrency: int
    concurrency_provenance: Provenance = Provenance.USER_ENTERED

    @classmethod
    def choose(cls, profile: LoadProfile, concurrency: int,
               provenance: Provenance = Provenance.USER_ENTERED) -> LoadPoint:
        """Check that `concurrency` was measured (UnmeasuredConcurrencyError otherwise) and bind it."""
        profile.at(concurrency)
        return cls(profile=profile, concurrency=concurrency, concurrency_provenance=provenance)

    @property
    def level(self) -> LoadLevel:
        return self.profile.at(self.concurrency)


def clients_text(clients: int) -> str:
    """'1 concurrent client', '4 concurrent clients'."""
    return f"{clients} concurrent client" + ("" if clients == 1 else "s")


def _levels(clients: Sequence[int] | dict[int, float]) -> str:
    return ", ".join(str(c) for c in sorted(clients))


def _rates(rows: list[Any], name: str, path: str) -> dict[int, float]:
    """clients -> aggregate tokens/s of one series; nonpositive or absent throughput is an error, not a zero."""
    rates: dict[int, float] = {}
    for row in rows:
        clients = row.get("clients") if isinstance(row, dict) else None
        if not isinstance(clients, int) or isinstance(clients, bool) or clients < 1:
            raise LoadProfileError(f"load results file {path}: a {name} row has no positive integer `clients`")
        rate = row.get("aggregate_tokens_per_s")
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not rate > 0:
            raise LoadProfileError(f"load results file {path}: {name} at {clients} clients has aggregate_tokens_per_s "
                                   f"{rate!r}; a throughput must be positive to price a token")
        if clients in rates:
            raise LoadProfileError(f"load results file {path}: {name} measured {clients} clients twice")
        rates[clients] = float(rate)
    return rates


def _mapping(value: Any) -> dict[str, Any]:
    """A nested object of the file, or {} where it is absent (older runs record fewer machine facts)."""
    return value if isinstance(value, dict) else {}


def _machine(device: str, machine: dict[str, Any], threads: Any) -> str:
    """'cpu: AMD EPYC, 2 threads' or 'NVIDIA H200', from the run's machine facts."""
    where = f"cpu: {machine['cpu']}" if device == "cpu" and machine.get("cpu") else device
    return where + (f", {threads} threads" if isinstance(threads, int) else "")
