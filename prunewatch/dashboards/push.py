"""Upload the dashboards to a running Grafana through its HTTP API (grafana-client).

The calls are the documented classic API: GET /api/health (version), GET /api/folders and
POST /api/folders (find or create the folder), GET /api/dashboards/uid/:uid and
POST /api/dashboards/db with overwrite (upsert). A dashboard whose stored model already equals
ours is left alone, so a second push changes nothing, not even Grafana's version history.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from prunewatch.dashboards.build import build_dashboards
from prunewatch.dashboards.panels import Json

logger = logging.getLogger("prunewatch.dashboards")

TOKEN_ENV = "GRAFANA_TOKEN"
"""Environment variable holding the Grafana service-account token (grafana-client's own name for it)."""

SUPPORTED_GRAFANA = ((10, 2, 3), (13, 0, 0))
"""[lowest, first unsupported): the PostgreSQL plugin id the dashboards use exists from 10.2.3 on, and
the classic /api/dashboards/db model is what 10.x to 12.x import."""

PUSH_MESSAGE = "prunewatch dashboards push"
_VOLATILE = ("id", "version")  # set by Grafana on save; not part of what we define


class GrafanaPushError(RuntimeError):
    """The push could not be done; the message says what to change (URL, token, Grafana version)."""


class PushSettings(BaseModel):
    """Where and as whom to push; the token is masked when the settings are printed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(..., min_length=1, description="Grafana base URL, e.g. http://localhost:3000 (with any sub-path).")
    folder: str = Field("prunewatch", min_length=1, max_length=255, description="Folder title; created when absent.")
    token: SecretStr = Field(..., min_length=1, description="Service-account token (Editor role or better).")
    timeout_s: float = Field(10.0, gt=0.0, le=300.0, description="Per-request timeout in seconds.")

    @classmethod
    def from_env(cls, **values: Any) -> PushSettings:
        """Settings with the token read from GRAFANA_TOKEN; a clear error when it is unset or empty."""
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise GrafanaPushError(f"set {TOKEN_ENV} to a Grafana service-account token (Editor role)")
        return cls(token=token, **values)


@dataclass
class PushReport:
    """What a push did, dashboard by dashboard."""

    grafana_version: str
    folder_uid: str
    folder_created: bool
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def folder_uid_for(title: str) -> str:
    """A stable folder uid from its title (Grafana uids: letters, digits, - and _, at most 40)."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", title.strip()).strip("-").lower()
    if not slug:
        raise GrafanaPushError(f"folder title {title!r} has no letters or digits to build a uid from")
    return slug[:40]


def parse_version(text: str) -> tuple[int, int, int]:
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", text.strip())
    if not match:
        raise GrafanaPushError(f"Grafana reported version {text!r}, which is not MAJOR.MINOR.PATCH")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def _api(url: str, token: str, timeout_s: float) -> GrafanaApi:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise GrafanaPushError(f"--url must be an http(s) URL such as http://localhost:3000, got {url!r}")
    prefix = parsed.path.strip("/")
    return GrafanaApi(token, host=parsed.hostname, port=parsed.port, protocol=parsed.scheme,
                      url_path_prefix=f"{prefix}/" if prefix else "", timeout=timeout_s)


def _explain(exc: GrafanaException, action: str, url: str) -> GrafanaPushError:
    """One actionable line for a failed API call."""
    status = exc.status_code
    body = exc.response if isinstance(exc.response, dict) else {}
    detail = body.get("message") or (exc.response if isinstance(exc.response, str) else "") or exc.message
    detail = str(detail).strip().splitlines()[0][:200] if detail else ""
    if isinstance(exc, GrafanaUnauthorizedError) or status == 401:
        return GrafanaPushError(f"Grafana at {url} rejected the token (401) while trying to {action}: set "
                                f"{TOKEN_ENV} to a valid service-account token")
    if status == 403:
        return GrafanaPushError(f"the token may not {action} (403 access denied): give its service account "
                                f"the Editor role on the folder")
    if status == 404:
        return GrafanaPushError(f"Grafana at {url} answered 404 while trying to {action}: check --url "
                                f"(include the sub-path if Grafana is served under one)")
    if status == 412:
        reason = body.get("status", "precondition failed")
        return GrafanaPushError(f"Grafana refused to {action} ({reason}): {detail}")
    if status == 0:
        return GrafanaPushError(f"could not {action} at {url}: {detail}")
    return GrafanaPushError(f"Grafana answered {status} while trying to {action}: {detail}")


