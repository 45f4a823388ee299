"""Which PostgreSQL server `services` picks when several are installed: the newest by number, not by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from prunewatch.services import ServiceError, postgres_bin, postgres_bin_dirs, postgres_version


def _install(root: Path, version: str, *programs: str) -> Path:
    """A Debian-style /usr/lib/postgresql/<version>/bin with empty stand-ins for `programs`."""
    bin_dir = root / version / "bin"
    bin_dir.mkdir(parents=True)
    for program in programs:
        (bin_dir / program).touch()
    return bin_dir


@pytest.mark.parametrize(("folder", "version"), [("16", (16,)), ("9.6", (9, 6)), ("10", (10,)), ("beta", ())])
def test_version_is_read_from_the_folder_name_as_numbers(folder, version):
    assert postgres_version(Path("/usr/lib/postgresql") / folder / "bin") == version


def test_newest_version_first_compared_as_numbers_not_strings(tmp_path):
    for version in ("9", "16", "9.6", "10", "17"):
        _install(tmp_path, version, "initdb", "postgres")
    # As strings, "9.6" > "9" > "17" > "16" > "10".
    assert [d.parent.name for d in postgres_bin_dirs([tmp_path])] == ["17", "16", "10", "9.6", "9"]
    assert postgres_bin([tmp_path]) == tmp_path / "17" / "bin"


def test_a_version_without_the_server_programs_is_passed_over(tmp_path):
    _install(tmp_path, "16", "initdb", "postgres")
    _install(tmp_path, "17", "psql")  # client only: postgresql-client-17 without the server
    assert postgres_bin([tmp_path]) == tmp_path / "16" / "bin"


def test_no_server_installed_names_the_package(tmp_path):
    with pytest.raises(ServiceError, match="apt-get install postgresql"):
        postgres_bin([tmp_path])
