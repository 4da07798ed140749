"""Checkpoint tensors read only where they are used.

The weight loaders yield each matrix as a `LazyTensor`: its shape and dtype, no data. The layers
cut a tensor-parallel rank's share with `.narrow`, basic slicing, `.t()`, reshapes of the
leading dimensions or `index_select` along them (a per-head row reordering), which give another
lazy tensor over fewer rows or columns; anything else (`copy_`, `torch.cat`, `.float()`, a
quant method's arithmetic) reads just the selected region from the file and runs on the plain
tensor it gives. So a rank only ever reads its own rows and columns, and a tensor nobody uses
(another pipeline stage's) is never read.

A lazy tensor is a view of a matrix [rows, columns] that a `RegionReader` reads by rectangles:
a checkpoint tensor's leading dimensions flattened into rows, its last one the columns. The view
keeps the file rows it selects as an index array shaped like its leading dimensions (so narrowing,
indexing and reordering them is numpy indexing of that array), a range of columns, and whether
it is transposed (GPT-2's Conv1D weights).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch


class RegionReader(Protocol):
    """A checkpoint matrix [rows, cols] read by rectangles."""

    name: str
    dtype: torch.dtype
    rows: int
    cols: int

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) as a tensor of its own (not the file's memory)."""


_largest_reads: dict[str, int] | None = None


@contextmanager
def recording_reads() -> Iterator[dict[str, int]]:
    """Within: the most elements read from each checkpoint tensor at once (reader name ->
    elements, a reader's whole rows counted where it had to read them to cut columns)."""
    global _largest_reads
    previous, _largest_reads = _largest_reads, {}
    try:
        yield _largest_reads
    finally:
        _largest_reads = previous


def note_read(name: str, elements: int) -> None:
    """Readers call this with each region they take from the file."""
    if _largest_reads is not None:
        _largest_reads[name] = max(_largest_reads.get(name, 0), elements)


def lazy(reader: RegionReader, shape: tuple[int, ...]) -> LazyTensor:
    """The whole of `reader`'s matrix as a tensor of `shape` (its rows are shape[:-1])."""
    if len(shape) < 2 or math.prod(shape[:-1]) != reader.rows or shape[-1] != reader.cols:
        raise ValueError(f"{reader.name}: shape {shape} is not [{reader.rows} rows, "
                         f"{reader.cols} columns]")
    return LazyTensor(reader, np.arange(reader.rows).reshape(shape[:-1]), (0, reader.cols), False)


