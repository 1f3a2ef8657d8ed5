"""``JoinedRows``: a packed payload's pieces, stored as pieces, read as one row range.

A packed batch (a GRPO group: the prompt's rows once, then each member's own) is one
payload. Its pieces are never joined on the write path: Ray pickles a ``JoinedRows``
(a producer's ``take_staged`` result, a ``ray.put``) as its pieces, each an out-of-band
buffer copied once into the object store, back to back. A reader gets a ``JoinedRows``
of zero-copy views into the stored object and copies its rows from the piece that
holds them (``views``): a read copies exactly the rows the joined array would have
given it, from one piece or, for a range that spans pieces, from each in turn.

Why not one joined array: joining copies every byte once more, in the thread that
writes a producer's results, before the copy into the object store. At 4,096 samples
(512 groups of 1.8 MB) a step's writes took 816-848 ms joined and 713-749 ms as pieces
(same session, ``benchmarks/rl_step_cpu.py``'s cluster); joining at planning time
instead held every staged group joined at once, in freshly mapped pages.

The pieces are the producer's canonical arrays (read-only views): nothing can change them
between planning and the write.

Example:
    rows = JoinedRows([prompt_rows, own_a, own_b])
    rows.shape            # (prompt + a + b rows, layers, top_k)
    rows.views(2, 9)      # the pieces' views that are rows [2, 9), in order
    np.asarray(rows)      # joined now (the local backend stores this copy)
"""

from __future__ import annotations

import bisect
import pickle
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np
import numpy.typing as npt

__all__ = ["JoinedRows"]


class JoinedRows:
    """Row pieces of one dtype and row shape that are stored as one array."""

    __slots__ = ("_ends", "_starts", "dtype", "pieces", "shape")

    def __init__(self, pieces: Sequence[npt.NDArray[Any]]) -> None:
        if not pieces:
            raise ValueError("JoinedRows needs at least one piece (an empty one will do)")
        first = pieces[0]
        self.pieces = tuple(pieces)
        self.dtype = first.dtype
        starts, ends, rows = [], [], 0
        for piece in self.pieces:
            starts.append(rows)
            rows += int(piece.shape[0])
            ends.append(rows)
        self._starts, self._ends = starts, ends
        self.shape = (rows, *first.shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes of the joined array."""
        return sum(int(p.nbytes) for p in self.pieces)

    def join(self) -> npt.NDArray[Any]:
        """The pieces end to end, in a new array."""
        return np.concatenate(self.pieces)

    def copy(self) -> npt.NDArray[Any]:
        """The joined array (a copy of the pieces, as ``ndarray.copy`` is)."""
        return self.join()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        if copy is False:  # numpy 2's protocol: joining pieces is always a copy
            raise ValueError("JoinedRows cannot be viewed without a copy: its pieces are apart")
        out = self.join()
        return out if dtype is None else out.astype(dtype, copy=False)

    def views(self, start: int, stop: int) -> list[npt.NDArray[Any]]:
        """Rows ``[start, stop)`` (``0 <= start``) as views of the pieces that hold them,
        in order: one view when one piece holds them all (most of a handle's segments:
        a prompt, a member's own rows; the first member's, merged with the prompt,
        spans two). A range past the end is cut there, as a slice of an array is."""
        if start < 0:
            raise ValueError(f"JoinedRows.views takes rows from 0; found start {start}")
        at = bisect.bisect_right(self._starts, start) - 1
        base, end = self._starts[at], self._ends[at]
        if stop <= end:
            return [self.pieces[at][start - base : stop - base]] if stop > start else []
        out = []
        stop = min(stop, self.shape[0])
        while start < stop:
            base, end = self._starts[at], self._ends[at]
            if end > start:
                out.append(self.pieces[at][start - base : min(stop, end) - base])
                start = end
            at += 1
        return out

    def __getitem__(self, rows: slice) -> JoinedRows:
        """Rows ``[start, stop)`` (a block of a payload split in blocks), still unjoined."""
        if not isinstance(rows, slice):
            raise ValueError(f"JoinedRows takes row ranges only; found {rows!r}")
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError(f"JoinedRows takes row ranges only; found step {step}")
        picked, at = [], 0
        for piece in self.pieces:
            end = at + int(piece.shape[0])
            if end > start and at < stop:
                picked.append(piece[max(start - at, 0) : min(stop, end) - at])
            at = end
        return JoinedRows(picked or [self.pieces[0][:0]])

    def __len__(self) -> int:
        return int(self.shape[0])

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as its pieces (with protocol 5, Ray's, each an out-of-band buffer: one
        # copy into the object store, no join); unpickled, the pieces are zero-copy views.
        # Each piece goes as a bare buffer beside one dtype and row shape, not as an
        # array: Ray's pickler runs Python code for every object it is handed but plain
        # tuples, numbers, strings and buffers, and nine arrays (each with its dtype and
        # rebuilding function) cost the rollout worker 0.33 ms of CPU a group to pickle
        # (42 ms a step at 1,024 samples); as buffers, 0.19 ms (24 ms).
        if int(protocol) < 5:  # no out-of-band buffers: the pieces as arrays
            return (JoinedRows, (self.pieces,))
        rows = tuple(int(piece.shape[0]) for piece in self.pieces)
        buffers = (pickle.PickleBuffer(np.ascontiguousarray(piece).data) for piece in self.pieces)
        return (_from_buffers, (self.dtype.str, self.shape[1:], rows, *buffers))


def _from_buffers(
    dtype: str, row_shape: tuple[int, ...], rows: tuple[int, ...], *buffers: Any
) -> JoinedRows:
    """A pickled ``JoinedRows`` back: each piece a zero-copy view of its buffer."""
    kind = np.dtype(dtype)
    return JoinedRows(
        [
            np.frombuffer(buffer, kind).reshape(count, *row_shape)
            for count, buffer in zip(rows, buffers, strict=True)
        ]
    )
