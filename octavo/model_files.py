"""A GGUF file checked whole before anything parses it, and opened with one kind of error.

gguf's GGUFReader trusts the sizes a file states. An array whose count is 2**60 makes it append
empty arrays once the file runs out, until memory does; a truncated file or a tensor past its end
fails deep inside with an IndexError or a reshape error that names neither the file nor the
cause (transformers' tokenizer conversion reads the file the same way). `check_gguf` walks the
header first with every string length, array count, tensor count and tensor range bounded by the
bytes the file has, allocating nothing a count could inflate, so a bad file fails in milliseconds
with `ValueError("<path>: not a valid GGUF file: ...")`. safetensors files need no such walk: the
library checks the header length, its JSON and every tensor's range before it maps anything
(model/loader/safetensors_weights.py only names the file in its error).
"""
from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any

# GGUF metadata value types -> their size in bytes (8: string, 9: array)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: real files nest one level at most
# The fewest bytes a metadata entry (key length, type, a one-byte value) and a tensor entry
# (name length, dimension count, type, offset) can take: a count beyond size / these is a lie.
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 4 + 8

_checked: set[tuple[str, int, int]] = set()  # files walked by this process (path, size, mtime)


class _Bad(Exception):
    pass


class _Walker:
    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.size, self.pos = buf, len(buf), 0
        self.u32 = struct.Struct(order + "I").unpack_from
        self.u64 = struct.Struct(order + "Q").unpack_from

    def left(self) -> int:
        return self.size - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise _Bad(f"{what} needs {n} bytes at offset {self.pos}, but only {self.left()} "
                       f"are left (truncated or corrupt)")
        self.pos += n

    def uint(self, width: int, what: str) -> int:
        start = self.pos
        self.skip(width, what)
        return (self.u32 if width == 4 else self.u64)(self.buf, start)[0]

    def string(self, what: str) -> bytes:
        n = self.uint(8, what)
        start = self.pos
        self.skip(n, f"{what} ({n} bytes long)")
        return self.buf[start:self.pos]

    def value(self, vtype: int, key: str, depth: int = 0) -> None:
        if vtype in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[vtype], f"the value of {key!r}")
        elif vtype == _STRING:
            self.skip(self.uint(8, f"the length of {key!r}"), f"the string {key!r}")
        elif vtype == _ARRAY and depth < _MAX_NESTING:
            itype = self.uint(4, f"the item type of {key!r}")
            count = self.uint(8, f"the length of {key!r}")
            least = _SCALAR_SIZES.get(itype) or (8 if itype == _STRING else 12)
            if count * least > self.left():
                raise _Bad(f"the array {key!r} claims {count} items, which cannot fit in the "
                           f"{self.left()} bytes left")
            if itype in _SCALAR_SIZES:
                self.pos += count * least
            elif itype == _STRING:
                self._strings(count, key)
            else:
                for _ in range(count):
                    self.value(itype, key, depth + 1)
        else:
            raise _Bad(f"metadata {key!r} has an unknown value type {vtype}")

    def _strings(self, count: int, key: str) -> None:
        """A vocabulary: ~100k strings, so the loop is kept tight (a few ms for SmolLM2's)."""
        buf, u64, pos, size = self.buf, self.u64, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                break
            pos += 8 + u64(buf, pos)[0]
            if pos > size:
                break
        else:
            self.pos = pos
            return
        raise _Bad(f"a string of the array {key!r} runs past the end of the file")


def _walk(buf: mmap.mmap) -> None:
    if buf[:4] != b"GGUF":
        raise _Bad(f"it does not start with the GGUF magic (found {bytes(buf[:4])!r})")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine (as GGUFReader detects it)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise _Bad(f"version {version} (octavo reads versions 2 and 3)")
    w = _Walker(buf, order)
    w.pos = 8
    n_tensors, n_kv = w.uint(8, "the tensor count"), w.uint(8, "the metadata count")
    if n_kv * _MIN_KV > w.left():
        raise _Bad(f"it claims {n_kv} metadata entries, which cannot fit in {w.size} bytes")
    alignment = 32
    for _ in range(n_kv):
        key = w.string("a metadata key").decode("utf-8", "replace")
        vtype = w.uint(4, f"the type of {key!r}")
        if key == "general.alignment" and vtype == _UINT32:
            alignment = w.uint(4, key)
        else:
            w.value(vtype, key)
    if alignment == 0 or alignment & (alignment - 1):
        raise _Bad(f"general.alignment {alignment} is not a power of two")
    if n_tensors * _MIN_TENSOR > w.left():
        raise _Bad(f"it claims {n_tensors} tensors, which cannot fit in {w.size} bytes")
    infos = []
    for _ in range(n_tensors):
        name = w.string("a tensor name").decode("utf-8", "replace")
        n_dims = w.uint(4, f"the dimension count of {name!r}")
        if n_dims > _MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions (GGML has at most {_MAX_DIMS})")
        dims = [w.uint(8, f"the shape of {name!r}") for _ in range(n_dims)]
        infos.append((name, dims, w.uint(4, f"the type of {name!r}"),
                      w.uint(8, f"the offset of {name!r}")))
    _check_tensors(infos, -(-w.pos // alignment) * alignment, w.size)


def _check_tensors(infos: list[tuple[str, list[int], int, int]], data_start: int,
                   size: int) -> None:
    """Every tensor's bytes lie inside the file (their offsets count from `data_start`)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, dims, gtype, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        except (ValueError, KeyError):
            raise _Bad(f"tensor {name!r} has an unknown GGML type {gtype}") from None
        if dims and dims[0] % block:
            raise _Bad(f"tensor {name!r}: its rows of {dims[0]} are no whole number of "
                       f"{block}-value blocks")
        start = data_start + offset
        end = start + math.prod(dims) * type_size // block
        if end > size:
            raise _Bad(f"tensor {name!r} {tuple(dims)} needs bytes {start}..{end}, past the end "
                       f"of the file ({size} bytes; truncated?)")


def invalid(path: Path, reason: str) -> ValueError:
    return ValueError(f"{path}: not a valid GGUF file: {reason}")


def check_gguf(path: Path | str) -> None:
    """Raise `ValueError("<path>: not a valid GGUF file: ...")` unless the whole header reads
    within the file and every tensor's data lies inside it. Each file is walked once per process
    (the front end's config read, the tokenizer conversion and the weights share the walk)."""
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in _checked:
            return
        if st.st_size < 24:
            raise invalid(path, f"{st.st_size} bytes, shorter than a GGUF header")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk(buf)
    except _Bad as exc:
        raise invalid(path, str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the GGUF file ({exc})") from None
    _checked.add(key)


# What GGUFReader raises on a file that passes the walk yet is still malformed (a duplicate key,
# a bad UTF-8 name, an unknown type inside an array that was never read, ...).
_READER_ERRORS = (ValueError, KeyError, IndexError, TypeError, struct.error, OverflowError,
                  MemoryError, UnicodeDecodeError)


def open_gguf(path: Path | str) -> Any:
    """gguf's GGUFReader on `path`, after check_gguf; its errors become the same ValueError."""
    check_gguf(path)
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except _READER_ERRORS as exc:
        raise invalid(Path(path), f"{type(exc).__name__}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the GGUF file ({exc})") from None
