"""The state dir's record of a running stack: stack.json (the truth) plus one pid file per service.

stack.json is rewritten after every start, so a `stack up` that dies half way still leaves
`stack down` everything it needs to stop what did start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prunewatch.services import ProcessRecord

STATE_FILE = "stack.json"
FORMAT = 1


class StateError(RuntimeError):
    """stack.json is missing or unreadable."""


class NoStackStateError(StateError):
    """No stack.json: nothing was started from this state dir, or it was stopped already."""


@dataclass
class Service:
    """One started service: its process and where it answers."""

    record: ProcessRecord
    port: int | None = None
    url: str | None = None  # what a user opens or points a client at (None: not an HTTP service)


@dataclass
class StackState:
    state_dir: Path
    ports: dict[str, int] = field(default_factory=dict)  # chosen at start, before anything listens
    services: list[Service] = field(default_factory=list)
    store_url: str | None = None  # password masked

    @property
    def path(self) -> Path:
        return self.state_dir / STATE_FILE

    def add(self, service: Service) -> None:
        self.services = [s for s in self.services if s.record.name != service.record.name] + [service]
        self.save()

    def service(self, name: str) -> Service:
        for service in self.services:
            if service.record.name == name:
                return service
        raise KeyError(name)

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        document = {
            "format": FORMAT,
            "ports": self.ports,
            "store_url": self.store_url,
            "services": [{**s.record.to_json(), "port": s.port, "url": s.url} for s in self.services],
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(document, indent=1) + "\n")
        tmp.replace(self.path)
        pids = self.state_dir / "pids"
        pids.mkdir(exist_ok=True)
        for service in self.services:
            (pids / f"{service.record.name}.pid").write_text(f"{service.record.pid}\n")

    @classmethod
    def load(cls, state_dir: Path) -> StackState:
        path = state_dir / STATE_FILE
        try:
            document = json.loads(path.read_text())
        except FileNotFoundError:
            raise NoStackStateError(f"no stack state in {state_dir} ({STATE_FILE} missing): nothing was started "
                                    "there, or it was stopped already")
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read {path}: {exc}") from None
        if document.get("format") != FORMAT:
            raise StateError(f"{path}: unknown format {document.get('format')!r}")
        services = []
        for entry in document.get("services", []):
            port, url = entry.pop("port", None), entry.pop("url", None)
            services.append(Service(ProcessRecord(**entry), port=port, url=url))
        return cls(state_dir=state_dir, ports=dict(document.get("ports", {})), services=services,
                   store_url=document.get("store_url"))

    def clear(self) -> None:
        """Forget the processes (after they were stopped); logs, configs and data stay."""
        self.path.unlink(missing_ok=True)
        for service in self.services:
            (self.state_dir / "pids" / f"{service.record.name}.pid").unlink(missing_ok=True)
        self.services = []

