"""Packing plans and rank layouts: which token positions of which pack a rank trains on.

A step's samples are packed into packs of ``pack_max_length`` positions; a sample of
``tokens`` tokens feeds its input ids ``tokens[:-1]`` to positions
``[offset, offset + tokens - 1)`` of its pack, and exactly those positions carry its
routing rows ``[0, tokens - 1)``. A sample's *sequence* (its ``span``) may run on past its
rows: per-sequence alignment padding (THD packs pad each sequence to a multiple of
``2 * cp * tp``), or the last token when the trainer feeds it (engines route no row for it).
Packs are grouped into micro-batches (each trained by one data-parallel rank), and inside a
micro-batch every pack is split over context parallelism (CP) first and sequence
parallelism (SP) second: ``local_ranges`` says which positions of a pack one rank holds, in
the order its input ids are laid out.

CP splits (``RankCoords.cp_split``), each named for the trainers that lay tokens out so:

- ``per_sequence``: every sequence is cut into ``2 * cp`` equal chunks and CP rank ``r``
  holds chunks ``r`` and ``2 * cp - 1 - r`` of each, sequence after sequence (Megatron-Core
  THD with TransformerEngine, verl, slime, NeMo-RL); the pack's tail past the last
  sequence is padding, dealt in ``cp`` equal parts at the end of each rank's tokens.
- ``pack_zigzag``: the whole pack is cut into ``2 * cp`` chunks, rank ``r`` holds chunks
  ``r`` and ``2 * cp - 1 - r`` (Megatron's BSHD ``get_batch_on_this_cp_rank``,
  LLaMA-Factory / EasyContext zigzag ring attention on one packed row).
- ``contiguous``: rank ``r`` holds the r-th of ``cp`` equal chunks of the pack (slime's
  all-gather CP for sparse attention, llama3-style ring attention).

SP splits (``RankCoords.sp_split``):

- ``even``: the CP-local stream must split into ``sp_size`` equal parts (refused
  otherwise: choose the pack length as a multiple of ``2 * cp * sp``).
- ``pad_to_multiple``: XTuner's ``SequenceContext.split`` (SP without CP): the pack is
  zero-padded at its end to a multiple of ``sp_size``, then cut into ``sp_size``
  contiguous equal parts. The padded positions ``[length, ceil(length / sp) * sp)`` lie
  past the pack's end: ``local_ranges`` names them like pack positions, and the
  materializer fills them with padding rows (distinct ids, mask False), never zeros.

A trainer that decides its own packs (XTuner's ``TrainingController._packing``: samples
back to back, a padded tail, and whole padding packs so every DP rank trains as many
micro-batches) describes them with ``PackingPlan.from_packs``; ``pack_samples`` is
routeplay's own greedy packer.

Invariants kept by construction: a sample's handle has exactly ``tokens - 1`` rows (a
``RowCountMismatch`` otherwise, raised when the plan is built, before any read); samples
of a pack do not overlap and fit in its length; every pack belongs to exactly one
micro-batch; sample ids are unique in a plan; all handles share the plan's spec; over all
``cp_size * sp_size`` ranks, ``local_ranges`` covers each pack position exactly once
(and, with ``pad_to_multiple``, each SP padding position past the pack's end once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from routeplay.core.handle import Handle
from routeplay.core.records import fast_state, fields_reduced, restored_fields
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, RowCountMismatch, SpecMismatch
from routeplay.train.plan_pickle import plan_reduced

__all__ = [
    "CpSplit",
    "Pack",
    "PackItem",
    "PackedSample",
    "PackingPlan",
    "RankCoords",
    "SpSplit",
    "local_ranges",
    "local_tokens",
    "pack_samples",
    "seq_alignment",
]

PackItem: TypeAlias = (
    "tuple[str, Handle, int] | tuple[str, Handle, int, tuple[int, int]] | PackedSample"
)
"""One entry of a trainer's pack (``PackingPlan.from_packs``): ``(sample_id, handle,
tokens)`` places the sample's rows right after the previous entry; ``(sample_id, handle,
tokens, (start, stop))`` places only its routing rows ``[start, stop)`` (a trainable
segment); a ``PackedSample`` keeps the trainer's own offset and span."""

