"""`prunewatch doctor`: the pruning autopsy checklist for one target, one PASS/FAIL line per check.

Checks, in order: reachable, auth works, model listed, a minimal request returns pruning headers,
ratio plausible, calibration matches the model, clocks sane, store reachable and migrated,
metrics endpoint up. A check that cannot run because an earlier one failed is SKIP; each FAIL
says what to do.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx
from sqlalchemy import text

from prunewatch.collector.http_target import RATIO_HEADER, STATS_HEADER, HttpTarget
from prunewatch.collector.target_config import ResolvedTarget
from prunewatch.probes import Probe, ProbeSet, load_calibration_set

MAX_CLOCK_SKEW_S = 5.0  # beyond this, dashboards and alert windows disagree about "now"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def lines(self) -> list[str]:
        out = [f"{self.status:<5} {self.name:<22} {self.detail}"]
        if self.fix and self.status != "PASS":
            out.append(f"{'':<5} {'':<22} -> {self.fix}")
        return out


def _pass(name: str, detail: str) -> Check:
    return Check(name, "PASS", detail)


def _fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "FAIL", detail, fix)


def _skip(name: str, why: str) -> Check:
    return Check(name, "SKIP", why)


def _small_probe(probe_set: ProbeSet, domains: list[str] | None) -> Probe:
    probe = next((p for p in probe_set.probes if not domains or p.domain in domains), probe_set.probes[0])
    return replace(probe, max_tokens=min(4, probe.max_tokens))


def ratio_check(ratio: float | None, sensitivity: float | None, executed: float | None, dense: float | None,
                fallback: str | None) -> Check:
    """Is a reported ratio believable: within [0, 1], equal to 1 - executed/dense, nonzero when asked to prune?"""
    name = "ratio plausible"
    if ratio is None:
        return _fail(name, "no ratio reported", "see the pruning headers check")
    if not 0.0 <= ratio <= 1.0:
        return _fail(name, f"ratio {ratio} is outside [0, 1]", "report this engine build: the ratio counter is broken")
    if executed is not None and dense:
        expected = 1.0 - executed / dense
        if abs(expected - ratio) > 1e-4:
            return _fail(name, f"ratio {ratio:.6f} but 1 - executed/dense FLOPs = {expected:.6f}",
                         "the engine's counters disagree; report this engine build")
    if sensitivity and ratio == 0.0:
        why = f" (fallback: {fallback})" if fallback else ""
        return _fail(name, f"ratio 0 at sensitivity {sensitivity}{why}",
                     "calibrate the model for these domains (prunewatch calibrate) or check the prompt's domain")
    return _pass(name, f"{ratio:.3f} at sensitivity {sensitivity} (measured; 1 - executed/dense FLOPs agrees)")


def clock_check(name: str, remote: datetime | None, local: datetime, what: str, resolution_s: float) -> Check:
    if remote is None:
        return _skip(name, f"{what} gave no time")
    skew = (remote - local).total_seconds()
    if abs(skew) > MAX_CLOCK_SKEW_S + resolution_s:
        return _fail(name, f"{what} is {skew:+.1f} s off this host's clock",
                     "synchronise both clocks with NTP (chrony / systemd-timesyncd)")
    return _pass(name, f"{what} within {abs(skew):.1f} s of this host (limit {MAX_CLOCK_SKEW_S:g} s); "
                       "rows are stored in UTC")


def store_checks(db_url: str) -> list[Check]:
    """Store reachable, migrated to the newest revision, its clock sane (PostgreSQL)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from prunewatch.records.store import StoreUnavailableError, connect
    from prunewatch.records.store.migrate import current_revision, head_revision

    try:
        url = make_url(db_url)
    except ArgumentError:
        return [_fail("store reachable", f"invalid database URL {db_url!r}", "fix --db / collector.db_url"),
                _skip("store migrated", "store unreachable")]
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).is_file():
        # Connecting would create an empty file: say what is missing instead.
        return [_fail("store reachable", f"no SQLite store at {url.database}",
                      f"run: prunewatch db upgrade --db {db_url} (or point --db at the collector's store)"),
                _skip("store migrated", "store missing")]
    try:
        engine = connect(db_url)
    except StoreUnavailableError as exc:
        return [_fail("store reachable", str(exc), "start the database or fix --db / collector.db_url"),
                _skip("store migrated", "store unreachable")]
    try:
        checks = [_pass("store reachable", engine.url.render_as_string(hide_password=True))]
        revision, head = current_revision(engine), head_revision()
        if revision == head:
            checks.append(_pass("store migrated", f"schema at revision {head} (newest)"))
        else:
            checks.append(_fail("store migrated", f"schema at {revision or 'no revision'}, newest is {head}",
                                f"run: prunewatch db upgrade --db '{engine.url.render_as_string(hide_password=True)}'"))
        if engine.dialect.name == "postgresql":
            with engine.connect() as connection:
                db_now = connection.execute(text("SELECT now()")).scalar_one()
            checks.append(clock_check("store clock", db_now, datetime.now(UTC), "the database clock", 0.0))
        return checks
    finally:
        engine.dispose()


