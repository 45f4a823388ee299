"""Compile the sparse linear kernel once, at install time: `python -m prunewatch.engine.sparse.build`.

Exit status 0 with the cache folder on stdout when the kernel is built and imports; 1 with a
one-line `error: ...` on stderr when it cannot be built here.
"""

from __future__ import annotations

import argparse
import sys

from prunewatch.engine.sparse.kernel import SparseKernelUnavailableError, build, cache_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prunewatch.engine.sparse.build", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = parser.parse_args(argv)
    try:
        build(verbose=args.verbose)
    except SparseKernelUnavailableError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stdout.write(f"sparse kernel ready in {cache_dir()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
