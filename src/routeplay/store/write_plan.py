"""Planning a batched write: which arrays to store, and which rows each sample points at.

Pure numpy (no Ray). A batch of samples is written in one adopt call per store shard.
With ``shared_prefix=P`` the samples whose first ``P`` rows are *verified* equal (compared
byte for byte, never assumed from the prompt text: two engines, or two weight versions,
may route the same prompt differently) store those rows once;
each such sample's handle is ``[shared prefix][its own suffix]``. A sample whose prefix
differs (or that is shorter than ``P``) keeps its own full rows. The plan counts the
bytes sharing saved, for the store's stats.

``pack=True`` lays the whole batch out as *one* array (the shared prefix once, then every
sample's own rows): one payload, one object-store write and one record for a GRPO group
or for the resumes of one, and each handle is row ranges of it. The payload lives while
any member holds a lease, and a reader of one member fetches all of it (one block): right
when a group is trained together on one node (the rollout lifecycle's group writes), not
when its members go to trainer ranks on different nodes. Unpacked (the store's default),
every piece is a payload of its own with its own lifetime and reads.

Example:
    layout = plan_batch([a, b, c], prefix_rows=4096)   # a GRPO group of 3
    layout.arrays   # (prefix, a_suffix, b_suffix, c_suffix) when all prefixes match
    layout.samples  # per sample: Part(array=0, start=0, stop=4096), then its suffix's
    plan_batch([a, b, c], prefix_rows=4096, pack=True).arrays  # one array: all of it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.bytes_equal import bytes_equal
from routeplay.core.handle import Handle
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch
from routeplay.store.joined_rows import JoinedRows

Rows = npt.NDArray[Any] | JoinedRows
"""What a payload is made of before it is written (an array, or pieces joined when written)."""

__all__ = [
    "MIN_BLOCK_BYTES",
    "BatchLayout",
    "Part",
    "batch_spec",
    "plan_batch",
    "plan_write",
    "split_blocks",
]

# Ray returns values under 100 KiB inline to the caller instead of writing them to the
# object store; blocks stay above that so payload bytes never travel through a shard.
MIN_BLOCK_BYTES = 256 * 1024


def split_blocks(array: Rows, block_rows: int) -> tuple[Rows, ...]:
    """Row blocks of ``array`` (views, no copy); one block when ``block_rows`` is 0."""
    if block_rows <= 0 or array.shape[0] <= block_rows:
        return (array,)
    return tuple(array[i : i + block_rows] for i in range(0, array.shape[0], block_rows))


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """Rows ``[start, stop)`` of one of a layout's arrays."""

    array: int
    """Index into ``BatchLayout.arrays``."""
    start: int
    """First row."""
    stop: int
    """One past the last row."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchLayout:
    """What a batched put stores and how each sample is made of it."""

    arrays: tuple[npt.NDArray[Any] | JoinedRows, ...]
    """Arrays to store, one payload each (views of the samples' arrays, or all of them
    packed: ``JoinedRows``, joined as the object store writes it)."""
    samples: tuple[tuple[Part, ...], ...]
    """Per sample, the row ranges of ``arrays`` that are, in order, the sample's rows."""
    saved_bytes: int
    """Bytes not written because a verified-equal prefix is stored once."""

    def payloads_of(self, sample: int) -> tuple[int, ...]:
        """Indices of the arrays sample ``sample`` points into (each once, in order)."""
        return tuple(dict.fromkeys(part.array for part in self.samples[sample]))

    def payloads_per_sample(self) -> list[tuple[int, ...]]:
        """``payloads_of`` every sample, in order: what each sample's lease covers."""
        return [self.payloads_of(sample) for sample in range(len(self.samples))]


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


def plan_write(
    batch: Sequence[Routes], *, prefix_rows: int = 0, pack: bool = False
) -> tuple[RouteSpec, BatchLayout] | list[Handle]:
    """A batched write's spec and layout (``plan_batch``), or, when it stores nothing (no
    samples, or samples without rows), every sample's handle already (empty).

    Example:
        planned = plan_write(group, prefix_rows=600)
        if isinstance(planned, list):
            return planned
        spec, layout = planned
    """
    spec = batch_spec(batch)
    if spec is None:
        return []
    layout = plan_batch(batch, prefix_rows=prefix_rows, pack=pack)
    if not layout.arrays:
        return [Handle(spec) for _ in batch]
    return spec, layout


