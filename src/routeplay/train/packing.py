"""Packing plans and rank layouts: which token positions of which pack a rank trains on.

A step's samples are packed into packs of ``pack_max_length`` positions; a sample of
``tokens`` tokens feeds its input ids ``tokens[:-1]`` to positions
``[offset, offset + tokens - 1)`` of its pack, and exactly those positions carry its
routing rows ``[0, tokens - 1)``. Packs are grouped into micro-batches (each trained by
one data-parallel rank), and inside a micro-batch every pack is split over context
parallelism (CP) first and sequence parallelism (SP) second: ``local_ranges`` says which
positions of a pack one rank holds, in the order its input ids are laid out.

Invariants kept by construction: a sample's handle has exactly ``tokens - 1`` rows (a
``RowCountMismatch`` otherwise, raised when the plan is built, before any read); samples
of a pack do not overlap and fit in its length; every pack belongs to exactly one
micro-batch; sample ids are unique in a plan; all handles share the plan's spec; over all
``cp_size * sp_size`` ranks, ``local_ranges`` covers each pack position exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from routeplay.core.handle import Handle
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, RowCountMismatch, SpecMismatch

__all__ = [
    "CpSplit",
    "Pack",
    "PackedSample",
    "PackingPlan",
    "RankCoords",
    "local_ranges",
    "local_tokens",
    "pack_samples",
]

CpSplit: TypeAlias = Literal["contiguous", "zigzag"]
_CP_SPLITS: tuple[CpSplit, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedSample:
    """One sample placed in a pack; its routing rows land on positions ``[offset, stop)``."""

    sample_id: str
    """Unique id of the sample (named in every error about it)."""
    handle: Handle
    """Routing rows ``[0, tokens - 1)`` of the sample."""
    tokens: int
    """Prompt plus response tokens; the sample trains on ``tokens - 1`` positions."""
    offset: int
    """Pack position of the sample's first input id."""

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.offset < 0:
            raise MisuseError(
                "a packed sample needs at least one token and a non-negative offset",
                expected="tokens >= 1, offset >= 0",
                found=f"tokens={self.tokens}, offset={self.offset}",
                where=f"sample {self.sample_id}",
            )
        if self.handle.rows != self.tokens - 1:
            raise RowCountMismatch(
                "routing rows do not match the sample's tokens",
                expected=f"{self.tokens - 1} rows (tokens - 1 for {self.tokens} tokens)",
                found=f"{self.handle.rows} rows",
                where=f"sample {self.sample_id}",
                hint="A sample trains on tokens - 1 positions and needs one routing row each; "
                "fix the rollout that produced it before training on it.",
            )

    @property
    def rows(self) -> int:
        """Routing rows (= trained positions) of the sample."""
        return self.tokens - 1

    @property
    def stop(self) -> int:
        """Pack position one past the sample's last input id."""
        return self.offset + self.rows


