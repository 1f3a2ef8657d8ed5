"""Fill Megatron-Core's ``RouterReplay`` from routeplay routes, one router call at a time.

``MegatronReplay`` wraps the routers one rank holds (``find_megatron_routers``) for the
length of a training step. Inside ``with session.replay(routes, chunk=c):`` every forward
of model chunk ``c`` routes tokens to exactly the given experts (R3); inside
``with session.record(chunk=c) as rec:`` it records what the routers chose, and
``session.replay(rec, chunk=c)`` replays that in the update (R2).

How it drives Megatron (``megatron/core/transformer/moe/router_replay.py``): a forward
pre-hook on each ``TopKRouter`` sets that router's action and data just before it runs, and
a forward hook clears them right after:

- forward: ``REPLAY_FORWARD`` with ``target_topk_idx`` = this layer's ids, widened to
  int64 on the router's device at that moment (one layer at a time, never the whole
  payload), in the order the router sees tokens (the materializer's rows; with
  ``sp_scatter`` this TP rank's part of the CP-local rows; BSHD rows batch-major turned
  into Megatron's sequence-major flattening). Megatron gathers the router's live scores at
  those ids, so the gate keeps its gradient;
- backward recompute (activation checkpointing): ``REPLAY_BACKWARD`` with the ids of the
  forward being recomputed. Megatron pops them from ``replay_backward_list``; the session
  keeps a small marker per forward that may still be recomputed (a FIFO per router, so
  schedules with several micro-batches in flight stay aligned) and re-widens the layer when
  its recompute starts, so no int64 copy waits for the backward;
- record: ``RECORD``, then the chosen ids are taken out compactly (uint8, int32 past 256
  experts) and Megatron's copy is dropped.

Which forwards keep a marker (what really happens, not the config): every replayed or
recorded router forward of a block entered with grad enabled. A forward that runs under
``no_grad`` inside such a block is the first pass of a reentrant checkpoint (Megatron's
``CheckpointFunction``, i.e. ``recompute_granularity="full"`` and selective ``"moe"``;
``torch.utils.checkpoint(use_reentrant=True)``): its marker waits for the recompute. A
forward that runs with grad builds its graph; it is recomputed only inside a non-reentrant
``torch.utils.checkpoint``, and only in the backward pass that reaches it: that checkpoint
recomputes lazily, when the backward first unpacks a tensor the region saved, which may
come after the gradient reaches the router's output (when the output is the region's
output, or only ops that save nothing lie between). So the gradient reaching the output
schedules a check at the end of that backward pass: a marker still queued then was not
recomputed (``recompute_method="block"`` past ``recompute_num_layers``, ``"moe_act"``, no
recompute) and is dropped. A block entered under ``no_grad`` (old log-probs) keeps nothing.

Replay refuses what would misroute before the router runs: ids out of range or repeated
in a row (zero padding), wrong shapes, and a token count other than the router's input.
``close()`` (also on errors, via ``with``) removes the hooks and clears Megatron's global
replay state (every instance's indices and actions), which otherwise outlives the step.
Only one session may be open per process, since that state is process-global.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, TypeAlias

import torch

from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, ReplayNotApplied, RowCountMismatch
from routeplay.integrations.megatron.drift import MegatronDrift
from routeplay.integrations.megatron.layout import MegatronLayout
from routeplay.integrations.megatron.recording import Recording
from routeplay.integrations.megatron.routers import MegatronRouter, find_megatron_routers
from routeplay.train.drift import DRIFT_BY_DEFAULT, DriftMeter, RoutingDrift
from routeplay.train.materializer import MicroBatchRoutes
from routeplay.train.replay_core import ReplaySource, RoutesLike, check_ids_of, in_backward

__all__ = ["MegatronReplay", "MegatronReplayStats", "Recording"]


ReplayInput: TypeAlias = "RoutesLike | MicroBatchRoutes | Recording"
"""Routes ``[tokens, L, K]`` (numpy, tensor, ``Routes``, a micro-batch), a provider
``layer -> [tokens, K]``, or a ``Recording`` (R2)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronReplayStats:
    """What a session did so far (a snapshot)."""

    replayed: int
    """Router forwards that used replayed ids."""
    recomputes: int
    """Backward recomputes that replayed the ids of their forward."""
    recorded: int
    """Router forwards recorded."""
    pending: int
    """Forwards whose backward recompute is still to come."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Replaying:
    """An open ``replay`` block of one chunk."""

    source: ReplaySource | Recording
    """Where each layer's ids come from."""
    scatter: bool
    """Rows are the CP-local stream: keep this TP rank's part."""
    grad: bool
    """Grad mode at block entry: a block under ``no_grad`` is never recomputed."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Recording:
    """An open ``record`` block of one chunk."""

    recording: Recording
    """Receives each router's chosen ids."""
    grad: bool
    """Grad mode at block entry: a block under ``no_grad`` is never recomputed."""