_SERVED_BY = {"the collector": "`prunewatch run` or `prunewatch collect`", "the engine": "`prunewatch serve`"}


def _metrics_check(url: str, headers: dict[str, str] | None = None, who: str = "the collector") -> Check:
    name = "metrics endpoint"
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return _fail(name, f"GET {url}: HTTP {exc.code}",
                         "give Prometheus the API key (authorization in scrape_config) or set "
                         "PRUNEWATCH_SERVER_PUBLIC_METRICS=true on the engine")
        return _fail(name, f"GET {url}: HTTP {exc.code}", f"check that {who} serves /metrics at this URL")
    except OSError as exc:
        return _fail(name, f"GET {url}: {getattr(exc, 'reason', exc)}",
                     f"start {who} ({_SERVED_BY.get(who, 'it')} serves /metrics) or pass --metrics-url")
    families = sum(1 for line in body.splitlines() if line.startswith("# TYPE prunewatch_"))
    if not families:
        return _fail(name, f"GET {url}: no prunewatch_ metrics",
                     "point --metrics-url at a prunewatch /metrics endpoint")
    return _pass(name, f"GET {url}: {families} prunewatch metric families")


def diagnose_http(spec: ResolvedTarget, probe_set: ProbeSet, *, transport: httpx.BaseTransport | None = None,
                  collector_metrics_url: str | None = None) -> list[Check]:
    """The target-side checks of an HTTP target (prunewatch engine or baseline)."""
    if spec.kind == "in_process":
        raise ValueError(f"target {spec.name} is in_process: it has no HTTP side to diagnose")
    target = HttpTarget(name=spec.name, base_url=spec.base_url or "", model=spec.model or "", kind=spec.kind,
                        api_key=spec.api_key(), timeout_s=min(spec.timeout_s, 30.0), sensitivity=spec.sensitivity,
                        transport=transport)
    checks: list[Check] = []
    dependent = ["auth", "model listed", "pruning headers", "ratio plausible", "calibration", "target clock"]
    path = "/health" if spec.kind == "prunewatch" else "/v1/models"
    began = time.perf_counter()
    try:
        response = target.request("GET", path)
    except Exception as exc:  # unreachable or timed out
        checks.append(_fail("reachable", f"GET {spec.base_url}{path}: {exc}",
                            f"start the server or fix base_url; from this host try: curl {spec.base_url}{path}"))
        return checks + [_skip(name, "target unreachable") for name in dependent] + (
            [_metrics_check(collector_metrics_url)] if collector_metrics_url else [])
    checks.append(_pass("reachable", f"GET {path}: HTTP {response.status_code} in "
                                     f"{(time.perf_counter() - began) * 1000:.0f} ms"))
    health = response.json() if spec.kind == "prunewatch" and response.status_code == 200 else {}
    remote_date = None
    if response.headers.get("date"):
        try:
            remote_date = parsedate_to_datetime(response.headers["date"])
        except (TypeError, ValueError):
            remote_date = None
    local_now = datetime.now(UTC)

    models = target.request("GET", "/v1/models")
    key_hint = (f"export {spec.api_key_env}=<a key the server accepts>" if spec.api_key_env else
                "the server wants an API key: add api_key_env: NAME to the target and export NAME")
    if models.status_code in (401, 403):
        checks.append(_fail("auth", f"GET /v1/models: HTTP {models.status_code}", key_hint))
        target.close()
        return checks + [_skip(n, "auth failed") for n in dependent[1:5]] + [
            clock_check("target clock", remote_date, local_now, "the target's clock", 1.0),
            _skip("metrics endpoint", "auth failed")]
    checks.append(_pass("auth", f"key from ${spec.api_key_env} accepted" if spec.api_key_env else
                        "the server needs no key"))
    try:
        ids = [str(m["id"]) for m in models.json()["data"]]
    except (ValueError, KeyError, TypeError):
        ids = []
    if spec.model in ids:
        checks.append(_pass("model listed", f"{spec.model} is served"))
    else:
        checks.append(_fail("model listed", f"{spec.model!r} not in GET /v1/models {ids}",
                            f"set model: to one of {ids} in the targets file"))
    probe = _small_probe(probe_set, spec.domains)
    try:
        answer = target.chat(([{"role": "system", "content": probe.system}] if probe.system else [])
                             + [{"role": "user", "content": probe.prompt}], probe.max_tokens)
    except Exception as exc:
        checks.append(_fail("pruning headers", f"a {probe.max_tokens}-token request failed: {exc}",
                            "look at the server's log for this request"))
        checks += [_skip("ratio plausible", "no answer"), _skip("calibration", "no answer")]
    else:
        has_headers = RATIO_HEADER in answer.headers and STATS_HEADER in answer.headers
        body = answer.json().get("prunewatch") or {}
        if spec.kind == "prunewatch":
            if has_headers:
                checks.append(_pass("pruning headers", f"{RATIO_HEADER}: {answer.headers[RATIO_HEADER]}, "
                                                       f"{STATS_HEADER}: {answer.headers[STATS_HEADER]}"))
                checks.append(ratio_check(float(answer.headers[RATIO_HEADER]), spec.sensitivity,
                                          body.get("executed_flops"), body.get("dense_flops"),
                                          body.get("fallback_reason")))
            else:
                checks.append(_fail("pruning headers", "the answer has no X-Pruning-Ratio / X-Pruning-Stats",
                                    "this is not a prunewatch engine, or a proxy strips X-Pruning-* headers; "
                                    "for a plain server use kind: openai"))
                checks.append(_skip("ratio plausible", "no ratio"))
            if health.get("calibrated") is True and body.get("fallback_reason") != "uncalibrated":
                checks.append(_pass("calibration", f"the engine serving {health.get('model')} is calibrated "
                                                   "(it refuses a calibration made for other weights)"))
            else:
                checks.append(_fail("calibration", "the engine has no calibration for its model (runs dense)",
                                    "restart `prunewatch serve` (it calibrates at start) or run prunewatch calibrate"))
        else:
            if has_headers:
                checks.append(_fail("pruning headers", "a baseline (kind: openai) answered with pruning headers",
                                    "this is a prunewatch engine: set kind: prunewatch to record its ratio"))
            else:
                checks.append(_pass("pruning headers", "none, as expected of a baseline (ratio recorded as absent)"))
            checks += [_skip("ratio plausible", "baseline: does not prune"), _skip("calibration", "baseline")]
    checks.append(clock_check("target clock", remote_date, local_now, "the target's clock", 1.0))
    if spec.kind == "prunewatch":
        auth = {"Authorization": f"Bearer {spec.api_key()}"} if spec.api_key() else {}
        checks.append(_metrics_check(f"{spec.base_url}/metrics", auth, who="the engine"))
    elif collector_metrics_url:
        checks.append(_metrics_check(collector_metrics_url))
    target.close()
    return checks