@dataclass(frozen=True, slots=True, kw_only=True)
class Pack:
    """Samples sharing one packed sequence; positions no sample covers are padding."""

    samples: tuple[PackedSample, ...]
    """Samples in increasing offset order, not overlapping."""
    length: int
    """Positions in the pack (``pack_max_length``); the tail past the last sample pads."""

    def __post_init__(self) -> None:
        if self.length < 1:
            raise MisuseError("a pack needs at least one position", found=self.length)
        end = 0
        for sample in self.samples:
            if sample.offset < end or sample.stop > self.length:
                raise MisuseError(
                    "samples of a pack must be ordered, disjoint and inside the pack",
                    expected=f"offset >= {end} and stop <= {self.length}",
                    found=f"positions [{sample.offset}, {sample.stop})",
                    where=f"sample {sample.sample_id}",
                )
            end = sample.stop

    @property
    def real_rows(self) -> int:
        """Positions that carry a sample's rows (the rest is padding)."""
        return sum(sample.rows for sample in self.samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingPlan:
    """A step's packs and the micro-batches they form, in training order."""

    spec: RouteSpec
    """Geometry shared by every sample's routing."""
    packs: tuple[Pack, ...]
    """Every pack of the step."""
    micro_batches: tuple[tuple[int, ...], ...]
    """Pack indices of each micro-batch, in the order micro-batches are trained."""
    dp_ranks: tuple[int, ...] | None = None
    """Data-parallel rank that trains each micro-batch; None means all on rank 0."""

    def __post_init__(self) -> None:
        self._check_micro_batches()
        seen: set[str] = set()
        for index, pack in enumerate(self.packs):
            for sample in pack.samples:
                if sample.sample_id in seen:
                    raise MisuseError(
                        "a sample appears twice in the plan",
                        where=f"sample {sample.sample_id} (pack {index})",
                        hint="Pack each sample once per step.",
                    )
                seen.add(sample.sample_id)
                if sample.handle.spec != self.spec:
                    raise SpecMismatch(
                        "sample routing has another spec than the plan",
                        expected=self.spec.describe(),
                        found=sample.handle.spec.describe(),
                        where=f"sample {sample.sample_id}",
                    )

    def _check_micro_batches(self) -> None:
        owner: dict[int, int] = {}
        for mb, packs in enumerate(self.micro_batches):
            if not packs:
                raise MisuseError("a micro-batch needs a pack", where=f"micro-batch {mb}")
            for index in packs:
                if not 0 <= index < len(self.packs) or index in owner:
                    again = f" again (also in micro-batch {owner[index]})" if index in owner else ""
                    raise MisuseError(
                        "every pack must belong to exactly one micro-batch",
                        expected=f"each of packs 0..{len(self.packs) - 1} once",
                        found=f"pack {index}{again}",
                        where=f"micro-batch {mb}",
                    )
                owner[index] = mb
        if len(owner) != len(self.packs):
            missing = sorted(set(range(len(self.packs))) - set(owner))
            raise MisuseError(
                "every pack must belong to a micro-batch", found=f"packs {missing} in none"
            )
        if self.dp_ranks is not None and (
            len(self.dp_ranks) != len(self.micro_batches) or min(self.dp_ranks, default=0) < 0
        ):
            raise MisuseError(
                "dp_ranks must name one non-negative rank per micro-batch",
                expected=len(self.micro_batches),
                found=self.dp_ranks,
            )

    def schedule(self, dp_rank: int = 0) -> tuple[int, ...]:
        """Indices of the micro-batches ``dp_rank`` trains, in plan order."""
        if self.dp_ranks is None:
            return tuple(range(len(self.micro_batches))) if dp_rank == 0 else ()
        return tuple(i for i, rank in enumerate(self.dp_ranks) if rank == dp_rank)

    def samples_of(self, micro_batch: int) -> tuple[PackedSample, ...]:
        """Samples of one micro-batch, pack by pack."""
        return tuple(s for i in self.micro_batches[micro_batch] for s in self.packs[i].samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoords:
    """Where a trainer rank sits: which micro-batches it trains and which positions."""

    dp_rank: int = 0
    """Data-parallel rank: selects micro-batches (``PackingPlan.dp_ranks``)."""
    sp_rank: int = 0
    """Sequence-parallel rank within the CP-local sequence."""
    sp_size: int = 1
    """Sequence-parallel ranks sharing one CP-local sequence."""
    cp_rank: int = 0
    """Context-parallel rank."""
    cp_size: int = 1
    """Context-parallel ranks sharing one pack."""
    cp_split: CpSplit = "contiguous"
    """``contiguous``: CP rank r holds the r-th of ``cp_size`` equal chunks; ``zigzag``:
    it holds chunks r and ``2 * cp_size - 1 - r`` of ``2 * cp_size`` (balances causal
    attention work)."""

    def __post_init__(self) -> None:
        for rank, size, label in (
            (self.sp_rank, self.sp_size, "sp"),
            (self.cp_rank, self.cp_size, "cp"),
        ):
            if not 0 <= rank < size:
                raise MisuseError(
                    f"{label}_rank must lie in [0, {label}_size)",
                    expected=f"0 <= {label}_rank < {size}",
                    found=rank,
                )
        if self.dp_rank < 0:
            raise MisuseError("dp_rank must be non-negative", found=self.dp_rank)
        if self.cp_split not in _CP_SPLITS:
            raise MisuseError("unknown cp_split", expected=_CP_SPLITS, found=self.cp_split)

    def describe(self) -> str:
        """Short label for holders and logs, e.g. ``dp0/cp1/sp3``."""
        return f"dp{self.dp_rank}/cp{self.cp_rank}/sp{self.sp_rank}"


def local_ranges(pack_length: int, coords: RankCoords) -> list[tuple[int, int]]:
    """Pack positions ``[start, stop)`` one rank holds, in the order of its input ids.

    CP splits the pack first, SP then splits the CP-local sequence into ``sp_size``
    contiguous equal parts. Adjacent ranges are merged (zigzag with ``cp_size = 1`` is one
    range); a zigzag SP part may straddle the two CP chunks and then has two ranges.
    """
    cp, sp = coords.cp_size, coords.sp_size
    chunks = 2 * cp if coords.cp_split == "zigzag" else cp
    if pack_length % chunks or (pack_length // cp) % sp:
        raise MisuseError(
            "pack length does not split evenly over the CP and SP ranks",
            expected=f"a multiple of {chunks} whose 1/{cp} is a multiple of {sp}",
            found=pack_length,
            where=f"cp_size={cp} ({coords.cp_split}), sp_size={sp}",
            hint="Choose pack_max_length as a multiple of 2 * cp_size * sp_size.",
        )
    chunk = pack_length // chunks
    if coords.cp_split == "zigzag":
        cp_local = [(coords.cp_rank * chunk, (coords.cp_rank + 1) * chunk)]
        mirror = 2 * cp - 1 - coords.cp_rank
        cp_local.append((mirror * chunk, (mirror + 1) * chunk))
    else:
        cp_local = [(coords.cp_rank * chunk, (coords.cp_rank + 1) * chunk)]
    part = pack_length // cp // sp
    lo, hi = coords.sp_rank * part, (coords.sp_rank + 1) * part  # in CP-local coordinates
    out: list[tuple[int, int]] = []
    base = 0  # CP-local coordinate of the current chunk's first position
    for start, stop in cp_local:
        a, b = max(lo, base), min(hi, base + stop - start)
        if a < b:
            first, last = start + a - base, start + b - base
            if out and out[-1][1] == first:
                out[-1] = (out[-1][0], last)
            else:
                out.append((first, last))
        base += stop - start
    return out


def local_tokens(pack_length: int, coords: RankCoords) -> int:
    """Positions of one pack a rank holds (the same on every rank)."""
    return sum(stop - start for start, stop in local_ranges(pack_length, coords))


def pack_samples(
    samples: Iterable[tuple[str, Handle, int]],
    pack_max_length: int,
    packs_per_micro_batch: int = 1,
    *,
    dp_size: int = 1,
    spec: RouteSpec | None = None,
) -> PackingPlan:
    """Greedy in-order packing of ``(sample_id, handle, tokens)`` samples.

    A sample goes to the current pack if its ``tokens - 1`` positions fit, else it opens
    a new pack. Consecutive packs form micro-batches of ``packs_per_micro_batch`` (the last
    may be shorter), dealt round-robin over ``dp_size`` data-parallel ranks. Row counts
    are checked here, before anything is read. ``spec`` defaults to the first sample's.
    """
    if pack_max_length < 1 or packs_per_micro_batch < 1 or dp_size < 1:
        raise MisuseError(
            "pack_max_length, packs_per_micro_batch and dp_size must be positive",
            found=(pack_max_length, packs_per_micro_batch, dp_size),
        )
    packs: list[tuple[PackedSample, ...]] = []
    current: list[PackedSample] = []
    used = 0
    for sample_id, handle, tokens in samples:
        spec = handle.spec if spec is None else spec
        rows = tokens - 1
        if rows > pack_max_length:
            raise MisuseError(
                "sample is longer than a pack",
                expected=f"at most {pack_max_length} trained positions",
                found=f"{rows} positions ({tokens} tokens)",
                where=f"sample {sample_id}",
                hint="Raise pack_max_length or truncate the sample before packing.",
            )
        if used + rows > pack_max_length:
            packs.append(tuple(current))
            current, used = [], 0
        current.append(PackedSample(sample_id=sample_id, handle=handle, tokens=tokens, offset=used))
        used += rows
    if current:
        packs.append(tuple(current))
    if spec is None:
        raise MisuseError("nothing to pack", hint="Pass at least one sample, or a spec.")
    groups = _chunks(range(len(packs)), packs_per_micro_batch)
    return PackingPlan(
        spec=spec,
        packs=tuple(Pack(samples=p, length=pack_max_length) for p in packs),
        micro_batches=groups,
        dp_ranks=tuple(i % dp_size for i in range(len(groups))),
    )


def _chunks(items: Sequence[int], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(items[i : i + size]) for i in range(0, len(items), size))
