"""Gather the probe model's training text from documentation already on a Debian machine.

The probe model must be buildable offline, so its corpus is text every Debian host carries (or can
install from the distribution): the Python reference's reST sources, English man pages, licence
texts and package copyright files. Sources are read in sorted order and capped, so the same
machine yields the same corpus; the manifest records each source's file count, byte count and a
sha256 of the whole corpus so a rebuild elsewhere can tell whether it saw the same text.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

_TROFF_ESCAPES = re.compile(r"\\f[BIRP]|\\f\(..|\\\(..|\\\*\(..|\\\*.|\\[&|^%:]|\\s[+-]?\d")
_TROFF_COMMENT = re.compile(r'^\.\\"|^\'\\"')


@dataclass(frozen=True)
class CorpusSource:
    """One family of files on the host, read with one text extractor."""

    name: str  # shown in the manifest
    root: Path  # directory searched recursively
    pattern: str  # glob relative to root
    reader: Callable[[Path], str]  # file -> plain text
    max_bytes: int  # cap so one source cannot crowd out the others


@dataclass
class CorpusReport:
    """What was read, for the manifest."""

    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    total_bytes: int = 0
    sha256: str = ""


def _read_plain(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="ignore")


def _read_gzip(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8", errors="ignore") as fh:
        return fh.read()


def troff_to_text(source: str) -> str:
    """Strip man-page markup to running text: drop comments and requests, keep macro arguments."""
    lines: list[str] = []
    for raw in source.splitlines():
        if _TROFF_COMMENT.match(raw):
            continue
        line = raw
        if line.startswith((".", "'")):
            parts = line.split(None, 1)
            if len(parts) < 2 or parts[0] in {".TH", ".so", ".ds", ".de", ".nr", ".ie", ".el", ".if"}:
                continue
            line = parts[1].replace('"', "")
        line = _TROFF_ESCAPES.sub("", line).replace("\\-", "-").replace("\\e", "\\")
        line = line.strip()
        if line:
            lines.append(line)
    return "\n".join(lines)


def _read_man(path: Path) -> str:
    return troff_to_text(_read_gzip(path))


def default_sources() -> list[CorpusSource]:
    """The sources the committed probe model was trained on (python3.11-doc must be installed)."""
    mib = 1024 * 1024
    return [
        CorpusSource("python3.11-doc reST", Path("/usr/share/doc/python3.11/html/_sources"), "**/*.txt", _read_plain, 12 * mib),
        CorpusSource("man pages (sections 1, 5, 8)", Path("/usr/share/man"), "man[158]/*.gz", _read_man, 10 * mib),
        CorpusSource("common licences", Path("/usr/share/common-licenses"), "*", _read_plain, 1 * mib),
        CorpusSource("package copyright files", Path("/usr/share/doc"), "*/copyright", _read_plain, 4 * mib),
    ]


def iter_documents(sources: list[CorpusSource], report: CorpusReport) -> Iterator[str]:
    """Yield documents in a fixed order, filling `report` as it goes."""
    digest = hashlib.sha256()
    for source in sources:
        files = sorted(p for p in source.root.glob(source.pattern) if p.is_file()) if source.root.is_dir() else []
        used_bytes = 0
        used_files = 0
        for path in files:
            if used_bytes >= source.max_bytes:
                break
            try:
                text = source.reader(path)
            except OSError:
                continue
            text = text.strip()
            if len(text) < 200:
                continue
            encoded = text.encode("utf-8")
            used_bytes += len(encoded)
            used_files += 1
            digest.update(encoded)
            yield text
        report.sources[source.name] = {"files": used_files, "bytes": used_bytes}
        report.total_bytes += used_bytes
    report.sha256 = digest.hexdigest()