@dataclass(slots=True, kw_only=True, eq=False)
class _Pending:
    """A forward whose recompute, if it comes, replays the same ids; widened only then."""

    mode: _Replaying | _Recording
    """The block the forward ran in (its source outlives the block until the recompute)."""
    seq: int
    """Sequence length the router saw."""
    batch: int
    """Batch size the router saw."""
    recorded: torch.Tensor | None = None
    """A recorded forward's compact ids (set once the router has chosen)."""


class MegatronReplay:
    """Routing replay for the Megatron-Core routers of one rank, for one step.

    ``model`` is the rank's model (or its list of model chunks with virtual pipeline
    stages), built with ``moe_enable_routing_replay=True``. ``layout`` (default: one rank)
    gives the TP rank for ``sp_scatter`` and, with ``num_layers``, checks that each chunk
    holds the layers it should. Recomputes in the backward (Megatron's full or selective
    ``"moe"`` recompute, ``torch.utils.checkpoint``) replay the ids of the forward they
    recompute, whatever the config says; ``recompute=False`` says no router is ever
    recomputed, so no forward keeps a marker (a recompute then raises). ``check_ids=False``
    skips the id checks (range, distinct) for routes already validated. ``drift`` (on by default,
    ``DRIFT_BY_DEFAULT``) measures the routing drift of every replayed forward: read it
    with ``session.drift()`` (see ``routeplay.integrations.megatron.drift``).

    Example:
        >>> with MegatronReplay(model_chunks, spec, layout=layout) as session:
        ...     for mb in materializer:              # this rank's rows, router order
        ...         with session.replay(mb, chunk=0):
        ...             loss = forward_step(model_chunks[0], batch)
        ...         loss.backward()                  # recompute replays the same experts
    """

    _open: ClassVar[MegatronReplay | None] = None
    _open_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        spec: RouteSpec,
        *,
        layout: MegatronLayout | None = None,
        recompute: bool = True,
        check_ids: bool = True,
        drift: bool = DRIFT_BY_DEFAULT,
    ) -> None:
        self.spec = spec
        self.layout = layout or MegatronLayout()
        self.routers = find_megatron_routers(model, spec, layout=layout)
        self._check_ids = check_ids
        self._recompute = recompute
        self._modes: dict[int, _Replaying | _Recording] = {}
        self._pending: dict[int, deque[_Pending]] = {id(r): deque() for r in self.routers}
        self._running: dict[int, _Pending] = {}  # marker of the forward a router is in
        self._trained: set[int] = set()  # routers replayed or recorded with grad at entry
        self._counts = {"replayed": 0, "recomputes": 0, "recorded": 0}
        self._verified: set[int] = set()  # routers seen using the replayed ids
        self._replayed_in: dict[int, int] = {}  # replayed router forwards per chunk
        self._checking: dict[int, torch.Tensor] = {}  # ids handed to a first replayed forward
        self._hooks: list[Any] = []
        self._drift: MegatronDrift | None = None
        self._closed = False
        with MegatronReplay._open_lock:
            if MegatronReplay._open is not None:
                raise MisuseError(
                    "another MegatronReplay session is open in this process",
                    hint="Megatron's replay state is process-global: close() the other first.",
                )
            MegatronReplay._open = self
        try:
            for router in self.routers:
                self._hooks.append(
                    router.module.register_forward_pre_hook(self._before(router), with_kwargs=True)
                )
                self._hooks.append(router.module.register_forward_hook(self._after(router)))
            # -- drift (issue 17): its own module, wrapping Megatron's RouterReplay --
            if drift:
                self._drift = MegatronDrift(self.routers, spec, self.layout)
        except BaseException:
            self.close()
            raise

    # -- what callers use ------------------------------------------------------------
    @contextmanager
    def replay(
        self,
        routes: ReplayInput,
        *,
        chunk: int = 0,
        sp_scatter: bool = False,
        mask: Any = None,
    ) -> Iterator[None]:
        """Replay ``routes`` in the forwards of model chunk ``chunk`` inside the block; a
        block in which none of the chunk's routers ran raises ``ReplayNotApplied`` as it
        ends (a replay that did not happen).

        Rows must be the tokens the chunk's routers see, in order: a micro-batch from a
        materializer built with ``layout.coords()``. With ``sp_scatter=True`` the rows are
        the CP-local stream and this TP rank takes its part (as Megatron scatters the
        sequence). Run the backward after the block or inside it; either way the recompute
        replays the forward's ids. Entered under ``torch.no_grad()`` (old log-probs), the
        block's forwards keep nothing for a recompute. ``mask`` (bool per row of ``routes``; a
        micro-batch's own by default) marks the real tokens the drift figures count.
        """
        mode = _Replaying(
            source=self._source(routes, chunk), scatter=sp_scatter, grad=torch.is_grad_enabled()
        )
        if sp_scatter and isinstance(mode.source, Recording):
            raise MisuseError(
                "a recording is already in router order: replay it without sp_scatter"
            )
        before = self._replayed_in.get(chunk, 0)
        with self._mode(chunk, mode), self._drift_block(chunk, routes, mask, sp_scatter):
            yield
        if self._replayed_in.get(chunk, 0) == before:  # a replay that did not happen
            raise ReplayNotApplied(
                "no router of the model chunk ran in this replay block",
                expected="the chunk's forward inside `with session.replay(...)`",
                found="no replayed router call",
                where=f"model chunk {chunk}",
                hint="Run the forward of model_chunks[chunk] inside the block (around the "
                "forward_step's model call), on the model the session was built with.",
            )

    @contextmanager
    def record(self, *, chunk: int = 0) -> Iterator[Recording]:
        """Record what model chunk ``chunk``'s routers choose in the block's forwards (R2)."""
        recording = Recording(self.spec)
        with self._mode(chunk, _Recording(recording=recording, grad=torch.is_grad_enabled())):
            yield recording

    def stats(self) -> MegatronReplayStats:
        """Replayed, recomputed and recorded router calls so far."""
        return MegatronReplayStats(
            replayed=self._counts["replayed"],
            recomputes=self._counts["recomputes"],
            recorded=self._counts["recorded"],
            pending=sum(len(q) for q in self._pending.values()),
        )

    # -- drift (issue 17) ---------------------------------------------------------------
    def drift(self) -> RoutingDrift:
        """This rank's routing drift so far (one device sync); ``drift_meter.reduce(group)``
        sums it over ranks. Raises ``MisuseError`` if the session was built with
        ``drift=False``."""
        return self.drift_meter.drift()

    @property
    def drift_meter(self) -> DriftMeter:
        """The session's ``DriftMeter`` (e.g. for ``logprobs(...)`` or ``reduce(group)``)."""
        if self._drift is None:
            raise MisuseError(
                "this session does not measure drift",
                hint="Build MegatronReplay with drift=True.",
            )
        return self._drift.meter

    def _drift_block(
        self, chunk: int, routes: ReplayInput, mask: Any, scatter: bool
    ) -> AbstractContextManager[None]:
        if self._drift is None:
            if mask is not None:
                raise MisuseError("a drift mask was given to a session that does not measure drift")
            return nullcontext()
        return self._drift.block(chunk=chunk, routes=routes, mask=mask, scatter=scatter)

    # -- end of drift ------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks and clear Megatron's global replay state (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._drift is not None:
                self._drift.close()
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            for queue in self._pending.values():
                queue.clear()
            self._running.clear()
            self._modes.clear()
            self._checking.clear()
            # Every RouterReplay class in use (megatron-core's, verl's patched one) keeps
            # its own registry of instances: clear each.
            for cls in {type(router.replay) for router in self.routers}:
                cls.clear_global_indices()
                cls.clear_global_router_replay_action()
        finally:
            with MegatronReplay._open_lock:
                if MegatronReplay._open is self:
                    MegatronReplay._open = None

    def __enter__(self) -> MegatronReplay:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- blocks ------------------------------------------------------------------------------
    @contextmanager
    def _mode(self, chunk: int, mode: _Replaying | _Recording) -> Iterator[None]:
        if self._closed:
            raise MisuseError("the MegatronReplay session is closed")
        if not any(r.chunk == chunk for r in self.routers):
            raise MisuseError(
                "this rank holds no router in that model chunk",
                expected=sorted({r.chunk for r in self.routers}),
                found=chunk,
            )
        if chunk in self._modes:
            raise MisuseError(
                "a replay or record block is already open for this chunk", found=chunk
            )
        marks = {key: len(queue) for key, queue in self._pending.items()}
        self._modes[chunk] = mode
        try:
            yield
        except BaseException:
            # A failed forward is never recomputed: forget the markers it left.
            for key, queue in self._pending.items():
                while len(queue) > marks[key] and queue[-1].mode is mode:
                    queue.pop()
            raise
        finally:
            del self._modes[chunk]

    def _source(self, routes: ReplayInput, chunk: int) -> ReplaySource | Recording:
        if isinstance(routes, Recording):
            missing = [
                r.moe_layer
                for r in self.routers
                if r.chunk == chunk and r.moe_layer not in routes.layers
            ]
            if missing:
                raise MisuseError(
                    "the recording lacks layers this chunk replays",
                    found=missing,
                    hint="Record the same model chunk you replay.",
                )
            return routes
        data = routes.routes if isinstance(routes, MicroBatchRoutes) else routes
        if callable(data) or isinstance(data, Routes):
            return ReplaySource(data, self.spec, check_ids=self._check_ids)
        layers = routes.layers if isinstance(routes, MicroBatchRoutes) else None
        source = ReplaySource(data, self.spec, check_ids=False, layers=layers)  # shape, dtype
        # Every router of the chunk must find its layer before any of them runs.
        columns = [source.column(r.moe_layer) for r in self.routers if r.chunk == chunk]
        if self._check_ids:
            check_ids_of(_owned_columns(data, columns), self.spec)
        return source

    # -- hooks -------------------------------------------------------------------------------
    def _before(self, router: MegatronRouter) -> Any:
        replay, queue, actions = router.replay, self._pending[id(router)], router.actions

        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["input"]
            seq, batch = int(hidden.shape[0]), int(hidden.shape[1]) if hidden.dim() == 3 else 1
            device = _device_of(module)
            if in_backward():
                self._recompute_starts(router, seq, batch, device)
                return
            mode = self._modes.get(router.chunk)
            if isinstance(mode, _Replaying):
                ids = self._ids(router, mode, seq, batch, device)
                replay.target_topk_idx = ids
                _set_if_present(replay, "target_replay_mask", None)  # verl's: every row
                replay.set_router_replay_action(actions.REPLAY_FORWARD)
                if id(router) not in self._verified:
                    self._checking[id(router)] = ids
            elif isinstance(mode, _Recording):
                replay.set_router_replay_action(actions.RECORD)
            else:
                replay.clear_router_replay_action()
                return
            if mode.grad:  # a training forward: it may be recomputed
                self._trained.add(id(router))
                if self._recompute:
                    pending = _Pending(mode=mode, seq=seq, batch=batch)
                    queue.append(pending)
                    self._running[id(router)] = pending

        return hook

    def _recompute_starts(
        self, router: MegatronRouter, seq: int, batch: int, device: torch.device
    ) -> None:
        """A backward recompute of ``router``: hand it the ids of the oldest kept forward."""
        replay, queue = router.replay, self._pending[id(router)]
        if not queue:
            if id(router) not in self._trained:  # a native forward: so is its recompute
                replay.clear_router_replay_action()
                return
            raise MisuseError(
                "a router is recomputed in the backward but no forward of it is waiting "
                "for its recompute",
                where=router.name,
                hint="MegatronReplay was built with recompute=False: drop it."
                if not self._recompute
                else "Keep the session open from the step's first forward to its last "
                "backward (around the whole forward_backward_func call), replay every "
                "training forward with grad enabled, and run each backward once.",
            )
        pending = queue.popleft()
        if (pending.seq, pending.batch) != (seq, batch):
            raise RowCountMismatch(
                "a recompute sees other tokens than the forward it would replay",
                expected=f"[{pending.seq}, {pending.batch}] (seq, batch)",
                found=f"[{seq}, {batch}]",
                where=f"MoE layer {router.moe_layer} ({router.name})",
                hint="Run the backwards of a router's forwards in the order of the forwards.",
            )
        if isinstance(pending.mode, _Replaying):
            ids = self._ids(router, pending.mode, seq, batch, device)
        else:
            assert pending.recorded is not None  # set when the recorded forward ended
            ids = pending.recorded.to(device=device, dtype=torch.int64)
        replay.replay_backward_list = [ids]
        _set_if_present(replay, "replay_backward_mask_list", [None])  # verl pops one per ids
        replay.set_router_replay_action(router.actions.REPLAY_BACKWARD)
        self._counts["recomputes"] += 1

    def _after(self, router: MegatronRouter) -> Any:
        replay, queue = router.replay, self._pending[id(router)]

        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            backward = in_backward()
            mode = None if backward else self._modes.get(router.chunk)
            pending = None if backward else self._running.pop(id(router), None)
            if isinstance(mode, _Recording) and replay.recorded_topk_idx is not None:
                ids = mode.recording._add(router.moe_layer, replay.recorded_topk_idx)
                if pending is not None:
                    pending.recorded = ids
                self._counts["recorded"] += 1
            elif isinstance(mode, _Replaying):
                self._counts["replayed"] += 1
                self._replayed_in[router.chunk] = self._replayed_in.get(router.chunk, 0) + 1
                given = self._checking.pop(id(router), None)
                if given is not None:  # the first replayed forward of this router
                    self._verify(router, given, output[1])
            # Megatron keeps the last ids until told otherwise: drop them now.
            replay.recorded_topk_idx = None
            replay.target_topk_idx = None
            replay.replay_backward_list = []
            _set_if_present(replay, "target_replay_mask", None)
            _set_if_present(replay, "replay_backward_mask_list", [])
            replay.clear_router_replay_action()
            if pending is not None and torch.is_grad_enabled():
                # This forward built its graph, so it is recomputed only by a non-reentrant
                # checkpoint, lazily, within the backward pass that reaches it (possibly
                # after the gradient reaches these probabilities). Still queued when that
                # pass ends: nothing recomputes this forward.
                probs = output[0]
                if probs.requires_grad:
                    probs.register_hook(_dropper(queue, pending))
                else:  # no gradient will ever reach this router
                    _drop(queue, pending)

        return hook

    def _verify(self, router: MegatronRouter, ids: torch.Tensor, routing_map: torch.Tensor) -> None:
        """The router's first replayed forward of the session dispatched exactly the
        replayed experts (one comparison per router, not per step): else its replay did
        not happen, e.g. a ``RouterReplay`` patched in by another framework compared the
        action with an enum of its own and the router routed natively."""
        wanted = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, ids, True)
        used = routing_map.bool()
        config: Any = getattr(router.module, "config", None)
        if getattr(config, "moe_expert_capacity_factor", None) is not None:
            off = (used & ~wanted).any(dim=1)  # dropped tokens leave slots empty
        else:
            off = (used != wanted).any(dim=1)
        if bool(off.any()):
            row = int(off.nonzero()[0, 0])
            raise ReplayNotApplied(
                "a router did not use the replayed experts",
                expected=sorted(ids[row].tolist()),
                found=used[row].nonzero().flatten().tolist(),
                where=f"MoE layer {router.moe_layer} ({router.name}), token {row} of "
                f"{used.shape[0]} ({int(off.sum())} differ)",
                hint=f"The router's RouterReplay ({_class_name(router.replay)}) ignored the "
                "replay action, or its routing was patched after the session was built.",
            )
        self._verified.add(id(router))

    def _ids(
        self, router: MegatronRouter, mode: _Replaying, seq: int, batch: int, device: torch.device
    ) -> torch.Tensor:
        """int64 ``[seq * batch, K]`` ids in the router's (sequence-major) token order."""
        tokens = seq * batch
        where = f"MoE layer {router.moe_layer} ({router.name})"
        if isinstance(mode.source, Recording):
            ids = mode.source.ids(router.moe_layer).to(device=device, dtype=torch.int64)
            if ids.shape[0] != tokens:
                raise RowCountMismatch(
                    "recorded rows differ from the tokens this router sees",
                    expected=tokens,
                    found=int(ids.shape[0]),
                    where=where,
                    hint="Replay a recording under the layout and micro-batch it was made in.",
                )
            return ids
        parts = self.layout.tp_size if mode.scatter else 1
        ids = mode.source.ids(router.moe_layer, device=device, rows=tokens * parts, where=where)
        # Rows are batch-major [batch, seq * parts]; Megatron flattens [seq, batch].
        ids = ids.view(batch, seq * parts, -1)
        if mode.scatter:
            rank = self.layout.tp_rank
            ids = ids[:, rank * seq : (rank + 1) * seq]
        if batch > 1 or mode.scatter:
            ids = ids.transpose(0, 1).reshape(tokens, -1)
        return ids.reshape(tokens, -1)


