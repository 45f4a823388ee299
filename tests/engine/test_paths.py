"""Cache files written by several processes at once (a server and a collector, two test workers) stay whole."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from prunewatch.engine.paths import write_text_atomically


def test_concurrent_writers_of_one_file_leave_one_whole_version_and_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "thresholds.json"
    versions = {f"writer-{n}": list(range(n, n + 20_000)) for n in range(8)}
    errors: list[BaseException] = []
    start = threading.Barrier(len(versions))

    def write(name: str) -> None:
        start.wait()
        try:
            for _ in range(20):
                write_text_atomically(path, json.dumps({name: versions[name]}))
        except BaseException as exc:  # reported below: a writer must never fail because another one is writing
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(name,)) for name in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    written = json.loads(path.read_text())
    [(name, values)] = written.items()
    assert values == versions[name]
    assert sorted(p.name for p in path.parent.iterdir()) == ["thresholds.json"]


def test_a_failed_write_keeps_the_previous_file_and_removes_its_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_text_atomically(path, "first\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomically(path, "\udcff")  # a lone surrogate cannot be encoded: the write fails midway
    assert path.read_text() == "first\n"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