CpSplit: TypeAlias = Literal["per_sequence", "pack_zigzag", "contiguous"]
_CP_SPLITS: tuple[CpSplit, ...] = ("per_sequence", "pack_zigzag", "contiguous")
SpSplit: TypeAlias = Literal["even", "pad_to_multiple"]
_SP_SPLITS: tuple[SpSplit, ...] = ("even", "pad_to_multiple")


@fast_state
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
    span: int | None = None
    """Pack positions of the sample's sequence: its rows, then padding (the trainer's
    per-sequence alignment, or a fed last token); None means exactly its rows."""

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.offset < 0 or self.positions < self.tokens - 1:
            raise MisuseError(
                "a packed sample needs a token, a non-negative offset, and a span "
                "covering its rows",
                expected="tokens >= 1, offset >= 0, span >= tokens - 1",
                found=f"tokens={self.tokens}, offset={self.offset}, span={self.span}",
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

    def __reduce__(self) -> tuple[object, ...]:
        # Positional, checked when built: every rank unpickles the step's whole plan.
        if type(self) is not PackedSample:  # a subclass may add fields
            return fields_reduced(self)
        return (_packed_sample, (self.sample_id, self.handle, self.tokens, self.offset, self.span))

    @property
    def stop(self) -> int:
        """Pack position one past the sample's last routed input id."""
        return self.offset + self.rows

    @property
    def positions(self) -> int:
        """Pack positions its sequence occupies (``span``, or its rows)."""
        return self.rows if self.span is None else self.span

    @property
    def end(self) -> int:
        """Pack position one past the sample's sequence (its padding included)."""
        return self.offset + self.positions


def _packed_sample(
    sample_id: str, handle: Handle, tokens: int, offset: int, span: int | None
) -> PackedSample:
    restored: Any = object.__new__(PackedSample)
    restored.__setstate__((sample_id, handle, tokens, offset, span))
    return restored  # type: ignore[no-any-return]


@fast_state
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
            if sample.offset < end or sample.end > self.length:
                raise MisuseError(
                    "samples of a pack must be ordered, disjoint and inside the pack",
                    expected=f"offset >= {end} and end <= {self.length}",
                    found=f"positions [{sample.offset}, {sample.end})",
                    where=f"sample {sample.sample_id}",
                )
            end = sample.end

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
                spec = sample.handle.spec
                if spec is not self.spec and spec != self.spec:  # specs are mostly shared
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

    @classmethod
    def from_packs(
        cls,
        packs: Iterable[Iterable[PackItem]],
        *,
        pack_max_length: int | None = None,
        dp_size: int = 1,
        packs_per_micro_batch: int = 1,
        pad_dp: bool = True,
        spec: RouteSpec | None = None,
    ) -> PackingPlan:
        """A plan from packs the trainer decided itself (XTuner's ``_packing``).

        Each pack lists its entries (``PackItem``) in position order: a tuple entry goes
        right after the previous entry's sequence, from position 0, as XTuner concatenates
        its samples' ``input_ids``. Every pack is ``pack_max_length`` long (the tail past its
        last entry is padding), or, when ``pack_max_length`` is None, ends at its last entry.
        An empty pack is a whole padding pack. Consecutive packs form micro-batches of
        ``packs_per_micro_batch``, dealt round-robin over ``dp_size`` data-parallel ranks
        (XTuner: pack ``i`` to DP rank ``i % dp_size``). With ``pad_dp`` the micro-batches
        are padded up to a multiple of ``dp_size`` with micro-batches of one empty pack
        (``pack_max_length`` long, or as long as the longest pack), as XTuner pads DP, so every
        rank trains as many micro-batches. Row counts are checked here, before any read:
        a handle must hold ``tokens - 1`` rows (``RowCountMismatch``), a row range must lie
        inside them. ``spec`` defaults to the first entry's.

        Example:
            >>> plan = PackingPlan.from_packs(
            ...     [[("a", ha, 9), ("b", hb, 5)], [("c", hc, 12, (4, 11))]],
            ...     pack_max_length=16, dp_size=4)          # 2 packs + 2 DP padding packs
            >>> plan.schedule(3)                        # DP rank 3 trains padding only
            (3,)
        """
        lengths = () if pack_max_length is None else (pack_max_length,)
        if min(dp_size, packs_per_micro_batch, *lengths) < 1:
            raise MisuseError(
                "pack_max_length, dp_size and packs_per_micro_batch must be positive",
                found=(pack_max_length, dp_size, packs_per_micro_batch),
            )
        placed = [_place(index, pack) for index, pack in enumerate(packs)]
        if spec is None:
            spec = next((s.handle.spec for pack in placed for s in pack), None)
        if spec is None:
            raise MisuseError(
                "a plan without samples needs a spec", hint="Pass spec= to from_packs."
            )

        def length(index: int, samples: tuple[PackedSample, ...]) -> int:
            end = samples[-1].end if samples else 0
            if pack_max_length is None:
                if not samples:
                    raise MisuseError(
                        "an empty pack needs a length",
                        where=f"pack {index}",
                        hint="Pass pack_max_length= (XTuner's padding packs are that long).",
                    )
                return end
            if end > pack_max_length:
                raise MisuseError(
                    "pack is longer than pack_max_length",
                    expected=f"at most {pack_max_length} positions",
                    found=f"{end} positions",
                    where=f"pack {index}",
                )
            return pack_max_length

        built = [Pack(samples=p, length=length(i, p)) for i, p in enumerate(placed)]
        groups = list(_chunks(range(len(built)), packs_per_micro_batch))
        if pad_dp and groups and len(groups) % dp_size:
            pad = pack_max_length or max(p.length for p in built)
            for _ in range(dp_size - len(groups) % dp_size):
                groups.append((len(built),))
                built.append(Pack(samples=(), length=pad))
        return cls(
            spec=spec,
            packs=tuple(built),
            micro_batches=tuple(groups),
            dp_ranks=tuple(i % dp_size for i in range(len(groups))),
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Columns of plain tuples (``plan_pickle``): a driver pickles every rank's share
        # before sending it, on the step's critical path. Subclasses may add fields.
        reduced = None if type(self) is not PackingPlan else plan_reduced(self, Pack, PackedSample)
        return fields_reduced(self) if reduced is None else reduced

    def __copy__(self) -> PackingPlan:
        # Shallow: the same packs (not a rebuilt plan, as the pickled form would be).
        build, args = fields_reduced(self)
        return build(*args)  # type: ignore[no-any-return]

    def share(self, dp_rank: int) -> PackingPlan:
        """The plan as data-parallel rank ``dp_rank`` reads it: every other rank's pack
        emptied (a padding pack of the same length), the micro-batches, their order and
        their ranks unchanged. What a driver sends each rank: a rank unpickles its own
        samples only (a step's plan is thousands of handles), and a ``Materializer`` of
        that rank reads the same rows from it as from the whole plan.

        Example:
            >>> plans = [plan.share(r) for r in range(dp_size)]  # doctest: +SKIP
            >>> ranks[r].train.remote(plans[r])                    # doctest: +SKIP
        """
        mine = {index for mb in self.schedule(dp_rank) for index in self.micro_batches[mb]}
        padding: dict[int, Pack] = {}  # one empty pack per length: a step has thousands
        packs = []
        for index, pack in enumerate(self.packs):
            if index not in mine and pack.length not in padding:
                padding[pack.length] = Pack(samples=(), length=pack.length)
            packs.append(pack if index in mine else padding[pack.length])
        # A part of this checked plan (its samples, fewer): nothing to check again.
        return restored_fields(  # type: ignore[no-any-return]
            PackingPlan,
            ("spec", "packs", "micro_batches", "dp_ranks"),
            (self.spec, tuple(packs), self.micro_batches, self.dp_ranks),
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
    cp_split: CpSplit = "per_sequence"
    """How CP cuts a pack (see the module docstring): ``per_sequence`` (Megatron THD,
    verl, slime, NeMo-RL), ``pack_zigzag`` (Megatron BSHD) or ``contiguous``. All agree
    when ``cp_size == 1``."""
    sp_split: SpSplit = "even"
    """How SP cuts the CP-local stream (see the module docstring): ``even`` (refuses a
    stream that does not split evenly) or ``pad_to_multiple`` (XTuner: zero-pad the pack
    to a multiple of ``sp_size``, SP without CP only)."""

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
        if self.sp_split not in _SP_SPLITS:
            raise MisuseError("unknown sp_split", expected=_SP_SPLITS, found=self.sp_split)
        if self.sp_split == "pad_to_multiple" and self.cp_size > 1:
            raise MisuseError(
                "SP zero-padding is defined for SP without CP",
                expected="cp_size=1 with sp_split='pad_to_multiple'",
                found=f"cp_size={self.cp_size}",
                hint="XTuner pads a pack to a multiple of sp_size and has no CP; with CP, "
                "pad each sequence instead (pack_samples(..., seq_align=seq_alignment(...))).",
            )

    def describe(self) -> str:
        """Short label for holders and logs, e.g. ``dp0/cp1/sp3``."""
        return f"dp{self.dp_rank}/cp{self.cp_rank}/sp{self.sp_rank}"


def seq_alignment(*, cp_size: int = 1, sp_size: int = 1) -> int:
    """Multiple each THD sequence is padded to: ``2 * cp * sp`` with CP, ``sp`` without.

    The rule of Megatron-based trainers (verl ``preprocess_packed_seqs``, NeMo-RL, slime's
    per-sequence CP): every sequence splits into ``2 * cp`` chunks, and the CP-local stream
    into ``sp`` (= TP with sequence parallelism) equal parts. Pass it to ``pack_samples``.

    Example:
        >>> seq_alignment(cp_size=2, sp_size=4)
        16
    """
    if cp_size < 1 or sp_size < 1:
        raise MisuseError("cp_size and sp_size must be positive", found=(cp_size, sp_size))
    return 2 * cp_size * sp_size if cp_size > 1 else sp_size


def local_ranges(pack: Pack | int, coords: RankCoords) -> list[tuple[int, int]]:
    """Pack positions ``[start, stop)`` one rank holds, in the order of its input ids.

    CP cuts the pack first (``coords.cp_split``), SP then splits the CP-local stream into
    ``sp_size`` contiguous equal parts. Adjacent ranges are merged; an SP part may straddle
    CP chunks and then has several ranges. ``per_sequence`` needs the ``Pack`` (its
    sequences); the other splits need only its length. With
    ``sp_split="pad_to_multiple"`` a range may run past the pack's length: those
    positions are XTuner's SP zero-padding (padding rows).

    Example:
        >>> local_ranges(16, RankCoords(cp_size=2, cp_rank=1, cp_split="pack_zigzag"))
        [(4, 12)]
        >>> local_ranges(10, RankCoords(sp_size=4, sp_rank=3, sp_split="pad_to_multiple"))
        [(9, 12)]
    """
    length = pack if isinstance(pack, int) else pack.length
    cp, sp = coords.cp_size, coords.sp_size
    if coords.cp_split == "per_sequence" and cp > 1:
        if isinstance(pack, int):
            raise MisuseError(
                "per-sequence CP needs the pack's sequences, not only its length",
                where=f"cp_size={cp}",
                hint="Pass the Pack to local_ranges.",
            )
        cp_local = _per_sequence_chunks(pack, coords)
    else:
        cp_local = _whole_pack_chunks(length, coords)
    local = sum(stop - start for start, stop in cp_local)
    if local % sp and coords.sp_split == "pad_to_multiple":
        # SP without CP (RankCoords refuses CP here): the stream is the pack itself, so
        # stream positions are pack positions, the padded ones past its end.
        part = -(-local // sp)
        return [(coords.sp_rank * part, (coords.sp_rank + 1) * part)]
    if local % sp:
        raise MisuseError(
            "the CP-local tokens do not split evenly over the SP ranks",
            expected=f"a multiple of {sp} tokens per CP rank",
            found=f"{local} tokens (pack of {length})",
            where=f"cp_size={cp} ({coords.cp_split}), sp_size={sp}",
            hint="Choose pack_max_length as a multiple of 2 * cp_size * sp_size, or "
            "zero-pad each pack as XTuner does (RankCoords(sp_split='pad_to_multiple')).",
        )
    part = local // sp
    return _slice_stream(cp_local, coords.sp_rank * part, (coords.sp_rank + 1) * part)


def _whole_pack_chunks(length: int, coords: RankCoords) -> list[tuple[int, int]]:
    cp = coords.cp_size
    chunks = 2 * cp if coords.cp_split == "pack_zigzag" else cp
    if length % chunks:
        raise MisuseError(
            "pack length does not split evenly over the CP ranks",
            expected=f"a multiple of {chunks}",
            found=length,
            where=f"cp_size={cp} ({coords.cp_split}), sp_size={coords.sp_size}",
            hint="Choose pack_max_length as a multiple of 2 * cp_size * sp_size.",
        )
    size = length // chunks
    out = [(coords.cp_rank * size, (coords.cp_rank + 1) * size)]
    if coords.cp_split == "pack_zigzag":
        mirror = 2 * cp - 1 - coords.cp_rank
        out.append((mirror * size, (mirror + 1) * size))
    return out


def _per_sequence_chunks(pack: Pack, coords: RankCoords) -> list[tuple[int, int]]:
    cp, rank = coords.cp_size, coords.cp_rank
    mirror = 2 * cp - 1 - rank
    out: list[tuple[int, int]] = []
    end = 0
    for sample in pack.samples:
        if sample.offset != end or sample.positions % (2 * cp):
            raise MisuseError(
                "per-sequence CP needs back-to-back sequences padded to a multiple of 2 * cp",
                expected=f"offset {end}, span a multiple of {2 * cp}",
                found=f"offset {sample.offset}, span {sample.positions}",
                where=f"sample {sample.sample_id}",
                hint="Pack with pack_samples(..., seq_align=seq_alignment(cp_size=..., "
                "sp_size=...)).",
            )
        size = sample.positions // (2 * cp)
        if size:
            out.append((sample.offset + rank * size, sample.offset + (rank + 1) * size))
            out.append((sample.offset + mirror * size, sample.offset + (mirror + 1) * size))
        end = sample.end
    tail = pack.length - end
    if tail % cp:
        raise MisuseError(
            "the pack's padding tail does not split evenly over the CP ranks",
            expected=f"a multiple of {cp} positions after the last sequence",
            found=tail,
            hint="Choose pack_max_length as a multiple of 2 * cp_size * sp_size.",
        )
    if tail:
        share = tail // cp
        out.append((end + rank * share, end + (rank + 1) * share))
    return out


def _slice_stream(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of the stream the ranges form, as merged pack ranges."""
    out: list[tuple[int, int]] = []
    base = 0  # stream coordinate of the current range's first position
    for start, stop in ranges:
        a, b = max(lo, base), min(hi, base + stop - start)
        if a < b:
            first, last = start + a - base, start + b - base
            if out and out[-1][1] == first:
                out[-1] = (out[-1][0], last)
            else:
                out.append((first, last))
        base += stop - start
    return out


def local_tokens(pack: Pack | int, coords: RankCoords) -> int:
    """Positions of one pack a rank holds (the same on every rank)."""
    return sum(stop - start for start, stop in local_ranges(pack, coords))


def pack_samples(
    samples: Iterable[tuple[str, Handle, int]],
    pack_max_length: int,
    packs_per_micro_batch: int = 1,
    *,
    dp_size: int = 1,
    spec: RouteSpec | None = None,
    seq_align: int = 1,
    feeds_last_token: bool = False,
    pack_multiple: int | None = None,
) -> PackingPlan:
    """Greedy in-order packing of ``(sample_id, handle, tokens)`` samples.

    A sample's sequence takes ``tokens - 1`` positions (``tokens`` if the trainer feeds the
    last token too, which then gets a padding row), rounded up to a multiple of
    ``seq_align`` (``seq_alignment(...)`` for Megatron-style THD packs). It goes to the
    current pack if it fits, else it opens a new pack. Consecutive packs form micro-batches
    of ``packs_per_micro_batch`` (the last may be shorter), dealt round-robin over
    ``dp_size`` data-parallel ranks. Row counts are checked here, before anything is read.
    ``spec`` defaults to the first sample's. Every pack is ``pack_max_length`` long, unless
    ``pack_multiple`` is given: then a pack ends at its last sequence rounded up to that
    multiple, as trainers that build each micro-batch to fit size it (verl: the sum of the
    padded sequences, ``pack_multiple=seq_align``; slime: ``cp * tp * 128``).

    Example:
        >>> plan = pack_samples(samples, 4096, seq_align=seq_alignment(cp_size=2, sp_size=2))
    """
    multiple = pack_multiple or 1
    if min(pack_max_length, packs_per_micro_batch, dp_size, seq_align, multiple) < 1:
        raise MisuseError(
            "pack_max_length, packs_per_micro_batch, dp_size, seq_align and pack_multiple "
            "must be positive",
            found=(pack_max_length, packs_per_micro_batch, dp_size, seq_align, pack_multiple),
        )
    packs: list[tuple[PackedSample, ...]] = []
    current: list[PackedSample] = []
    used = 0
    for sample_id, handle, tokens in samples:
        spec = handle.spec if spec is None else spec
        fed = tokens if feeds_last_token else tokens - 1
        span = -(-fed // seq_align) * seq_align
        if span > pack_max_length:
            raise MisuseError(
                "sample is longer than a pack",
                expected=f"at most {pack_max_length} positions",
                found=f"{span} positions ({tokens} tokens, aligned to {seq_align})",
                where=f"sample {sample_id}",
                hint="Raise pack_max_length or truncate the sample before packing.",
            )
        if used + span > pack_max_length:
            packs.append(tuple(current))
            current, used = [], 0
        current.append(
            PackedSample(
                sample_id=sample_id,
                handle=handle,
                tokens=tokens,
                offset=used,
                span=None if span == tokens - 1 else span,
            )
        )
        used += span
    if current:
        packs.append(tuple(current))
    if spec is None:
        raise MisuseError("nothing to pack", hint="Pass at least one sample, or a spec.")
    groups = _chunks(range(len(packs)), packs_per_micro_batch)

    def length(samples: tuple[PackedSample, ...]) -> int:
        if pack_multiple is None:
            return pack_max_length
        end = samples[-1].end if samples else 0
        return max(-(-end // multiple) * multiple, multiple)

    return PackingPlan(
        spec=spec,
        packs=tuple(Pack(samples=p, length=length(p)) for p in packs),
        micro_batches=groups,
        dp_ranks=tuple(i % dp_size for i in range(len(groups))),
    )


def _place(index: int, entries: Iterable[PackItem]) -> tuple[PackedSample, ...]:
    """A trainer's pack entries as packed samples, tuples back to back from position 0."""
    out: list[PackedSample] = []
    for entry in entries:
        if isinstance(entry, PackedSample):
            out.append(entry)
            continue
        end = out[-1].end if out else 0
        if len(entry) == 3:
            sample_id, handle, tokens = entry
            out.append(PackedSample(sample_id=sample_id, handle=handle, tokens=tokens, offset=end))
            continue
        sample_id, handle, tokens, (start, stop) = entry
        # The whole sample's rows first (the rollout's contract), then the range in them.
        PackedSample(sample_id=sample_id, handle=handle, tokens=tokens, offset=0)
        if not 0 <= start < stop <= tokens - 1:
            raise MisuseError(
                "a packed row range must lie inside the sample's routing rows",
                expected=f"0 <= start < stop <= {tokens - 1}",
                found=(start, stop),
                where=f"sample {sample_id} (pack {index})",
            )
        out.append(
            PackedSample(
                sample_id=sample_id,
                handle=handle.slice(start, stop),
                tokens=stop - start + 1,
                offset=end,
            )
        )
    return tuple(out)


def _chunks(items: Sequence[int], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(items[i : i + size]) for i in range(0, len(items), size))