def _drop(queue: deque[_Pending], pending: _Pending) -> None:
    """Forget a forward's marker if it is still queued (its recompute has not come)."""
    if pending in queue:  # identity (eq=False); gone if recomputed or the session closed
        queue.remove(pending)


def _dropper(queue: deque[_Pending], pending: _Pending) -> Any:
    """A gradient hook on a forward's probabilities: drop its marker when the backward
    pass now running ends, unless that pass recomputed the forward by then."""

    def hook(grad: torch.Tensor) -> None:
        # The engine runs queued callbacks once the current graph task has finished (the
        # hook used by DDP and FSDP for their end-of-backward work).
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: _drop(queue, pending))

    return hook


def _set_if_present(replay: Any, attr: str, value: Any) -> None:
    """Set a field only some ``RouterReplay`` classes have (verl's replay masks)."""
    if hasattr(replay, attr):
        setattr(replay, attr, value)


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _device_of(router: torch.nn.Module) -> torch.device:
    """Where the router computes: Megatron moves CPU-initialized gates to the GPU on first use."""
    weight = router.weight
    assert isinstance(weight, torch.Tensor)
    if weight.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return weight.device


def _owned_columns(data: Any, columns: list[int]) -> Any:
    """The routes' columns a chunk replays (PP ranks check only their layers)."""
    if columns == list(range(data.shape[1])):
        return data
    return data[:, columns, :]
