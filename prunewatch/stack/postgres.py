"""A PostgreSQL cluster of the local stack: initdb once under the state dir, then one server per `stack up`.

PostgreSQL refuses to run as root, so when `stack up` runs as root the cluster belongs to, and
the server runs as, the `postgres` system user the Debian package creates. The server listens on
127.0.0.1 only (no Unix socket, so the path length of the state dir does not matter), with
password authentication for the `prunewatch` role.
"""

from __future__ import annotations

import os
import pwd
import secrets
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prunewatch.stack.processes import ProcessRecord, ServiceError, launch

PG_ROOTS = (Path("/usr/lib/postgresql"),)
SYSTEM_USER = "postgres"
ROLE = "prunewatch"
DATABASE = "prunewatch"


def pg_bin() -> Path:
    """The newest installed PostgreSQL server's bin folder (Debian keeps one per major version)."""
    candidates = sorted((c for root in PG_ROOTS for c in root.glob("*/bin")), key=lambda p: _major(p), reverse=True)
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "postgres").exists():
            return candidate
    raise ServiceError("postgres: PostgreSQL server binaries not found under /usr/lib/postgresql "
                       "(apt-get install postgresql)")


def _major(bin_dir: Path) -> int:
    try:
        return int(bin_dir.parent.name)
    except ValueError:
        return -1


def _run_as(user: str | None, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    ids = pwd.getpwnam(user) if user else None
    return subprocess.run(argv, check=False, cwd=cwd, capture_output=True, text=True, timeout=120,
                          user=ids.pw_uid if ids else None, group=ids.pw_gid if ids else None,
                          extra_groups=[] if ids else None)


@dataclass(frozen=True)
class LocalPostgres:
    """One cluster under `root` (data/ and the role's password file)."""

    root: Path
    port: int

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    @property
    def system_user(self) -> str | None:
        """The OS user the server runs as: `postgres` when we are root, else ourselves."""
        return SYSTEM_USER if os.geteuid() == 0 else None

    @property
    def password(self) -> str:
        return self.password_file.read_text().strip()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{ROLE}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    def init(self) -> bool:
        """Create the cluster unless it exists; True when it was created now."""
        if (self.data_dir / "PG_VERSION").is_file():
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        if not self.password_file.exists():
            self.password_file.write_text(secrets.token_urlsafe(24) + "\n")  # URL-safe: it goes into URLs
        self.password_file.chmod(0o600)
        user = self.system_user
        if user:
            entry = pwd.getpwnam(user)
            for path in (self.root, self.data_dir, self.password_file):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            if _run_as(user, ["test", "-w", str(self.root)], cwd=Path("/")).returncode != 0:
                raise ServiceError(f"postgres: the {user} user (PostgreSQL does not run as root) cannot reach "
                                   f"{self.root}; choose a --state-dir whose parent folders it can traverse")
        done = _run_as(user, [str(pg_bin() / "initdb"), "-D", str(self.data_dir), "-U", ROLE,
                              "--pwfile", str(self.password_file), "-A", "scram-sha-256", "-E", "UTF8",
                              "--locale", "C", "--no-sync"], cwd=self.root)
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip().splitlines()
            raise ServiceError(f"postgres: initdb failed: {message[-1] if message else done.returncode}")
        return True

    def launch(self, log: Path) -> ProcessRecord:
        """Start the server; SIGINT is PostgreSQL's fast shutdown (SIGTERM would wait for clients)."""
        argv = [str(pg_bin() / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]
        return launch("postgres", argv, log, cwd=self.root, user=self.system_user, stop_signal=signal.SIGINT)

    def ready(self) -> bool:
        """True once the server accepts the role's password."""
        import psycopg

        try:
            with psycopg.connect(host="127.0.0.1", port=self.port, user=ROLE, password=self.password,
                                 dbname="postgres", connect_timeout=2):
                return True
        except psycopg.Error:
            return False

    def ensure_database(self) -> bool:
        """Create the `prunewatch` database unless it exists; True when it was created now."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=ROLE, password=self.password,
                             dbname="postgres", autocommit=True, connect_timeout=5) as connection:
            if connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
                return False
            connection.execute(f'CREATE DATABASE "{DATABASE}"')
            return True
