"""Start real servers as child processes on 127.0.0.1 with free ports, and stop them without leftovers.

PostgreSQL refuses to run as root, so when the tests run as root (CI does) the server runs as the
`postgres` system user the Debian package creates.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PG_BIN_CANDIDATES = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status < 500:
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s: {last}")


def _stop(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)


# -- PostgreSQL ----------------------------------------------------------------------------------
@dataclass
class PostgresServer:
    host: str
    port: int
    data_dir: Path
    database: str = "prunewatch"
    user: str = "prunewatch"
    password: str = "prunewatch"
    _as_user: str | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}:{self.password}@{self.host}:{self.port}/{self.database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = list(args)
        if self._as_user:
            command = ["runuser", "-u", self._as_user, "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True)

    def stop(self) -> None:
        self._run(str(_pg_bin() / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop", check=False)

    def start(self) -> None:
        self._run(str(_pg_bin() / "pg_ctl"), "-D", str(self.data_dir), "-w", "-t", "30",
                  "-o", f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                  "-l", str(self.data_dir / "server.log"), "start")


def _pg_bin() -> Path:
    for candidate in PG_BIN_CANDIDATES:
        if (candidate / "initdb").exists():
            return candidate
    raise FileNotFoundError("PostgreSQL server binaries not found (apt-get install postgresql)")


def postgres_available() -> bool:
    try:
        _pg_bin()
        return True
    except FileNotFoundError:
        return False


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """initdb a temp cluster, start it on a free port, create role + database, stop and delete after."""
    as_user = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="prunewatch-pg-"))
    data_dir = root / "data"
    data_dir.mkdir()
    if as_user:
        entry = pwd.getpwnam(as_user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(host="127.0.0.1", port=free_port(), data_dir=data_dir, _as_user=as_user)
    pwfile = root / "pw"
    pwfile.write_text(server.password + "\n")
    if as_user:
        os.chown(pwfile, entry.pw_uid, entry.pw_gid)
    server._run(str(_pg_bin() / "initdb"), "-D", str(data_dir), "-U", server.user, "--pwfile", str(pwfile),
                "-A", "scram-sha-256", "--no-sync", "-E", "UTF8", "--locale", "C")
    server.start()
    try:
        env_cmd = ["env", f"PGPASSWORD={server.password}", str(_pg_bin() / "createdb"), "-h", "127.0.0.1",
                   "-p", str(server.port), "-U", server.user, server.database]
        subprocess.run(env_cmd, check=True, capture_output=True, text=True)
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


# -- Prometheus and Alertmanager -----------------------------------------------------------------
@dataclass
class ProcessServer:
    url: str
    process: subprocess.Popen
    workdir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _launch(command: list[str], workdir: Path, ready_url: str, timeout_s: float) -> ProcessServer:
    log_path = workdir / "server.log"
    log = log_path.open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    base = ready_url.rsplit("/-/", 1)[0]
    try:
        wait_for_http(ready_url, timeout_s)
    except TimeoutError:
        _stop(process)
        raise RuntimeError(f"{command[0]} did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
    return ProcessServer(url=base, process=process, workdir=workdir, log_path=log_path)


@contextmanager
def prometheus_server(config_yaml: str, extra_files: dict[str, str] | None = None,
                      extra_args: list[str] | None = None) -> Iterator[ProcessServer]:
    """Run `prometheus` with the given config (and rule files written beside it)."""
    workdir = Path(tempfile.mkdtemp(prefix="prunewatch-prom-"))
    for name, content in (extra_files or {}).items():
        (workdir / name).write_text(content)
    (workdir / "prometheus.yml").write_text(config_yaml)
    port = free_port()
    command = [shutil.which("prometheus") or "prometheus", f"--config.file={workdir / 'prometheus.yml'}",
               f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
               "--web.enable-lifecycle", *(extra_args or [])]
    server = _launch(command, workdir, f"http://127.0.0.1:{port}/-/ready", 60)
    try:
        yield server
    finally:
        _stop(server.process)
        shutil.rmtree(workdir, ignore_errors=True)


def alertmanager_binary() -> str | None:
    for name in ALERTMANAGER_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


@contextmanager
def alertmanager_server(config_yaml: str, extra_files: dict[str, str] | None = None) -> Iterator[ProcessServer]:
    """Run Alertmanager (Debian names it prometheus-alertmanager) with clustering off."""
    binary = alertmanager_binary()
    if binary is None:
        raise FileNotFoundError("alertmanager not installed (apt-get install prometheus-alertmanager)")
    workdir = Path(tempfile.mkdtemp(prefix="prunewatch-am-"))
    for name, content in (extra_files or {}).items():
        (workdir / name).write_text(content)
    (workdir / "alertmanager.yml").write_text(config_yaml)
    port = free_port()
    command = [binary, f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    server = _launch(command, workdir, f"http://127.0.0.1:{port}/-/ready", 60)
    try:
        yield server
    finally:
        _stop(server.process)
        shutil.rmtree(workdir, ignore_errors=True)
