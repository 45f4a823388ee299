"""A local PostgreSQL cluster: initdb once under a folder, then a server on 127.0.0.1 per start.

The stack keeps one cluster under its state dir; tests and benchmarks make a throwaway one
(`temporary_postgres`). PostgreSQL refuses to run as root, so when this process runs as root the
cluster belongs to, and the server runs as, the `postgres` system user the Debian package creates.
The server listens on 127.0.0.1 only (no Unix socket, so the length of the folder's path does not
matter), with password authentication for one role.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prunewatch.services._processes import ProcessRecord, ServiceError, free_port, is_running, launch, stop, wait_until

PG_ROOTS = (Path("/usr/lib/postgresql"),)  # Debian: one <major>/bin folder per installed server version
SYSTEM_USER = "postgres"
ROLE = "prunewatch"
DATABASE = "prunewatch"


def postgres_version(bin_dir: Path) -> tuple[int, ...]:
    """The server version a Debian bin folder belongs to (`.../16/bin` -> (16,), `.../9.6/bin` -> (9, 6)).

    A tuple of integers, so versions compare as numbers: as strings "9.6" would sort above "16".
    A folder not named like a version gets (), below every real version.
    """
    name = bin_dir.parent.name
    if not re.fullmatch(r"\d+(\.\d+)*", name):
        return ()
    return tuple(int(part) for part in name.split("."))


def postgres_bin_dirs(roots: Sequence[Path] = PG_ROOTS) -> list[Path]:
    """Installed server bin folders holding initdb and postgres, newest version first."""
    candidates = [c for root in roots for c in root.glob("*/bin")
                  if (c / "initdb").exists() and (c / "postgres").exists()]
    return sorted(candidates, key=postgres_version, reverse=True)


def postgres_bin(roots: Sequence[Path] = PG_ROOTS) -> Path:
    """The newest installed PostgreSQL server's bin folder; ServiceError saying what to install when none is."""
    found = postgres_bin_dirs(roots)
    if not found:
        raise ServiceError("postgres: PostgreSQL server binaries not found under "
                           f"{', '.join(str(r) for r in roots)} (apt-get install postgresql)")
    return found[0]


def postgres_available() -> bool:
    """Whether a PostgreSQL server is installed: integration tests skip or fail on this."""
    return bool(postgres_bin_dirs())


def _run_as(user: str | None, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    ids = pwd.getpwnam(user) if user else None
    return subprocess.run(argv, check=False, cwd=cwd, capture_output=True, text=True, timeout=120,
                          user=ids.pw_uid if ids else None, group=ids.pw_gid if ids else None,
                          extra_groups=[] if ids else None)


@dataclass(frozen=True)
class LocalPostgres:
    """One cluster under `root` (data/ and the role's password file), served on 127.0.0.1:`port`."""

    root: Path
    port: int
    role: str = ROLE  # the cluster's superuser, who owns `database`
    database: str = DATABASE
    # Extra server settings (`-c name=value`), e.g. {"fsync": "off"} where durability does not matter.
    options: Mapping[str, str] = field(default_factory=dict, hash=False)

    host = "127.0.0.1"

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
        """SQLAlchemy URL of `database` (with the password: keep it out of logs)."""
        return f"postgresql+psycopg://{self.role}:{self.password}@{self.host}:{self.port}/{self.database}"

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
                                   f"{self.root}; choose a folder whose parent folders it can traverse")
        done = _run_as(user, [str(postgres_bin() / "initdb"), "-D", str(self.data_dir), "-U", self.role,
                              "--pwfile", str(self.password_file), "-A", "scram-sha-256", "-E", "UTF8",
                              "--locale", "C", "--no-sync"], cwd=self.root)
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip().splitlines()
            raise ServiceError(f"postgres: initdb failed: {message[-1] if message else done.returncode}")
        return True

    def launch(self, log: Path) -> ProcessRecord:
        """Start the server; SIGINT is PostgreSQL's fast shutdown (SIGTERM would wait for clients)."""
        argv = [str(postgres_bin() / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                "-c", f"listen_addresses={self.host}", "-c", "unix_socket_directories="]
        for name, value in self.options.items():
            argv += ["-c", f"{name}={value}"]
        return launch("postgres", argv, log, cwd=self.root, user=self.system_user, stop_signal=signal.SIGINT)

    def ready(self) -> bool:
        """True once the server accepts the role's password."""
        import psycopg

        try:
            with psycopg.connect(host=self.host, port=self.port, user=self.role, password=self.password,
                                 dbname="postgres", connect_timeout=2):
                return True
        except psycopg.Error:
            return False

    def ensure_database(self) -> bool:
        """Create `database` unless it exists; True when it was created now."""
        import psycopg

        with psycopg.connect(host=self.host, port=self.port, user=self.role, password=self.password,
                             dbname="postgres", autocommit=True, connect_timeout=5) as connection:
            if connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone():
                return False
            connection.execute(f'CREATE DATABASE "{self.database}"')
            return True


class PostgresServer:
    """A LocalPostgres whose server this process starts and stops, and may restart (an outage in a test)."""

    def __init__(self, cluster: LocalPostgres, log: Path, start_timeout_s: float = 60.0) -> None:
        self.cluster = cluster
        self.log = log
        self.start_timeout_s = start_timeout_s
        self.record: ProcessRecord | None = None

    # The connection details clients need, named as psycopg names them.
    @property
    def host(self) -> str:
        return self.cluster.host

    @property
    def port(self) -> int:
        return self.cluster.port

    @property
    def user(self) -> str:
        return self.cluster.role

    @property
    def password(self) -> str:
        return self.cluster.password

    @property
    def database(self) -> str:
        return self.cluster.database

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def data_dir(self) -> Path:
        return self.cluster.data_dir

    def start(self) -> None:
        """Start the server (initdb first if needed) and wait until it accepts the role; create the database."""
        if self.record is not None and is_running(self.record):
            return
        self.cluster.init()
        self.record = self.cluster.launch(self.log)
        wait_until(self.record, self.cluster.ready, "accept connections", self.start_timeout_s)
        self.cluster.ensure_database()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fast shutdown (clients are disconnected), SIGKILL after `timeout_s`; the data stays."""
        if self.record is not None:
            stop([self.record], timeout_s)
            self.record = None


@contextmanager
def temporary_postgres(options: Mapping[str, str] | None = None,
                       prefix: str = "prunewatch-pg-") -> Iterator[PostgresServer]:
    """A throwaway cluster in a temp folder on a free port, started; stopped and deleted on exit."""
    root = Path(tempfile.mkdtemp(prefix=prefix))  # the cluster's own root: init hands it to the server's user
    server = PostgresServer(LocalPostgres(root, free_port(), options=dict(options or {})), log=root / "postgres.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