def _call(action: str, url: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one API call, turning every client or transport error into a GrafanaPushError."""
    try:
        return fn(*args)
    except GrafanaException as exc:
        raise _explain(exc, action, url) from exc
    except OSError as exc:  # transport errors (the HTTP client's RequestException is an OSError)
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise GrafanaPushError(f"cannot reach Grafana at {url} to {action}: {reason}") from exc


def check_version(api: GrafanaApi, url: str) -> str:
    """Grafana's version from GET /api/health, refused when outside the supported range."""
    health = _call("read its health and version", url, api.client.GET, "/health")
    if not isinstance(health, dict) or "version" not in health:
        raise GrafanaPushError(f"{url} answered GET /api/health without a version: either --url is not a "
                               "Grafana, or it hides its version (the push needs it to check compatibility)")
    version = str(health["version"])
    low, high = SUPPORTED_GRAFANA
    if not low <= parse_version(version) < high:
        raise GrafanaPushError(
            f"Grafana {version} at {url} is not supported: these dashboards use the classic JSON model "
            f"that Grafana {'.'.join(map(str, low))} up to (not including) {high[0]}.0 import")
    return version


def ensure_folder(api: GrafanaApi, url: str, title: str) -> tuple[str, bool]:
    """The uid of the folder titled `title` (or with its derived uid), creating it if absent."""
    wanted_uid = folder_uid_for(title)
    folders = _call("list folders", url, api.folder.get_all_folders)
    if not isinstance(folders, list):
        raise GrafanaPushError(f"GET /api/folders at {url} did not return a list: is --url a Grafana?")
    for folder in folders:
        if folder.get("title") == title or folder.get("uid") == wanted_uid:
            return str(folder["uid"]), False
    created = _call(f"create folder {title!r}", url, api.folder.create_folder, title, wanted_uid)
    return str(created.get("uid", wanted_uid)), True


def _comparable(dashboard: Json) -> Json:
    return {k: v for k, v in dashboard.items() if k not in _VOLATILE}


def upsert_dashboard(api: GrafanaApi, url: str, dashboard: Json, folder_uid: str) -> str:
    """Create or overwrite one dashboard; returns "created", "updated" or "unchanged"."""
    uid = dashboard["uid"]
    try:
        stored = api.dashboard.get_dashboard(uid)
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise _explain(exc, f"read dashboard {uid}", url) from exc
        stored = None
    except (GrafanaException, OSError) as exc:
        raise GrafanaPushError(f"could not read dashboard {uid} at {url}: {exc}".splitlines()[0]) from exc
    if stored is not None:
        same_folder = stored.get("meta", {}).get("folderUid") == folder_uid
        if same_folder and _comparable(stored.get("dashboard", {})) == _comparable(dashboard):
            return "unchanged"
    payload = {"dashboard": dict(dashboard, id=None), "folderUid": folder_uid, "overwrite": True,
               "message": PUSH_MESSAGE}
    _call(f"save dashboard {uid}", url, api.dashboard.update_dashboard, payload)
    return "updated" if stored is not None else "created"


def push_dashboards(settings: PushSettings, dashboards: dict[str, Json] | None = None) -> PushReport:
    """Check the version, find or create the folder, then upsert every dashboard into it."""
    dashboards = dashboards if dashboards is not None else build_dashboards()
    url = settings.url.rstrip("/")
    api = _api(url, settings.token.get_secret_value(), settings.timeout_s)
    version = check_version(api, url)
    folder_uid, folder_created = ensure_folder(api, url, settings.folder)
    report = PushReport(grafana_version=version, folder_uid=folder_uid, folder_created=folder_created)
    for dashboard in dashboards.values():
        outcome = upsert_dashboard(api, url, dashboard, folder_uid)
        getattr(report, outcome).append(dashboard["uid"])
        logger.info("dashboard %s %s in folder %s", dashboard["uid"], outcome, folder_uid)
    return report
