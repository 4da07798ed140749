"""A GGUF file checked whole before anything parses it, and opened with one kind of error.

gguf's GGUFReader trusts the sizes a file states. An array whose count is 2**60 makes it append
empty arrays once the file runs out, until memory does; a truncated file or a tensor past its end
fails deep inside with an IndexError or a reshape error that names neither the file nor the
cause (transformers' tokenizer conversion reads the file the same way). `check_gguf` walks the
header first with every string length, array count, tensor count and tensor range bounded by the
bytes the file has, allocating nothing a count could inflate, so a bad file fails in milliseconds
with `ValueError("<path>: not a valid GGUF file: ...")`. `open_gguf` reads the file with the same
walk, decoding as it goes, instead of GGUFReader. safetensors files need no such walk: the
library checks the header length, its JSON and every tensor's range before it maps anything
(model/loader/safetensors_weights.py only names the file in its error).
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types -> their size in bytes (8: string, 9: array)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
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
    """Walks a header, skipping values, or (`decode`) reading them as GGUFReader's contents()."""

    def __init__(self, buf: mmap.mmap, order: str, decode: bool = False) -> None:
        self.buf, self.size, self.pos = buf, len(buf), 0
        self.order, self.decode = order, decode
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

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_SIZES:
            start = self.pos
            self.skip(_SCALAR_SIZES[vtype], f"the value of {key!r}")
            if self.decode:
                return struct.unpack_from(self.order + _SCALAR_FORMATS[vtype], self.buf, start)[0]
        elif vtype == _STRING:
            start = self.pos
            self.skip(self.uint(8, f"the length of {key!r}"), f"the string {key!r}")
            if self.decode:
                return self._text(self.buf[start + 8:self.pos], key)
        elif vtype == _ARRAY and depth < _MAX_NESTING:
            itype = self.uint(4, f"the item type of {key!r}")
            count = self.uint(8, f"the length of {key!r}")
            least = _SCALAR_SIZES.get(itype) or (8 if itype == _STRING else 12)
            if count * least > self.left():
                raise _Bad(f"the array {key!r} claims {count} items, which cannot fit in the "
                           f"{self.left()} bytes left")
            if itype in _SCALAR_SIZES:
                start = self.pos
                self.pos += count * least
                if self.decode:
                    dtype = np.dtype(_SCALAR_FORMATS[itype]).newbyteorder(self.order)
                    return np.frombuffer(self.buf, dtype, count, start).tolist()
            elif itype == _STRING:
                start = self.pos
                self._strings(count, key)
                if self.decode:
                    return self._string_list(start, count, key)
            else:
                items = [self.value(itype, key, depth + 1) for _ in range(count)]
                if self.decode:
                    return items
        else:
            raise _Bad(f"metadata {key!r} has an unknown value type {vtype}")
        return None

    @staticmethod
    def _text(raw: bytes, key: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Bad(f"a string of {key!r} is not UTF-8 ({exc.reason} at byte "
                       f"{exc.start})") from None

    def _string_list(self, pos: int, count: int, key: str) -> list[str]:
        """The strings of an array `_strings` has bounded already."""
        buf, u64, out = self.buf, self.u64, []
        for _ in range(count):
            n = u64(buf, pos)[0]
            out.append(buf[pos + 8:pos + 8 + n])
            pos += 8 + n
        try:
            return [b.decode("utf-8") for b in out]
        except UnicodeDecodeError:
            return [self._text(b, key) for b in out]  # names the key

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


def _walk(buf: mmap.mmap, decode: bool = False
          ) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int]:
    """(metadata, if `decode`; tensor infos (name, dims, type, offset); the data's start)."""
    if buf[:4] != b"GGUF":
        raise _Bad(f"it does not start with the GGUF magic (found {bytes(buf[:4])!r})")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine (as GGUFReader detects it)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise _Bad(f"version {version} (octavo reads versions 2 and 3)")
    w = _Walker(buf, order, decode)
    w.pos = 8
    n_tensors, n_kv = w.uint(8, "the tensor count"), w.uint(8, "the metadata count")
    if n_kv * _MIN_KV > w.left():
        raise _Bad(f"it claims {n_kv} metadata entries, which cannot fit in {w.size} bytes")
    alignment = 32
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = w.string("a metadata key").decode("utf-8", "replace")
        vtype = w.uint(4, f"the type of {key!r}")
        if key == "general.alignment" and vtype == _UINT32:
            value = alignment = w.uint(4, key)
        else:
            value = w.value(vtype, key)
        if decode and key in metadata:
            raise _Bad(f"the metadata key {key!r} appears twice")
        metadata[key] = value
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
    data_start = -(-w.pos // alignment) * alignment
    _check_tensors(infos, data_start, w.size)
    return metadata, infos, data_start


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


# numpy's type for a GGML type whose data is plain numbers; every other type is bytes.
_PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of a GGUF file, as gguf's ReaderTensor has it: `shape` in GGUF order (the row
    length first), `data` a read-only view of the file in numpy order, the rows as bytes for a
    quantized type."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # every key, valued as GGUFReader's ReaderField.contents()
    tensors: list[GGUFTensor]


def _tensors(buf: mmap.mmap, infos: list[tuple[str, list[int], int, int]],
             data_start: int) -> list[GGUFTensor]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors, names = [], set()
    for name, dims, gtype, offset in infos:
        if name in names:
            raise _Bad(f"the tensor {name!r} appears twice")
        names.add(name)
        kind = GGMLQuantizationType(gtype)
        block, type_size = GGML_QUANT_SIZES[kind]
        np_dims = tuple(reversed(dims))
        count = math.prod(dims)
        item = _PLAIN_TYPES.get(gtype)
        if item is None:
            count, item = count * type_size // block, np.uint8
            np_dims = (*np_dims[:-1], np_dims[-1] // block * type_size) if np_dims else ()
        # A plain ndarray over the mmap: np.memmap's slices pay a subclass hook each, which
        # dequantizing row group by row group calls a million times (2 s of a first load).
        data = np.frombuffer(buf, item, count, data_start + offset).reshape(np_dims)
        tensors.append(GGUFTensor(name, kind, tuple(dims), data))
    return tensors


_opened: dict[tuple[str, int, int], GGUFFile] = {}


def open_gguf(path: Path | str) -> GGUFFile:
    """The file's metadata and tensors, read by the same bounded walk as check_gguf (gguf's
    GGUFReader spends seconds on a vocabulary: a Python object per string part). Its errors
    are `ValueError("<path>: not a valid GGUF file: ...")`. Kept per process: the weights
    share the front end's and the tensor types' read."""
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in _opened:
            return _opened[key]
        if st.st_size < 24:
            raise invalid(path, f"{st.st_size} bytes, shorter than a GGUF header")
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        metadata, infos, data_start = _walk(buf, decode=True)
        opened = GGUFFile(path, metadata, _tensors(buf, infos, data_start))
    except _Bad as exc:
        raise invalid(path, str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the GGUF file ({exc})") from None
    _checked.add(key)
    _opened[key] = opened
    return opened
