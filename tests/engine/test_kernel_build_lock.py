"""The kernel build never waits on a lock left by a build that died, and never races a live one."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from prunewatch.engine.sparse.kernel import _exclusive_build

HOLD_FLOCK = """
import fcntl, sys, time
handle = open(sys.argv[1], "w")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_lock_file_left_by_a_dead_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()  # what torch's loader leaves when its build is killed
    with _exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_in_another_process_is_waited_for(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FLOCK, str(tmp_path / "build.flock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").touch()  # the live build's own marker
        entered = threading.Event()

        def enter() -> None:
            with _exclusive_build(tmp_path):
                entered.set()

        waiter = threading.Thread(target=enter, daemon=True)
        waiter.start()
        assert not entered.wait(0.5), "entered the folder while another process was building in it"
        assert (tmp_path / "lock").exists(), "removed the marker of a build that is still running"
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert entered.wait(30), "did not take the folder after the other build finished"
        waiter.join(5)
    finally:
        holder.kill()
        holder.wait()
