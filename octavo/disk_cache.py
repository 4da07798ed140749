"""Writing octavo's caches under `$OCTAVO_CACHE`: private folders, whole files or none.

Every cache (prepared weights, parsed configs and tensor types, converted tokenizers, the
kernels' stamp, a catalog model's verification stamp) only saves time on the next start, so a
full disk, a read-only or a foreign cache folder must never fail this one: the write is skipped
with one warning that names the path and the error. A file is written under a temporary name in
its own folder, flushed to disk and renamed into place, and the temporary file is removed on
any failure, so a reader never finds half a file and a failed write leaves nothing behind.
Folders octavo creates are 0700: prepared weights and tokenizers are the user's models.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# What a cache write can raise besides OSError: safetensors' Rust writer raises SafetensorError
# and tokenizers' plain Exception for the same I/O errors, so callers pass their own kinds.
WriteErrors = tuple[type[BaseException], ...]


def make_dirs(path: Path) -> None:
    """Create `path` and its missing parents with mode 0700 (os.makedirs gives its mode to the
    last folder only; the parents would be world-readable)."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another process made it meanwhile
            pass


def describe(exc: BaseException) -> str:
    """An error as the warning shows it: `ENOSPC: No space left on device`. The Rust writers'
    errors carry the code only in their text (`... (os error 28)`)."""
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and code in errno.errorcode:
        return f"{errno.errorcode[code]}: {exc.strerror}"
    found = re.search(r"os error (\d+)", str(exc))
    name = errno.errorcode.get(int(found.group(1)), "") if found else ""
    return f"{name + ': ' if name else ''}{type(exc).__name__}: {exc}"


def _temp_name(path: Path) -> Path:
    # Hidden, and per process: two starts writing the same entry never share a temporary file,
    # and globs for the entries themselves (prepared_cache's stale sweep) never match one.
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """The rename itself on disk too; some filesystems cannot sync a folder, which is fine."""
    try:
        _fsync(path)
    except OSError:
        pass


def _warn(what: str, path: Path, exc: BaseException) -> None:
    logger.warning("not caching %s: cannot write %s (%s); this start goes on without it",
                   what, path, describe(exc))


def _skipped(exc: BaseException, errors: WriteErrors, what: str, path: Path) -> bool:
    """Inside the `except` of a failed write, its temporary copy removed: re-raise anything
    but a write failure, else warn once; False."""
    if not isinstance(exc, (OSError, *errors)):
        raise  # noqa: PLE0704 - the exception being handled, with its traceback
    _warn(what, path, exc)
    return False


def write_file(path: Path, write: Callable[[Path], None], what: str,
               errors: WriteErrors = ()) -> bool:
    """`write(tmp)` writes the file at a temporary path beside `path`, which then replaces
    `path`; False (with one warning, nothing left behind) when any step fails with an OSError
    or one of `errors`."""
    tmp = _temp_name(path)
    try:
        make_dirs(path.parent)
        write(tmp)
        # Data before the rename: after a crash the entry is whole or absent, never a file of
        # the right name whose blocks never reached the disk (a prepared-weights file with a
        # valid header and zeroed tensors would load without an error).
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as exc:  # Ctrl-C mid-write too: the temporary file never stays
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only folder, where nothing was written either
            pass
        return _skipped(exc, errors, what, path)
    _fsync_dir(path.parent)
    return True


def write_text(path: Path, text: str, what: str) -> bool:
    return write_file(path, lambda tmp: tmp.write_text(text), what)


def write_dir(path: Path, write: Callable[[Path], None], what: str,
              errors: WriteErrors = ()) -> bool:
    """As write_file, for a folder of files: `write(tmp)` fills a temporary folder beside `path`,
    which then replaces `path` (an older, incomplete one is removed first)."""
    tmp = _temp_name(path)
    try:
        make_dirs(path.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        write(tmp)
        for file in tmp.iterdir():
            _fsync(file)
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.replace(tmp, path)
        except OSError as exc:  # another start put its copy there since: that one serves
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as exc:  # Ctrl-C mid-write too: the temporary folder never stays
        shutil.rmtree(tmp, ignore_errors=True)
        return _skipped(exc, errors, what, path)
    _fsync_dir(path.parent)
    return True
