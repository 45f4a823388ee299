"""The stack's process handling on tiny stand-in processes: failures name service and log; stops leave nothing."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from prunewatch.services import ServiceError, group_members, is_running, launch, stop, wait_until


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_service_that_exits_is_reported_with_its_log_and_last_line(tmp_path):
    log = tmp_path / "logs" / "broken.log"
    code = "import sys; print('loading model'); print('error: no weights in /m'); sys.exit(3)"
    record = launch("broken", _python(code), log)
    started = time.monotonic()
    with pytest.raises(ServiceError) as caught:
        wait_until(record, lambda: False, "answer http://127.0.0.1:1/health", timeout_s=30)
    assert time.monotonic() - started < 10  # noticed the exit, did not wait out the timeout
    assert str(caught.value) == (f"broken exited before answer http://127.0.0.1:1/health; log: {log} "
                                 "(last line: error: no weights in /m)")
    assert log.read_text().splitlines()[0].startswith("--- ")  # each start is marked in the log


def test_a_service_that_never_answers_times_out_naming_it(tmp_path):
    record = launch("silent", _python("import time; time.sleep(60)"), tmp_path / "silent.log")
    try:
        with pytest.raises(ServiceError) as caught:
            wait_until(record, lambda: False, "answer its check", timeout_s=0.5, poll_s=0.05)
        log = tmp_path / "silent.log"
        assert str(caught.value).startswith(f"silent did not answer its check within 0.5s; log: {log}")
    finally:
        assert stop([record], timeout_s=5) == []
    assert not is_running(record)


def test_stop_kills_what_ignores_the_signal_and_the_children_it_forked(tmp_path):
    code = ("import os, signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "if os.fork() == 0:\n"
            "    time.sleep(120)\n"
            "print('up and ' + 'running', flush=True)\n"  # the log's start line echoes the code: no match there
            "time.sleep(120)\n")
    log = tmp_path / "stubborn.log"
    record = launch("stubborn", _python(code), log)
    wait_until(record, lambda: "up and running" in log.read_text(), "say it runs", timeout_s=30, poll_s=0.05)
    members = group_members(record.pid)
    assert len(members) == 2 and record.pid in members  # the service and its forked child share a group
    started = time.monotonic()
    assert stop([record], timeout_s=0.5) == ["stubborn"]
    assert time.monotonic() - started < 10
    assert group_members(record.pid) == [] and not is_running(record)


def test_a_reused_pid_is_never_signalled(tmp_path):
    record = launch("short", _python("pass"), tmp_path / "short.log")
    psutil.Process(record.pid).wait(30)
    impostor = type(record)(name="short", pid=os.getpid(), create_time=record.create_time, log=record.log,
                            stop_signal=int(signal.SIGKILL))
    assert not is_running(impostor)  # same pid, different start time: not ours
    assert stop([impostor], timeout_s=1) == []  # and this test process is still alive to say so


def test_the_group_of_a_reused_pid_is_left_alone(tmp_path):
    # A session leader that is not the recorded process: same pid number, another start time.
    other = launch("other", _python("import time; time.sleep(60)"), tmp_path / "other.log")
    try:
        stale = type(other)(name="stale", pid=other.pid, create_time=other.create_time - 3600, log=other.log)
        assert stop([stale], timeout_s=1) == []
        assert is_running(other) and group_members(other.pid) == [other.pid]
    finally:
        assert stop([other], timeout_s=5) == []
    assert not is_running(other)


def test_a_password_in_a_url_argument_stays_out_of_the_log(tmp_path):
    log = tmp_path / "roi.log"
    record = launch("roi", _python("pass") + ["--db", "postgresql+psycopg://prunewatch:s3cret-pw@127.0.0.1:5/db"], log)
    psutil.Process(record.pid).wait(30)
    first = log.read_text().splitlines()[0]
    assert first.endswith("--db postgresql+psycopg://prunewatch:***@127.0.0.1:5/db") and "s3cret" not in first
