"""Start detached service processes with a log each, wait for them boundedly, stop them without leftovers.

Each service gets its own session (so its own process group): `stack up` can exit while the
services run on, and `stack down` (or a test's clean-up) can stop a service together with any
child it forked. A pid is trusted only together with its start time, so a pid the OS has since
reused is never signalled.
"""

from __future__ import annotations

import os
import pwd
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

_STARTED: list[subprocess.Popen] = []
_PASSWORD_IN_URL = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")  # user:password@ in a URL argument
_KILL_SETTLE_S = 5.0  # how long `stop` waits for the group members it killed to be gone


class ServiceError(RuntimeError):
    """A service did not start or answer in time; the message names it and its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ProcessRecord:
    """What `stack down` needs to find a started process again, saved in the state file."""

    name: str
    pid: int
    create_time: float  # psutil's start time: tells this process from a later one with the same pid
    log: str
    stop_signal: int = int(signal.SIGTERM)

    def to_json(self) -> dict:
        """The record as stored in a state file (`ProcessRecord(**data)` reads it back)."""
        return asdict(self)


def _process(record: ProcessRecord) -> psutil.Process | None:
    """The live process of a record; None when it exited, became a zombie, or its pid was reused."""
    try:
        process = psutil.Process(record.pid)
        if abs(process.create_time() - record.create_time) > 1.0:
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            _reap(record.pid)
            return None
        return process
    except psutil.Error:
        return None


def _reap(pid: int) -> None:
    """Collect the exit status of our own child (a no-op for anyone else's process).

    A child this process started is reaped through its Popen, which is then forgotten: a
    long-lived process (a test session) starting many services keeps no finished ones around.
    """
    for process in _STARTED:
        if process.pid == pid:
            if process.poll() is not None:
                _STARTED.remove(process)
            return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _owns_group(record: ProcessRecord) -> bool:
    """Whether the process group numbered like the record's pid is still the service's.

    The kernel does not reuse a pid while a process group of that number has members, so the
    group is ours unless a different process (another start time) now holds the pid.
    """
    try:
        return abs(psutil.Process(record.pid).create_time() - record.create_time) <= 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def is_running(record: ProcessRecord) -> bool:
    """Whether the record's own process still runs (not a later one that got the same pid)."""
    return _process(record) is not None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.info["pid"]) == pgid:
                members.append(process.info["pid"])
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def launch(name: str, argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
           cwd: Path | None = None, user: str | None = None,
           stop_signal: signal.Signals = signal.SIGTERM) -> ProcessRecord:
    """Start `argv` in its own session with stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ids = pwd.getpwnam(user) if user else None
    with log_path.open("ab") as log:
        shown = " ".join(_PASSWORD_IN_URL.sub(r"\1***@", arg) for arg in argv)
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {shown}\n".encode())
        log.flush()
        try:
            process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(env) if env is not None else None, cwd=cwd,
                                       user=ids.pw_uid if ids else None, group=ids.pw_gid if ids else None,
                                       extra_groups=[] if ids else None, start_new_session=True)
        except OSError as exc:
            raise ServiceError(f"{name}: cannot start {argv[0]}: {exc}") from None
    # The service outlives this process when `stack up` exits (init then collects its exit status);
    # while this process lives, the Popen object is kept so it is not reported as leaked.
    _STARTED.append(process)
    try:
        created = psutil.Process(process.pid).create_time()
    except psutil.Error:
        created = time.time()
    return ProcessRecord(name=name, pid=process.pid, create_time=created, log=str(log_path),
                         stop_signal=int(stop_signal))


def last_log_line(record: ProcessRecord) -> str:
    """The last non-empty line of a service's log, to name the cause in a one-line error."""
    try:
        with open(record.log, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 8192))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _failure(record: ProcessRecord, what: str) -> ServiceError:
    """One line naming the service, what it failed to do, its log and the log's last line."""
    line = last_log_line(record)
    return ServiceError(f"{record.name} {what}; log: {record.log}" + (f" (last line: {line})" if line else ""))


def wait_until(record: ProcessRecord, check: Callable[[], bool], what: str, timeout_s: float,
               poll_s: float = 0.2) -> None:
    """Poll `check` until it holds; ServiceError when the process exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return
        if not is_running(record):
            raise _failure(record, f"exited before {what}")
        if time.monotonic() >= deadline:
            raise _failure(record, f"did not {what} within {timeout_s:g}s")
        time.sleep(poll_s)


def http_ok(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 2.0) -> bool:
    """True when `url` answers 2xx (redirects followed): servers answer 503 on /-/ready while starting."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_http(record: ProcessRecord, url: str, timeout_s: float) -> None:
    """Wait until the service of `record` answers `url` with 2xx; ServiceError naming its log otherwise."""
    wait_until(record, lambda: http_ok(url), f"answer {url}", timeout_s)


def wait_for_url(url: str, timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait until `url` answers 2xx, for a server this module did not start (a thread, a test's own child).

    Without a record there is no process to watch, so only the deadline ends a wait for a server
    that died; ServiceError then.
    """
    deadline = time.monotonic() + timeout_s
    while not http_ok(url):
        if time.monotonic() >= deadline:
            raise ServiceError(f"{url} did not answer within {timeout_s:g}s")
        time.sleep(poll_s)


def stop(records: Sequence[ProcessRecord], timeout_s: float) -> list[str]:
    """Signal every record, wait up to `timeout_s`, kill what is left (group included); names of those killed."""
    live = {r.name: (r, p) for r in records if (p := _process(r)) is not None}
    for record, process in live.values():
        try:
            process.send_signal(record.stop_signal)
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout_s
    killed = []
    for record, process in live.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            killed.append(record.name)
            try:
                process.kill()
                process.wait(5)
            except psutil.Error:
                pass
        except psutil.Error:
            pass
        _reap(record.pid)
    groups = []
    for record in records:  # children the service forked into its group (e.g. PostgreSQL's backends)
        if not _owns_group(record):
            continue
        groups.append(record.pid)
        for pid in group_members(record.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if record.name not in killed:
                killed.append(record.name)
    # SIGKILL is delivered asynchronously: on a busy host a killed process runs on for a moment. Return
    # only once they are gone, so a caller that restarts the service never meets the old one's children.
    settle = time.monotonic() + _KILL_SETTLE_S
    while any(group_members(pgid) for pgid in groups) and time.monotonic() < settle:
        time.sleep(0.02)
    return killed
