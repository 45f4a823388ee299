"""An HTTP server that answers the part of Grafana's documented HTTP API the push uses, and checks requests.

Documented behaviour reproduced (docs/sources/developers/http_api: other.md, folder.md, dashboard.md):
GET /api/health (no auth; commit, database, version), GET /api/folders, POST /api/folders
({uid?, title}, 409 on a duplicate), GET /api/dashboards/uid/:uid (404 when absent; dashboard + meta),
POST /api/dashboards/db ({dashboard, folderUid, overwrite, message}; 412 version-mismatch without
overwrite), 401 {"message": "Unauthorized"} without a valid `Authorization: Bearer` header.
Every request is logged; anything outside that contract is recorded in `violations` and refused
with 400, so a test can assert both the conversation and its absence of surprises.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

UID_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
DASHBOARD_KEYS = {"dashboard", "folderUid", "folderId", "overwrite", "message"}
FOLDER_KEYS = {"uid", "title", "parentUid"}


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None
    content_type: str | None
    body: Any


@dataclass
class FakeGrafana:
    token: str = "glsa_test_token"
    version: str | None = "11.3.1"  # None: /api/health omits it (hide_version)
    prefix: str = ""  # Grafana served under a sub-path, e.g. "/grafana"
    plugin_owned: set[str] = field(default_factory=set)  # dashboard uids a plugin provisioned (412)
    requests: list[Request] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    folders: dict[str, dict] = field(default_factory=dict)
    dashboards: dict[str, dict] = field(default_factory=dict)  # uid -> {"dashboard", "folderUid"}
    url: str = ""
    _next_id: int = 1

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id


class _Handler(BaseHTTPRequestHandler):
    server_version = "Grafana"
    grafana: FakeGrafana

    def log_message(self, *_args) -> None:  # keep test output clean
        return None

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _violation(self, message: str) -> None:
        self.grafana.violations.append(f"{self.command} {self.path}: {message}")
        self._send(400, {"message": message})

    def _handle(self) -> None:
        g = self.grafana
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        g.requests.append(Request(self.command, self.path, self.headers.get("Authorization"),
                                  self.headers.get("Content-Type"), body))
        path = self.path.split("?", 1)[0]
        if not path.startswith(g.prefix + "/api/"):
            self._send(404, {"message": "Not found"})
            return
        path = path[len(g.prefix):]
        if raw and not (self.headers.get("Content-Type") or "").startswith("application/json"):
            self._violation("a JSON body needs Content-Type: application/json")
            return
        if path == "/api/health" and self.command == "GET":
            health = {"commit": "0123abcd", "database": "ok", "version": g.version}
            self._send(200, {k: v for k, v in health.items() if v is not None})
            return
        if self.headers.get("Authorization") != f"Bearer {g.token}":
            self._send(401, {"message": "Unauthorized"})
            return
        route = (self.command, path)
        if route == ("GET", "/api/folders"):
            self._send(200, [{"id": f["id"], "uid": f["uid"], "title": f["title"]} for f in g.folders.values()])
        elif route == ("POST", "/api/folders"):
            self._create_folder(body)
        elif self.command == "GET" and path.startswith("/api/dashboards/uid/"):
            self._get_dashboard(path.rsplit("/", 1)[1])
        elif route == ("POST", "/api/dashboards/db"):
            self._save_dashboard(body)
        else:
            self._send(404, {"message": "Not found"})

    def _create_folder(self, body: Any) -> None:
        g = self.grafana
        if not isinstance(body, dict) or not isinstance(body.get("title"), str) or not body["title"]:
            self._violation("folder body needs a non-empty title")
            return
        if set(body) - FOLDER_KEYS:
            self._violation(f"unknown folder fields {sorted(set(body) - FOLDER_KEYS)}")
            return
        uid = body.get("uid") or f"auto{g.new_id()}"
        if not UID_RE.match(uid):
            self._violation(f"folder uid {uid!r} is not a Grafana uid")
            return
        if uid in g.folders or any(f["title"] == body["title"] for f in g.folders.values()):
            self._send(409, {"message": "a folder with the same name already exists"})
            return
        folder = {"id": g.new_id(), "uid": uid, "title": body["title"], "url": f"/dashboards/f/{uid}/",
                  "version": 1}
        g.folders[uid] = folder
        self._send(200, folder)

    def _get_dashboard(self, uid: str) -> None:
        stored = self.grafana.dashboards.get(uid)
        if stored is None:
            self._send(404, {"message": "Dashboard not found"})
            return
        self._send(200, {"dashboard": stored["dashboard"],
                         "meta": {"folderUid": stored["folderUid"], "url": f"/d/{uid}/", "isStarred": False}})

    def _save_dashboard(self, body: Any) -> None:
        g = self.grafana
        if not isinstance(body, dict) or set(body) - DASHBOARD_KEYS:
            self._violation(f"body keys must be within {sorted(DASHBOARD_KEYS)}")
            return
        dashboard = body.get("dashboard")
        if not isinstance(dashboard, dict):
            self._violation("body.dashboard must be the dashboard model")
            return
        problems = []
        if not isinstance(dashboard.get("title"), str) or not dashboard["title"]:
            problems.append("dashboard.title missing")
        if not isinstance(dashboard.get("uid"), str) or not UID_RE.match(dashboard["uid"]):
            problems.append("dashboard.uid must be a Grafana uid (<= 40 characters)")
        if not isinstance(dashboard.get("panels"), list) or not isinstance(dashboard.get("schemaVersion"), int):
            problems.append("dashboard needs panels and schemaVersion")
        if dashboard.get("id") is not None:
            problems.append("dashboard.id must be null (ids are per Grafana install)")
        if body.get("folderUid") not in g.folders:
            problems.append(f"folderUid {body.get('folderUid')!r} is not an existing folder")
        if not isinstance(body.get("overwrite"), bool):
            problems.append("overwrite must be a boolean")
        if problems:
            self._violation("; ".join(problems))
            return
        uid = dashboard["uid"]
        if uid in g.plugin_owned:
            self._send(412, {"message": "The dashboard belongs to plugin Example", "status": "plugin-dashboard"})
            return
        stored = g.dashboards.get(uid)
        if stored is not None and not body["overwrite"] and dashboard.get("version") != stored["dashboard"]["version"]:
            self._send(412, {"message": "The dashboard has been changed by someone else", "status": "version-mismatch"})
            return
        version = stored["dashboard"]["version"] + 1 if stored else 1
        ident = stored["dashboard"]["id"] if stored else g.new_id()
        saved = dict(dashboard, id=ident, version=version)
        g.dashboards[uid] = {"dashboard": saved, "folderUid": body["folderUid"]}
        self._send(200, {"id": ident, "uid": uid, "url": f"/d/{uid}/x", "status": "success", "version": version,
                         "slug": "x"})

    do_GET = _handle
    do_POST = _handle
    do_PUT = _handle
    do_DELETE = _handle


@contextmanager
def fake_grafana(**options: Any) -> Iterator[FakeGrafana]:
    """Serve a FakeGrafana on 127.0.0.1 for the block's duration."""
    grafana = FakeGrafana(**options)
    handler = type("Handler", (_Handler,), {"grafana": grafana})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: the kernel picks a free one
    grafana.url = f"http://127.0.0.1:{server.server_address[1]}{grafana.prefix}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield grafana
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