def plan_batch(batch: Sequence[Routes], *, prefix_rows: int = 0, pack: bool = False) -> BatchLayout:
    """Lay out ``batch`` for storing; samples share their first ``prefix_rows`` rows
    where those are verified equal to another sample's, and ``pack`` makes the whole
    batch one array (see the module docstring)."""
    groups = _equal_prefix_groups(batch, prefix_rows)
    arrays: list[npt.NDArray[Any]] = []
    samples: list[tuple[int, ...]] = []
    stored: dict[int, int] = {}  # group representative -> array index of its prefix
    saved = 0
    for index, routes in enumerate(batch):
        leader = groups.get(index)
        if leader is None:  # nobody else has these prefix rows: the sample keeps its own
            samples.append(_add(arrays, routes.array))
            continue
        if leader in stored:
            saved += batch[leader].array[:prefix_rows].nbytes
        else:
            stored[leader] = len(arrays)
            arrays.append(batch[leader].array[:prefix_rows])
        samples.append((stored[leader], *_add(arrays, routes.array[prefix_rows:])))
    if pack and len(arrays) > 1:
        return _packed(arrays, samples, saved)
    return BatchLayout(
        arrays=tuple(arrays),
        samples=tuple(
            tuple(Part(array=i, start=0, stop=int(arrays[i].shape[0])) for i in pieces)
            for pieces in samples
        ),
        saved_bytes=saved,
    )


def _packed(
    arrays: list[npt.NDArray[Any]], samples: list[tuple[int, ...]], saved: int
) -> BatchLayout:
    """The pieces as one payload, end to end (joined only when written: ``JoinedRows``);
    each sample's parts are its pieces' row ranges in it."""
    bounds = np.cumsum([0] + [int(a.shape[0]) for a in arrays])
    return BatchLayout(
        arrays=(JoinedRows(arrays),),
        samples=tuple(
            tuple(Part(array=0, start=int(bounds[i]), stop=int(bounds[i + 1])) for i in pieces)
            for pieces in samples
        ),
        saved_bytes=saved,
    )


def _equal_prefix_groups(batch: Sequence[Routes], prefix_rows: int) -> dict[int, int]:
    """Sample index -> first sample with byte-equal prefix rows, for groups of two or
    more. Each sample is compared with the batch's first sample that has the prefix
    (a GRPO group's members share its prompt: one compare each, nothing else); one that
    differs looks among the other leaders with the same few sampled rows (``_digest``),
    compared in turn: a sampled match alone is not proof."""
    if prefix_rows <= 0:
        return {}
    first: int | None = None
    leaders: dict[bytes, list[int]] = {}  # the other leaders, by their sampled rows
    members: dict[int, list[int]] = {}
    for index, routes in enumerate(batch):
        if routes.array.shape[0] < prefix_rows:
            continue
        head = routes.array[:prefix_rows]
        if first is None:
            first = index
            members[index] = [index]
            continue
        if bytes_equal(batch[first].array[:prefix_rows], head):
            members[first].append(index)
            continue
        candidates = leaders.setdefault(_digest(head), [])
        leader = next(
            (i for i in candidates if bytes_equal(batch[i].array[:prefix_rows], head)), None
        )
        if leader is None:
            candidates.append(index)
            members[index] = [index]
        else:
            members[leader].append(index)
    return {i: leader for leader, group in members.items() if len(group) > 1 for i in group}


def _add(arrays: list[npt.NDArray[Any]], array: npt.NDArray[Any]) -> tuple[int, ...]:
    if array.shape[0] == 0:
        return ()  # nothing to store: an empty payload would keep nothing alive
    arrays.append(array)
    return (len(arrays) - 1,)


_SAMPLED_ROWS = 8


def _digest(rows: npt.NDArray[Any]) -> bytes:
    """A cheap key for candidate prefixes: a few evenly spaced rows (every layer of each),
    the last row, and the row count. Only a bucket, never proof: every candidate is
    compared byte for byte. A hash of the whole prefix cost 10x the compare it saved
    (0.2 ms a sample at 512 x 48 x 8), paid on every write of a group."""
    count = int(rows.shape[0])
    step = max(1, count // _SAMPLED_ROWS)
    picked: bytes = np.ascontiguousarray(rows[::step]).tobytes() + rows[-1].tobytes()
    return count.to_bytes(8, "little") + picked
