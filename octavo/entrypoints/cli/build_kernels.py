"""`octavo build-kernels`: compile the C++ CPU kernels for this machine now (what `pip install`
does), so that the next start loads them at once."""
from __future__ import annotations

import argparse
import shutil


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-kernels", help="compile the C++ CPU kernels for this machine")
    p.add_argument("--force", action="store_true",
                   help="build again even if a build for this source, torch and CPU is cached")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from octavo.kernels import native

    library = native.cached_library()
    if library is not None and args.force:
        shutil.rmtree(library.parent, ignore_errors=True)
    elif library is not None:
        print(f"the kernels are already built for this machine: {library}")
        return 0
    if native.build() is None:
        print(f"octavo: the kernels could not be built: {native.last_failure() or 'see above'}")
        return 1
    print(f"built: {native.cached_library()}")
    return 0
