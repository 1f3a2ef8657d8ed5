"""The materializer: one trainer rank's routing, one micro-batch at a time.

Given a step's ``PackingPlan``, the rank's ``RankCoords`` and the leases of its samples,
it yields, per micro-batch, the ``[local_tokens, L, K]`` canonical array aligned with the
rank's input ids (packs in micro-batch order, each sliced by ``local_ranges``) and the mask
of real rows. Padding rows hold distinct ids (``arange(K) % E``), never zeros, so a
dispatcher never sees an expert twice in one top-k row.

How the bytes move (what this module owns):
- **Only the rank's rows are read, copied once.** For each micro-batch the rank's rows are
  described as one handle: the slices of sample handles its ranges cover, with padding
  runs from a zero-stride inline source in between. A single ``read_many`` of that handle
  fetches only the store blocks those slices touch and copies them straight into the
  micro-batch array: no whole sample, no whole pack, no second assembly copy.
- **Blocks fetched a window at a time.** After the first micro-batch (read alone: the
  trainer's first waits for nothing else), the thread fetches the stored blocks of its
  next micro-batches (up to 32 of them, 64 MiB of blocks) in one call and copies each
  micro-batch out of them as its slot frees (``routeplay.train.read_ahead``): the views
  pin node memory, not the process's, and go before the window's last micro-batch is
  handed out. A window whose fetch fails is read micro-batch by micro-batch, so an error
  surfaces at the micro-batch it concerns.
- **Bounded memory.** A background thread reads ahead ``prefetch`` micro-batches; a
  semaphore of ``prefetch + 1`` slots (one for the micro-batch the consumer holds) stops
  it from reading further, so resident routing bytes never exceed ``(prefetch + 1)``
  micro-batch shards, however many samples the step has. ``stats()`` tracks the peak.
- **Output memory is reused.** Each micro-batch is copied into a buffer recycled from an
  earlier one (pages already faulted in copy at memcpy speed; fresh allocations at about
  a fifth of it: 0.88 ms against 0.16 ms for a 3 MiB micro-batch). A buffer is recycled
  only when nothing outside the materializer still refers to it, so a consumer that
  keeps a micro-batch's array never sees it overwritten.
  A closed materializer leaves its free buffers (``prefetch + 2`` at most) to the next
  one of the same row shape in the process: the next step's reads start on warm pages.
- **Leases end as soon as they can.** A micro-batch is consumed when the consumer asks
  for the next one (or closes); then the leases of samples that appear in no later
  micro-batch of this rank are released. ``close()`` (also on exceptions, via ``with``)
  stops the thread and releases every lease left; it is idempotent.

Several passes over one step (XTuner's old log-probs, reference and update passes; R2's
record then replay): ``passes=N`` reads every micro-batch of the rank ``N`` times, pass
after pass, each read copied fresh from the store, so memory stays at ``(prefetch + 1)``
micro-batch shards per pass, never the whole step. The leases are held through every
pass and each ends once, when the last pass moves past that sample's last micro-batch
(or at ``close()``, also on exceptions). ``next_pass()`` hands out one pass at a time::

    with Materializer(store, plan, coords, leases=leases, passes=3) as m:
        old = [old_logprobs(mb) for mb in m.next_pass()]
        ref = [ref_logprobs(mb) for mb in m.next_pass()]
        for mb in m.next_pass():
            update(mb)

Iterating the materializer itself yields every pass in a row (``item.pass_index`` tells
them apart). The alternative, one materializer per pass with the step's own leases kept
outside (a leaseless materializer reads without ending anything), works too; then the
caller ends the step's leases after the last pass.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey, Handle, InlineSource, Segment, StoreRef
from routeplay.core.layers import LayerSubset
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError
from routeplay.rollout.releasing import attach_notes, attempt_each
from routeplay.train.packing import Pack, PackedSample, PackingPlan, RankCoords, local_ranges
from routeplay.train.read_ahead import PlannedRead, hold_window, windows

if TYPE_CHECKING:  # the store package imports Ray; a trainer process may run without it
    from routeplay.store.client.lease import Lease

__all__ = [
    "LeasingReader",
    "Materializer",
    "MaterializerStats",
    "MicroBatchRoutes",
    "RowReader",
    "padding_rows",
    "share_handle",
]


class RowReader(Protocol):
    """What the materializer needs from a store: ``RouteStore.read_many``."""

    def read_many(
        self,
        requests: Sequence[tuple[Handle, int, int]],
        *,
        holder: str = "",
        out: Sequence[npt.NDArray[Any]] | None = None,
        layers: LayerSubset | None = None,
    ) -> list[npt.NDArray[Any]]: ...


class LeasingReader(RowReader, Protocol):
    """What ``Materializer.leasing`` needs: ``RouteStore.read_many`` and ``acquire_many``."""

    def acquire_many(self, items: Sequence[tuple[Handle, str]]) -> list[Lease]: ...

    def pull(self, leases: Sequence[Lease]) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MicroBatchRoutes:
    """One micro-batch of one rank: routing rows aligned with the rank's input ids."""

    index: int
    """Index of the micro-batch in the plan."""
    packs: tuple[int, ...]
    """Pack indices it holds, in the order their rows are laid out."""
    routes: npt.NDArray[np.unsignedinteger]
    """``[local_tokens, L, K]`` expert ids in the canonical dtype."""
    mask: npt.NDArray[np.bool_]
    """``[local_tokens]``: True where a row is a sample's routing, False on padding."""
    pass_index: int = 0
    """Pass over the step this read belongs to (``Materializer(passes=...)``)."""
    layers: tuple[int, ...] | None = None
    """MoE layers of ``routes``' columns, in order (``Materializer(layers=...)``: a
    pipeline stage's); None when every MoE layer is there."""

    @property
    def nbytes(self) -> int:
        """Bytes held (routes and mask)."""
        return int(self.routes.nbytes + self.mask.nbytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class MaterializerStats:
    """A snapshot of one materializer's reads, memory and leases."""

    micro_batches: int
    """Micro-batches this rank trains in the step (per pass)."""
    passes: int
    """Passes over the step (each reads every micro-batch once)."""
    micro_batches_done: int
    """Micro-batches consumed so far, summed over passes."""
    reads: int
    """``read_many`` calls made (one per micro-batch read, per pass)."""
    bytes_read: int
    """Sample routing bytes copied out of the store (padding excluded)."""
    block_bytes: int
    """Bytes of the stored blocks those reads touched (what the store ships to this rank)."""
    bytes_out: int
    """Bytes of the micro-batch arrays produced (routes and mask, padding included)."""
    resident_bytes: int
    """Routing bytes held now: read ahead, or handed out and not yet consumed."""
    peak_resident_bytes: int
    """Largest ``resident_bytes`` seen."""
    leases_released: int
    """Leases released so far (sample leases, and the share lease of ``leasing``)."""
    leases_held: int
    """Leases still held (sample leases, and the share lease of ``leasing``)."""


def padding_rows(spec: RouteSpec, rows: int) -> npt.NDArray[np.unsignedinteger]:
    """``rows`` padding rows: ids ``arange(K) % E`` in every layer (distinct in each row).

    A zero-stride read-only view: it costs one row of memory whatever ``rows`` is.
    """
    row = (np.arange(spec.top_k) % spec.num_experts).astype(spec.dtype)
    return np.broadcast_to(row, (rows, *spec.row_shape))


# Free output buffers left by closed materializers, by (dtype, row shape). A trainer
# makes one materializer per step, and a fresh buffer's first copy faults in every page
# (measured: 0.7 ms for a 3 MiB micro-batch, four times the copy itself), so a small
# step's few micro-batches would all pay it.
_SPARE: dict[tuple[Any, tuple[int, ...]], list[npt.NDArray[Any]]] = {}
_SPARE_LOCK = threading.Lock()


def _refcount(free: list[npt.NDArray[Any]], position: int) -> int:
    """``sys.getrefcount`` of the buffer at ``position`` of a free list."""
    buffer = free[position]
    return sys.getrefcount(buffer)


# The count of a buffer that only its free list refers to, measured by the same code
# (the list, the local name, the call's argument: 3 on CPython 3.11; an interpreter that
# borrows some of these references counts fewer). More: a consumer still holds a view.
_OURS = _refcount([np.empty(0)], 0)


class _Buffers:
    """Output arrays recycled across micro-batches and across the materializers of one
    process (see the module docstring)."""

    def __init__(self, spec: RouteSpec, keep: int, layers: LayerSubset | None) -> None:
        self._dtype = spec.dtype
        self._row_shape = spec.row_shape if layers is None else (len(layers.layers), spec.top_k)
        self._key = (np.dtype(self._dtype), tuple(self._row_shape))
        self._keep = keep
        self._lock = threading.Lock()
        with _SPARE_LOCK:
            self._free: list[npt.NDArray[Any]] = _SPARE.pop(self._key, [])[-keep:]

    def take(self, rows: int) -> npt.NDArray[Any]:
        """A ``[rows, L, K]`` view of a recycled buffer (L: the layers read), or a new one."""
        with self._lock:
            for position in range(len(self._free)):
                if (
                    self._free[position].shape[0] >= rows
                    and _refcount(self._free, position) <= _OURS
                ):
                    return self._free.pop(position)[:rows]
        return np.empty((rows, *self._row_shape), self._dtype)[:rows]

    def give(self, routes: npt.NDArray[Any]) -> None:
        """Return a micro-batch's array once the consumer has moved past it."""
        base = routes.base if isinstance(routes.base, np.ndarray) else routes
        with self._lock:
            self._free.append(base)
            del self._free[: -self._keep]

    def clear(self) -> None:
        """Hand the free buffers to the process's next materializer of this row shape (at
        most ``keep`` of them: a materializer's own bound). The last micro-batch's may
        still be in the consumer's hands (``for mb in m`` keeps ``mb`` past the loop):
        ``take`` checks each buffer again before reusing it."""
        with self._lock:
            free, self._free = self._free, []
        with _SPARE_LOCK:
            spare = _SPARE.setdefault(self._key, [])
            spare.extend(free)
            del spare[: -self._keep]


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


_DONE = object()


class Materializer:
    """Iterates one rank's micro-batches of routing; a context manager.

    ``leases`` maps sample ids to the leases this rank holds on them; the materializer
    takes them over at the call and releases each once the last micro-batch holding that
    sample is consumed. A constructor that refuses (a bad order, a plan this rank cannot
    lay out, an engine key, a stray lease) releases every lease it was given before it
    raises: the caller never gets an object to release them through, and ``with`` cannot
    help. ``order`` lists the micro-batch indices in the order the trainer consumes
    them (default: the plan's micro-batches of ``coords.dp_rank``, in plan order).
    ``passes`` is how many times the trainer goes over them, in that order each time
    (see the module docstring): leases end after the last pass. ``release_each=False``
    ends them all at once after the last micro-batch (one call per shard), for leases
    whose rows another holder keeps anyway. ``share_lease`` is one lease over every
    payload the rank reads (``leasing`` takes it): held through the last micro-batch of
    the last pass, then ended (or at ``close()``, also on exceptions). ``layers`` (MoE
    layer indices, increasing) reads only those layers' columns: a pipeline stage's
    (``MegatronLayout.moe_layers(spec)``), so the rows a rank copies and holds scale with
    1/PP; each micro-batch's ``layers`` says which MoE layer each column is, and the
    replays map layers to columns by it.

    Example:
        >>> with Materializer(store, plan, coords, leases=leases, passes=2) as m:
        ...     for mb in m.next_pass():
        ...         old_logprobs(mb.routes)
        ...     for mb in m.next_pass():
        ...         update(mb.routes)
    """

    def __init__(
        self,
        store: RowReader,
        plan: PackingPlan,
        coords: RankCoords,
        *,
        leases: Mapping[str, Lease] | None = None,
        prefetch: int = 1,
        order: Sequence[int] | None = None,
        passes: int = 1,
        name: str = "",
        release_each: bool = True,
        layers: Sequence[int] | None = None,
        share_lease: Lease | None = None,
    ) -> None:
        # The leases are ours from this call on: a refusal below releases them (the
        # caller has no object left to release them through).
        self._leases: dict[str, Lease] = dict(leases or {})
        self._share_lease = share_lease
        self._release_each = release_each
        try:
            self._setup(
                store, plan, coords, prefetch=prefetch, order=order, passes=passes, name=name
            )
            self._setup_reads(layers)
        except BaseException as exc:
            self._release_refused(exc)
            raise

    @classmethod
    def leasing(
        cls,
        store: LeasingReader,
        plan: PackingPlan,
        coords: RankCoords,
        *,
        holder: str,
        prefetch: int = 1,
        order: Sequence[int] | None = None,
        passes: int = 1,
        name: str = "",
        layers: Sequence[int] | None = None,
    ) -> Materializer:
        """The way a trainer rank takes its leases: one lease (one call per store shard),
        under ``holder`` (e.g. ``train/step-3/dp2``), over every payload the samples of
        this rank's micro-batches read, handed to the materializer, which ends it once
        the rank's last micro-batch is consumed (or at ``close()``). One lease, not one
        per sample: the step's ``TrainingBatch`` holds the same rows until it closes, so
        ending them sample by sample would free nothing sooner, and a thousand grants
        cost the shard, the wire and the rank a thousand lease records for nothing. The
        grant carries the block references, so the reads make no shard call, and the
        rank's blocks start crossing at once, as one bundle (``RouteStore.pull``: they
        land in the node's object store, not in the process). ``plan`` may be the whole
        step's or the rank's share (``PackingPlan.share``: what a driver best sends each
        rank, its own samples only).

        Example:
            >>> with Materializer.leasing(store, plan, coords, holder="train/step-3/dp0") as m:
            ...     for mb in m:
            ...         train(mb.routes)
        """
        handles = [
            sample.handle
            for index in plan.schedule(coords.dp_rank)
            for sample in plan.samples_of(index)
        ]
        [lease] = store.acquire_many([(share_handle(plan.spec, handles), holder)])
        try:
            store.pull([lease])  # the rank's share crosses as one bundle, from now on
        except BaseException:
            lease.release()  # nobody else holds it yet
            raise
        return cls(
            store,
            plan,
            coords,
            prefetch=prefetch,
            order=order,
            passes=passes,
            name=name,
            layers=layers,
            share_lease=lease,
        )

    def _setup(
        self,
        store: RowReader,
        plan: PackingPlan,
        coords: RankCoords,
        *,
        prefetch: int,
        order: Sequence[int] | None,
        passes: int,
        name: str,
    ) -> None:
        if prefetch < 0:
            raise MisuseError("prefetch must be non-negative", found=prefetch)
        if passes < 1:
            raise MisuseError("passes must be at least 1", found=passes)
        self._store = store
        self._plan = plan
        self._coords = coords
        self._prefetch = prefetch
        self.name = name or f"materializer {coords.describe()}"
        self._order = self._check_order(order)
        self._passes = passes
        # Every read the rank makes, in consumption order: (pass, micro-batch).
        self._stream = tuple((p, mb) for p in range(passes) for mb in self._order)
        self._passes_begun = 0
        # This rank's positions of each pack it reads, computed (and checked) before any
        # read; other ranks' packs are theirs to check (a rank may get only its share).
        self._ranges = {
            index: local_ranges(plan.packs[index], coords)
            for mb in self._order
            for index in plan.micro_batches[mb]
        }
        self._check_sources()
        self._release_after = self._lease_schedule()
        # The longest padding run is one range (SP zero-padding may run past a pack's end).
        longest = max((b - a for ranges in self._ranges.values() for a, b in ranges), default=0)
        self._padding = InlineSource(array=padding_rows(plan.spec, longest))
        # The local store backend is plain Python without locks: this rank's reads (the
        # prefetch thread) and releases (the consumer) never touch it at the same time.
        self._store_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._slots = threading.Semaphore(prefetch + 1)
        self._ready: queue.Queue[object] = queue.Queue()  # bounded by the slots
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._closed = False
        self._position = 0  # items handed out so far
        self._current: MicroBatchRoutes | None = None
        self._counts = {
            "done": 0,
            "reads": 0,
            "bytes_read": 0,
            "block_bytes": 0,
            "bytes_out": 0,
            "resident": 0,
            "peak": 0,
            "released": 0,
        }

    def _setup_reads(self, layers: Sequence[int] | None) -> None:
        spec = self._plan.spec
        self._layers = None if layers is None else LayerSubset.of(layers, spec)
        # Bytes of one row as read: a stage reading its layers copies and holds only those.
        read = spec.num_layers if self._layers is None else len(self._layers.layers)
        self._row_bytes = spec.row_nbytes * read // spec.num_layers
        self._buffers = _Buffers(spec, keep=self._prefetch + 2, layers=self._layers)

    def _release_refused(self, refusal: BaseException) -> None:
        """The constructor refused: release every lease it was given (all attempted);
        a failed release is named in a note on the refusal, never raised over it."""
        held = [*self._leases.values(), *filter(None, [self._share_lease])]
        failures = attempt_each(held, lambda lease: lease.release())
        self._leases.clear()
        self._share_lease = None
        attach_notes(refusal, [exc for _, exc in failures], "releasing a refused rank's leases")

    # -- checks (all before any read) -------------------------------------------------
    def _check_order(self, order: Sequence[int] | None) -> tuple[int, ...]:
        mine = self._plan.schedule(self._coords.dp_rank)
        if order is None:
            return mine
        chosen = tuple(order)
        if sorted(chosen) != sorted(mine):
            raise MisuseError(
                "order must list each micro-batch of this DP rank exactly once",
                expected=sorted(mine),
                found=chosen,
                where=self.name,
            )
        return chosen

    def _check_sources(self) -> None:
        # Each segment's source as it is, not ``Handle.sources`` (distinct, so hashed): the
        # rank's set-up for a share of 1,024 samples took 2.2 ms with it, 1.2 without.
        for mb in self._order:
            for sample in self._plan.samples_of(mb):
                if any(isinstance(seg.source, EngineKey) for seg in sample.handle.segments):
                    raise MisuseError(
                        "sample routing is still an engine key (single-use)",
                        where=f"sample {sample.sample_id}",
                        hint="Adopt engine keys into the route store (RouteStore.adopt_key) "
                        "before training: several ranks read slices of the same sample.",
                    )

    def _lease_schedule(self) -> dict[int, list[str]]:
        """Position in the read stream after whose consumption each leased sample is
        released: its last micro-batch of the last pass."""
        last: dict[str, int] = {}
        for position, (_, mb) in enumerate(self._stream):
            for sample in self._plan.samples_of(mb):
                last[sample.sample_id] = position
        stray = sorted(set(self._leases) - set(last))
        if stray:
            raise MisuseError(
                "leases given for samples this rank never reads",
                found=stray[:5],
                where=self.name,
                hint="Pass only the leases of this rank's micro-batches.",
            )
        after: dict[int, list[str]] = {}
        for sample_id in self._leases:
            when = last[sample_id] if self._release_each else len(self._stream) - 1
            after.setdefault(when, []).append(sample_id)
        return after

    # -- building one micro-batch --------------------------------------------------------
    def _rows_handle(self, packs: Sequence[int]) -> tuple[Handle, npt.NDArray[np.bool_], int]:
        """The rank's rows of a micro-batch as one handle, their mask, and the sample rows."""
        spec = self._plan.spec
        segments: list[Segment] = []
        spans: list[tuple[int, int]] = []  # output rows that are real
        out = 0

        def pad(rows: int) -> None:
            segments.append(Segment(source=self._padding, start=0, stop=rows, spec=spec))

        for index in packs:
            pack = self._plan.packs[index]
            for start, stop in self._ranges[index]:
                position = start
                for sample in _overlapping(pack, start, stop):
                    lo, hi = max(start, sample.offset), min(stop, sample.stop)
                    if lo > position:
                        pad(lo - position)
                    rows = sample.handle.spans(lo - sample.offset, hi - sample.offset)
                    segments.extend(seg for seg, _ in rows)
                    spans.append((out + lo - start, out + hi - start))
                    position = hi
                if position < stop:
                    pad(stop - position)
                out += stop - start
        mask = np.zeros(out, dtype=np.bool_)
        for lo, hi in spans:
            mask[lo:hi] = True
        return Handle(spec, segments), mask, sum(hi - lo for lo, hi in spans)

    def _plan_read(self, position: int) -> PlannedRead:
        pass_index, mb = self._stream[position]
        handle, mask, real_rows = self._rows_handle(self._plan.micro_batches[mb])
        return PlannedRead(
            position=position,
            pass_index=pass_index,
            mb=mb,
            handle=handle,
            mask=mask,
            real_rows=real_rows,
            block_bytes=_block_bytes(handle, self._plan.spec),
        )

    def _build(self, read: PlannedRead, held: object = None) -> MicroBatchRoutes:
        handle = read.handle
        buffer = self._buffers.take(handle.rows)
        # A reader that knows nothing of layer subsets (or of held blocks) still serves
        # whole-row reads.
        options: dict[str, Any] = {} if self._layers is None else {"layers": self._layers}
        if held is not None:
            options["held"] = held
        with self._store_lock:
            [routes] = self._store.read_many(
                [(handle, 0, handle.rows)], holder=self.name, out=[buffer], **options
            )
        del buffer
        item = MicroBatchRoutes(
            index=read.mb,
            packs=self._plan.micro_batches[read.mb],
            routes=routes,
            mask=read.mask,
            pass_index=read.pass_index,
            layers=None if self._layers is None else self._layers.layers,
        )
        with self._stats_lock:
            c = self._counts
            c["reads"] += 1
            c["bytes_read"] += read.real_rows * self._row_bytes
            c["block_bytes"] += read.block_bytes
            c["bytes_out"] += item.nbytes
            c["resident"] += item.nbytes
            c["peak"] = max(c["peak"], c["resident"])
        return item

    # -- the prefetch thread -----------------------------------------------------------------
    def _produce(self) -> None:
        """Read the stream a window at a time (``routeplay.train.read_ahead``): its blocks
        held while each micro-batch is copied as a slot frees, and dropped before the
        window's last micro-batch is handed out (so before any lease that item's
        consumption ends)."""
        try:
            reads = (self._plan_read(position) for position in range(len(self._stream)))
            # A window ends where consuming a micro-batch ends leases: its views are gone
            # before that micro-batch is handed out.
            for window in windows(reads, ends_after=frozenset(self._release_after)):
                if self._stop.is_set():
                    return
                with self._store_lock:
                    holding = hold_window(self._store, window, self.name)
                with holding as held:
                    built = None
                    for read in window:
                        if built is not None:
                            self._ready.put(built)
                        self._slots.acquire()  # frees when the consumer moves past an item
                        if self._stop.is_set():
                            return
                        built = self._build(read, held)
                self._ready.put(built)
            self._ready.put(_DONE)
        except BaseException as exc:  # handed to the consumer, who re-raises it
            self._ready.put(_Failed(exc))

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        if self._prefetch > 0:
            self._thread = threading.Thread(
                target=self._produce, name=f"routeplay {self.name}", daemon=True
            )
            self._thread.start()

    def _next_ready(self) -> object:
        if self._thread is not None:
            return self._ready.get()
        if self._position >= len(self._stream):
            return _DONE
        try:
            return self._build(self._plan_read(self._position))
        except BaseException as exc:
            return _Failed(exc)

    # -- consuming ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[MicroBatchRoutes]:
        return self

    def __next__(self) -> MicroBatchRoutes:
        self._consume_current()
        if self._closed:
            raise StopIteration
        self._start()
        item = self._next_ready()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        assert isinstance(item, MicroBatchRoutes)
        self._current = item
        self._position += 1
        return item

    def next_pass(self) -> Iterator[MicroBatchRoutes]:
        """The next pass over this rank's micro-batches, in ``order``; the one before
        must be finished. Leases end as the last pass moves past their samples.

        Example:
            >>> for mb in m.next_pass():               # old log-probs
            ...     old.append(forward(mb.routes))
        """
        size = len(self._order)
        begun = self._passes_begun
        if begun >= self._passes:
            raise MisuseError(
                "every pass of this materializer was begun",
                expected=f"at most {self._passes} calls of next_pass()",
                where=self.name,
                hint="Pass passes= to the Materializer for as many passes as the step makes.",
            )
        if self._closed and size:
            raise MisuseError(
                "the materializer is closed",
                where=self.name,
                hint="A closed materializer (an exception, or close()) released its leases.",
            )
        if self._position != begun * size:
            unfinished = self._position < begun * size
            raise MisuseError(
                f"pass {begun - 1} is not finished"
                if unfinished
                else "micro-batches were read past the passes begun (next() mixed with "
                "next_pass())",
                expected=f"{begun * size} micro-batches consumed",
                found=self._position,
                where=self.name,
                hint="Consume every micro-batch of a pass before the next one, or close().",
            )
        self._passes_begun += 1
        return _Pass(self, stop=(begun + 1) * size)

    def _consume_current(self) -> None:
        """The consumer moved on: drop the item, free its slot, end finished leases."""
        if self._current is None:
            return
        item, self._current = self._current, None
        self._buffers.give(item.routes)
        with self._stats_lock:
            self._counts["resident"] -= item.nbytes
            self._counts["done"] += 1
        self._slots.release()
        self._release(self._release_after.pop(self._position - 1, []))
        if self._position == len(self._stream):
            self._end_share_lease()

    def _release(self, sample_ids: Sequence[str]) -> None:
        """End the leases of finished samples together: one call per store shard, sent
        without waiting (a failure surfaces at the store's next call)."""
        if not sample_ids:
            return
        leases = [self._leases.pop(sample_id) for sample_id in sample_ids]
        with self._store_lock:
            # Through the leases' own class: this module must not import the store at run
            # time (a trainer process may run without Ray).
            type(leases[0]).release_all(leases)
        with self._stats_lock:
            self._counts["released"] += len(leases)

    def _end_share_lease(self) -> None:
        """End the lease over the rank's whole share (``leasing``): sent, not waited for."""
        lease, self._share_lease = self._share_lease, None
        if lease is None:
            return
        with self._store_lock:
            type(lease).release_all([lease])
        with self._stats_lock:
            self._counts["released"] += 1

    def close(self) -> None:
        """Stop reading ahead, drop held rows, release every lease left (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._consume_current()  # the item in hand counts as consumed
        self._stop.set()
        self._slots.release()  # wake the thread if it waits for a slot; it then stops
        if self._thread is not None:
            self._thread.join()
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, MicroBatchRoutes):
                with self._stats_lock:
                    self._counts["resident"] -= item.nbytes
        self._buffers.clear()
        self._release(list(self._leases))
        self._end_share_lease()

    def __enter__(self) -> Materializer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stats(self) -> MaterializerStats:
        """A snapshot of reads, resident bytes and leases."""
        with self._stats_lock:
            c = dict(self._counts)
        return MaterializerStats(
            micro_batches=len(self._order),
            passes=self._passes,
            micro_batches_done=c["done"],
            reads=c["reads"],
            bytes_read=c["bytes_read"],
            block_bytes=c["block_bytes"],
            bytes_out=c["bytes_out"],
            resident_bytes=c["resident"],
            peak_resident_bytes=c["peak"],
            leases_released=c["released"],
            leases_held=len(self._leases) + (self._share_lease is not None),
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._position}/{len(self._stream)}"
        return f"Materializer({self.name}, {state})"


class _Pass:
    """One pass of a materializer: its items, then StopIteration at the pass's end."""

    def __init__(self, owner: Materializer, *, stop: int) -> None:
        self._owner = owner
        self._stop = stop  # stream position one past this pass's last item

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> MicroBatchRoutes:
        owner = self._owner
        if owner._position >= self._stop:
            # The consumer moved past the pass's last item: it counts as consumed now (its
            # slot frees, finished leases end), not when the next pass begins.
            owner._consume_current()
            if self._stop >= len(owner._stream):
                owner.close()
            raise StopIteration
        return next(owner)


def _overlapping(pack: Pack, start: int, stop: int) -> Iterator[PackedSample]:
    """Samples of a pack with rows on positions ``[start, stop)``, in order."""
    for sample in pack.samples:
        if sample.offset >= stop:
            return
        if sample.stop > start and sample.rows:
            yield sample


def share_handle(spec: RouteSpec, handles: Iterable[Handle]) -> Handle:
    """Every row of every stored payload ``handles`` read, one segment per payload:
    what one lease over a rank's whole share covers (a lease holds whole payloads).

    Example:
        [lease] = store.acquire_many([(share_handle(plan.spec, handles), "train/dp0")])
    """
    first: dict[str, Segment] = {}
    for handle in handles:
        for segment in handle.segments:
            if isinstance(segment.source, StoreRef):
                first.setdefault(segment.source.payload_id, segment)
    return Handle(
        spec,
        [
            Segment(
                source=seg.source,
                start=0,
                stop=seg.source.rows,
                spec=seg.spec,
                weight_version=seg.weight_version,
            )
            for seg in first.values()
        ],
    )


def _block_bytes(handle: Handle, spec: RouteSpec) -> int:
    """Bytes of the distinct stored blocks a read of the whole handle touches."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for seg in handle.segments:
        src = seg.source
        if not isinstance(src, StoreRef):
            continue
        for block in src.blocks(seg.start, seg.stop):
            if (src.payload_id, block) in seen:
                continue
            seen.add((src.payload_id, block))
            size = src.rows if src.block_rows <= 0 else src.block_rows
            total += spec.nbytes(min(size, src.rows - block * size))
    return total