class LazyTensor(torch.Tensor):
    """A tensor whose data is read from its checkpoint when something needs it (module doc)."""

    @staticmethod
    def __new__(cls, reader: RegionReader, rows: np.ndarray, cols: tuple[int, int],
                transposed: bool) -> LazyTensor:
        shape = (*rows.shape, cols[1] - cols[0])
        if transposed:
            shape = shape[::-1]
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=reader.dtype, device="cpu",
                                                requires_grad=False)
        t._reader, t._rows, t._cols, t._transposed = reader, rows, cols, transposed
        t._value = None
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"LazyTensor({self._reader.name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # __torch_function__ reads every lazy argument first; reaching here means a path around it
        raise RuntimeError(f"{func} reached a LazyTensor unread (torch function disabled?)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        view = _VIEWS.get(func)
        if view is not None and not kwargs and args and isinstance(args[0], LazyTensor):
            out = view(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*_read_all(args), **_read_all(kwargs))

    # -- the view: logical dimensions -> the row index array's axes or the column range --

    def _row_axis(self, dim: int) -> int | None:
        """The row-array axis of logical dimension `dim` (None: the columns)."""
        if self._transposed:
            return 0 if dim == 1 else None
        return dim if dim < self._rows.ndim else None

    def _with(self, rows: np.ndarray | None = None, cols: tuple[int, int] | None = None,
              transposed: bool | None = None) -> LazyTensor:
        rows = self._rows if rows is None else rows
        transposed = self._transposed if transposed is None else transposed
        return LazyTensor(self._reader, rows, self._cols if cols is None else cols,
                          transposed and rows.ndim == 1)

    def _narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        if not all(isinstance(v, int) for v in (dim, start, length)):
            return NotImplemented
        ndim = self._rows.ndim + 1
        dim = dim + ndim if dim < 0 else dim
        if not 0 <= dim < ndim:
            return NotImplemented  # let torch say which dimension is out of range
        size = self._shape()[dim]
        start = start + size if start < 0 else start
        if start < 0 or length < 0 or start + length > size:
            raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension "
                             f"{dim} of size {size}")
        axis = self._row_axis(dim)
        if axis is None:
            c0 = self._cols[0] + start
            return self._with(cols=(c0, c0 + length))
        index = [slice(None)] * self._rows.ndim
        index[axis] = slice(start, start + length)
        return self._with(rows=self._rows[tuple(index)])

    def _getitem(self, index) -> LazyTensor:
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            fill = (slice(None),) * (self._rows.ndim + 1 - len(index) + 1)
            index = index[:at] + fill + index[at + 1:]
        ndim = self._rows.ndim + 1
        if len(index) > ndim or not all(
                isinstance(i, slice) or (isinstance(i, (int, np.integer))
                                         and not isinstance(i, bool)) for i in index):
            return NotImplemented  # advanced indexing: read, then index
        index = index + (slice(None),) * (ndim - len(index))
        col_dim = 0 if self._transposed else ndim - 1
        col = index[col_dim]
        if not isinstance(col, slice) or col.step not in (None, 1):
            return NotImplemented
        picked = range(*self._cols)[col]
        row_index = index[1:] if self._transposed else index[:-1]
        return self._with(rows=self._rows[row_index], cols=(picked.start, picked.stop))

    def _transpose(self, dim0: int, dim1: int) -> LazyTensor:
        ndim = self._rows.ndim + 1
        dim0, dim1 = (d + ndim if d < 0 else d for d in (dim0, dim1))
        if dim0 == dim1:
            return self
        if ndim == 2:
            return self._with(transposed=not self._transposed)
        if max(dim0, dim1) < self._rows.ndim:  # two row axes (reordering heads)
            return self._with(rows=np.swapaxes(self._rows, dim0, dim1))
        return NotImplemented

    def _t(self) -> LazyTensor:
        ndim = self._rows.ndim + 1
        if ndim > 2:
            return NotImplemented  # let torch say t() wants at most 2 dimensions
        return self if ndim < 2 else self._transpose(0, 1)

    def _reshape(self, *shape) -> LazyTensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        if self._transposed or not shape or not all(isinstance(s, int) for s in shape):
            return NotImplemented
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            numel = self._rows.size * (self._cols[1] - self._cols[0])
            if known == 0 or numel % known:
                return NotImplemented
            shape = tuple(numel // known if s == -1 else s for s in shape)
        if shape[-1] != self._cols[1] - self._cols[0] or math.prod(shape[:-1]) != self._rows.size:
            return NotImplemented  # it would move columns between rows: read first
        return self._with(rows=self._rows.reshape(shape[:-1]))

    def _index_select(self, dim: int, index: torch.Tensor) -> LazyTensor:
        """Rows picked (and reordered) along a row dimension: a per-head row permutation."""
        ndim = self._rows.ndim + 1
        dim = dim + ndim if isinstance(dim, int) and dim < 0 else dim
        axis = self._row_axis(dim) if isinstance(dim, int) and 0 <= dim < ndim else None
        if axis is None or not isinstance(index, torch.Tensor) or index.dim() != 1:
            return NotImplemented
        picked = index.numpy()
        if picked.size and (picked.min() < 0 or picked.max() >= self._rows.shape[axis]):
            return NotImplemented  # let torch say which index is out of range
        return self._with(rows=np.take(self._rows, picked, axis=axis))

    def _shape(self) -> tuple[int, ...]:
        shape = (*self._rows.shape, self._cols[1] - self._cols[0])
        return shape[::-1] if self._transposed else shape

    def materialize(self) -> torch.Tensor:
        """The selected region, read (once: kept for the next use)."""
        if self._value is not None:
            return self._value
        c0, c1 = self._cols
        flat = self._rows.reshape(-1)
        reader = self._reader
        if flat.size == 0 or c0 == c1:
            out = torch.empty(flat.size, c1 - c0, dtype=reader.dtype)
        elif flat[-1] - flat[0] == flat.size - 1 and np.array_equal(
                flat, np.arange(flat[0], flat[-1] + 1)):
            out = reader.read(int(flat[0]), int(flat[-1]) + 1, c0, c1)
        else:  # reordered rows (q/k unpermuted, GPT-NeoX's qkv): read contiguous runs
            wanted = np.unique(flat)
            runs = np.split(wanted, np.flatnonzero(np.diff(wanted) != 1) + 1)
            blocks = [reader.read(int(r[0]), int(r[-1]) + 1, c0, c1) for r in runs]
            block = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
            out = block[torch.from_numpy(np.searchsorted(wanted, flat))]
        out = out.reshape(*self._rows.shape, c1 - c0)
        self._value = out.t() if self._transposed else out
        return self._value


def _read_all(x):
    """`x` (arguments: tensors, lists, tuples, dicts) with every lazy tensor in it read."""
    if isinstance(x, LazyTensor):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_read_all(a) for a in x)
    if isinstance(x, dict):
        return {k: _read_all(v) for k, v in x.items()}
    return x


def _hash(t: LazyTensor) -> int:
    return id(t)


_T = torch.Tensor
# Answered from the shape and dtype alone.
_METADATA = {_T.shape.__get__, _T.size, _T.dim, _T.ndim.__get__, _T.ndimension, _T.dtype.__get__,
             _T.numel, _T.nelement, _T.element_size, _T.device.__get__, _T.layout.__get__,
             _T.requires_grad.__get__, _T.is_floating_point, _T.is_complex, _T.__len__,
             _T.is_cuda.__get__, _T.is_meta.__get__}
# Views that stay lazy (NotImplemented from one: read, then run it).
_VIEWS = {
    _T.narrow: LazyTensor._narrow, torch.narrow: LazyTensor._narrow,
    _T.__getitem__: LazyTensor._getitem,
    _T.transpose: LazyTensor._transpose, torch.transpose: LazyTensor._transpose,
    _T.swapaxes: LazyTensor._transpose, torch.swapaxes: LazyTensor._transpose,
    _T.t: LazyTensor._t, torch.t: LazyTensor._t, _T.T.__get__: LazyTensor._t,
    _T.reshape: LazyTensor._reshape, torch.reshape: LazyTensor._reshape,
    _T.index_select: LazyTensor._index_select, torch.index_select: LazyTensor._index_select,
    _T.__hash__: _hash,
}
