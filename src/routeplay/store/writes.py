"""Planning a batched write: which arrays to store, and which rows each sample points at.

Pure numpy (no Ray). A batch of samples is written in one adopt call per store shard.
With ``shared_prefix=P`` the samples whose first ``P`` rows are *verified* equal (same
digest, then compared byte for byte, never assumed from the prompt text: two engines,
or two weight versions, may route the same prompt differently) store those rows once;
each such sample's handle is ``[shared prefix][its own suffix]``. A sample whose prefix
differs (or that is shorter than ``P``) keeps its own full array. The plan counts the
bytes sharing saved, for the store's stats.

Example:
    layout = plan_batch([a, b, c], prefix_rows=4096)   # a GRPO group of 3
    layout.arrays   # (prefix, a_suffix, b_suffix, c_suffix) when all prefixes match
    layout.samples  # ((0, 1), (0, 2), (0, 3)): array indices making up each sample
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch

__all__ = ["BatchLayout", "batch_spec", "plan_batch", "split_blocks"]


def split_blocks(array: npt.NDArray[Any], block_rows: int) -> tuple[npt.NDArray[Any], ...]:
    """Row blocks of ``array`` (views, no copy); one block when ``block_rows`` is 0."""
    if block_rows <= 0 or array.shape[0] <= block_rows:
        return (array,)
    return tuple(array[i : i + block_rows] for i in range(0, array.shape[0], block_rows))


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchLayout:
    """What a batched put stores and how each sample is made of it."""

    arrays: tuple[npt.NDArray[Any], ...]
    """Arrays to store, one payload each (views of the samples' arrays: no copy)."""
    samples: tuple[tuple[int, ...], ...]
    """Per sample, the indices of ``arrays`` whose rows, in order, are the sample's."""
    saved_bytes: int
    """Bytes not written because a verified-equal prefix is stored once."""


def batch_spec(batch: Sequence[Routes]) -> RouteSpec | None:
    """The one spec of a batch (None when empty); a batch mixing specs is refused."""
    if not batch:
        return None
    spec = batch[0].spec
    for index, routes in enumerate(batch):
        if routes.spec != spec:
            raise SpecMismatch(
                "a batched put mixes model specs",
                expected=spec.describe(),
                found=routes.spec.describe(),
                where=f"sample {index} of the batch",
            )
    return spec


def plan_batch(batch: Sequence[Routes], *, prefix_rows: int = 0) -> BatchLayout:
    """Lay out ``batch`` for storing; samples share their first ``prefix_rows`` rows
    where those are verified equal (see the module docstring)."""
    arrays: list[npt.NDArray[Any]] = []
    samples: list[tuple[int, ...]] = []
    prefixes: dict[bytes, list[int]] = {}  # digest -> array indices of stored prefixes
    saved = 0
    for routes in batch:
        array = routes.array
        if prefix_rows <= 0 or array.shape[0] < prefix_rows or array.shape[0] == 0:
            samples.append(_add(arrays, array))
            continue
        head = array[:prefix_rows]
        shared = _find_equal(arrays, prefixes, head)
        if shared is None:
            shared = len(arrays)
            arrays.append(head)
            prefixes.setdefault(_digest(head), []).append(shared)
        else:
            saved += head.nbytes
        samples.append((shared, *_add(arrays, array[prefix_rows:])))
    return BatchLayout(arrays=tuple(arrays), samples=tuple(samples), saved_bytes=saved)


def _add(arrays: list[npt.NDArray[Any]], array: npt.NDArray[Any]) -> tuple[int, ...]:
    if array.shape[0] == 0:
        return ()  # nothing to store: an empty payload would keep nothing alive
    arrays.append(array)
    return (len(arrays) - 1,)


def _find_equal(
    arrays: list[npt.NDArray[Any]], prefixes: dict[bytes, list[int]], head: npt.NDArray[Any]
) -> int | None:
    """A stored prefix equal to ``head``: same digest, then the bytes compared."""
    for index in prefixes.get(_digest(head), []):
        if np.array_equal(arrays[index], head):
            return index
    return None


def _digest(rows: npt.NDArray[Any]) -> bytes:
    # blake2b over the raw bytes (canonical arrays are C-contiguous: no copy here)
    return hashlib.blake2b(np.ascontiguousarray(rows).data.cast("B")).digest()
