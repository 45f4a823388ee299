"""The kernel build never waits on a lock left by a build that died, never races a live one, and builds from copies
of its sources inside its folder, so installs at other paths share one build instead of rebuilding it in turn."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from prunewatch.engine.sparse import kernel
from prunewatch.engine.sparse.kernel import HEADERS, SOURCES, _exclusive_build, _staged_sources

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


def test_sources_are_staged_in_the_build_folder_and_rewritten_only_when_they_change(tmp_path: Path) -> None:
    staged = _staged_sources(tmp_path)
    assert staged == [tmp_path / "src" / source.name for source in SOURCES]
    for source in (*SOURCES, *HEADERS):  # the headers beside them: the sources include them by name
        assert (tmp_path / "src" / source.name).read_bytes() == source.read_bytes()
    first = staged[0]
    os.utime(first, (1_000_000, 1_000_000))
    _staged_sources(tmp_path)
    assert first.stat().st_mtime == 1_000_000  # same bytes: untouched, so ninja sees nothing to rebuild
    first.write_text("// edited")
    _staged_sources(tmp_path)
    assert first.read_bytes() == SOURCES[0].read_bytes() and first.stat().st_mtime > 1_000_000
    assert not list((tmp_path / "src").glob(".*.partial"))


def test_the_built_kernel_names_only_its_staged_copies() -> None:
    """The session's build (made by `make kernels` or on first use): its ninja file compiles the copies in its own
    folder, so a checkout at another path runs the same commands and loads the same build."""
    kernel.build()
    directory = kernel.cache_dir()
    ninja = (directory / "build.ninja").read_text()
    for source in SOURCES:
        assert f"{directory / 'src' / source.name}" in ninja
        assert str(source) not in ninja


def test_each_torch_installation_builds_in_a_folder_of_its_own(monkeypatch) -> None:
    """Another environment's build commands name its own include folders: sharing a folder, two environments would
    rebuild it for each other."""
    here = kernel.cache_dir()
    assert kernel.cache_dir() == here
    monkeypatch.setattr(kernel.torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    elsewhere = kernel.cache_dir()
    assert elsewhere != here and elsewhere.parent == here.parent
