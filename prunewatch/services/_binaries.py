"""Find the server programs the stack and the tests run, under the names Debian's packages give them."""

from __future__ import annotations

import shutil
from collections.abc import Sequence

from prunewatch.services._processes import ServiceError

PROMETHEUS_BINARIES = ("prometheus",)
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")  # Debian renames it
PUSHGATEWAY_BINARIES = ("prometheus-pushgateway", "pushgateway")  # Debian renames it


def which_binary(names: Sequence[str]) -> str | None:
    """The path of the first of `names` on PATH; None when none is installed (a test can skip on it)."""
    return next((found for name in names if (found := shutil.which(name))), None)


def find_binary(names: Sequence[str], package: str, service: str) -> str:
    """The path of the first of `names` on PATH; ServiceError naming the package to install otherwise."""
    found = which_binary(names)
    if found is None:
        raise ServiceError(f"{service}: {names[0]} is not installed (apt-get install {package})")
    return found