def diagnose_in_process(spec: ResolvedTarget, probe_set: ProbeSet, *, calibration_dir: Path | None = None,
                        collector_metrics_url: str | None = None) -> list[Check]:
    """The same checklist for the engine in this process: load, calibration file, one short probe."""
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.engine.calibration import Calibration
    from prunewatch.engine.errors import EngineError

    checks: list[Check] = []
    try:
        engine = PruningEngine.load(EngineSettings(model_dir=spec.model_dir, device=spec.device,
                                                   calibration_dir=calibration_dir))
    except EngineError as exc:
        return [_fail("reachable", f"model folder {spec.model_dir}: {exc}",
                      "fix the model folder (model_dir in the targets file, PRUNEWATCH_MODEL_DIR for the main job)")] + [
            _skip(n, "model not loaded") for n in ("pruning headers", "ratio plausible", "calibration")]
    checks.append(_pass("reachable", f"loaded {engine.name} from {spec.model_dir} on {engine.loaded.device.type}"))
    checks.append(_skip("auth", "in-process: no API"))
    if spec.model and spec.model != engine.name:
        checks.append(_fail("model listed", f"the folder holds {engine.name!r}, the file says {spec.model!r}",
                            f"set model: {engine.name} (or remove it)"))
    else:
        checks.append(_pass("model listed", f"{engine.name}"))
    calibration_set = load_calibration_set()
    path = engine.calibration_path(calibration_set.digest)
    if not path.is_file():
        checks.append(_fail("calibration", f"no calibration for this model and the calibration set at {path}",
                            "start the collector once (`prunewatch run` or `prunewatch collect` calibrates at start) "
                            "or run prunewatch calibrate"))
    else:
        try:
            engine.use_calibration(Calibration.load(path))
            if engine.settings.activation_sparsity > 0.0:  # probe the engine as the collector runs it
                engine.enable_activation_sparsity(calibration_set.calibration_texts(), calibration_set.digest)
            checks.append(_pass("calibration", f"{path.name} matches the model's weights fingerprint"))
        except EngineError as exc:
            checks.append(_fail("calibration", str(exc), "recalibrate: prunewatch calibrate --model DIR"))
    probe = _small_probe(probe_set, spec.domains)
    try:
        stats = engine.generate(probe.prompt, system=probe.system or None, max_new_tokens=probe.max_tokens,
                                sensitivity=spec.sensitivity).stats
    except EngineError as exc:
        checks.append(_fail("pruning headers", f"a {probe.max_tokens}-token probe failed: {exc}", "see the message"))
        checks.append(_skip("ratio plausible", "no answer"))
    else:
        checks.append(_pass("pruning headers", f"stats carry a {stats.ratio_source} ratio in {stats.ratio_unit}"))
        checks.append(ratio_check(stats.pruning_ratio, spec.sensitivity, stats.executed_flops, stats.dense_flops,
                                  stats.fallback_reason))
    if collector_metrics_url:
        checks.append(_metrics_check(collector_metrics_url))
    return checks


def run_doctor(spec: ResolvedTarget, probe_set: ProbeSet, *, db_url: str, collector_metrics_url: str | None,
               calibration_dir: Path | None = None, transport: httpx.BaseTransport | None = None) -> list[Check]:
    """Every check for one target plus the store, in the order of the checklist."""
    if spec.kind == "in_process":
        checks = diagnose_in_process(spec, probe_set, calibration_dir=calibration_dir,
                                     collector_metrics_url=collector_metrics_url)
        checks.append(_pass("target clock", "in-process: the collector's own clock"))
    else:
        checks = diagnose_http(spec, probe_set, transport=transport, collector_metrics_url=collector_metrics_url)
    metrics = [c for c in checks if c.name == "metrics endpoint"]
    rest = [c for c in checks if c.name != "metrics endpoint"]
    return rest + store_checks(db_url) + metrics
