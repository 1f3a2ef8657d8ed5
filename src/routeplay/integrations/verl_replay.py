"""routeplay's own replay inside verl's Megatron engine: each rank reads only its rows of
its stage's layers, and ``MegatronReplay`` forces them (verl's R3 off).

``StoreRoutedExperts`` (``routeplay.integrations.verl``) keeps verl's R3 and feeds it
whole sequences of every layer. This mode replaces it. For every micro-batch verl's
engine prepares, ``VerlReplay.prepare`` lays the micro-batch out as verl packs it:

- its sequences in order, each padded to ``layout.seq_align()`` (THD);
- split over CP (zigzag, per sequence) and over TP (sequence parallelism);
- the rank's MoE layers (``layout.moe_layers(spec)``).

It reads exactly those rows through a ``Materializer`` (no lease of its own: the step's
batch holds them). A forward pre-hook on each model chunk then opens
``session.replay(rows, chunk=i)`` around that chunk's forward. The routers' recomputes in
the backward replay the same ids (``MegatronReplay`` keeps them per forward).

Example:
    >>> class Engine(RouteplayReplay, MegatronEngineWithLMHead): ...
    >>> with MegatronReplay(chunks, spec, layout=layout) as session, \\
    ...         VerlReplay(store, session, layout, chunks) as replay:
    ...     engine.routeplay_replay = replay
    ...     engine.forward_backward_batch(data, loss_fn)   # verl's own step
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from types import TracebackType
from typing import Any

import torch

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.integrations.megatron import MegatronLayout, MegatronReplay
from routeplay.integrations.verl import handles_in
from routeplay.train.materializer import Materializer, MicroBatchRoutes, RowReader
from routeplay.train.packing import pack_samples

__all__ = ["RouteplayReplay", "VerlReplay"]


class VerlReplay:
    """Feeds a ``MegatronReplay`` session one verl micro-batch at a time; hooks the
    model chunks the session wraps (in virtual-stage order). A context manager: leaving
    it removes the hooks.

    Example:
        >>> with VerlReplay(store, session, layout, chunks) as replay:
        ...     replay.prepare(micro_batch)       # what RouteplayReplay calls
        ...     chunks[0](tokens, position_ids, None)   # replays the micro-batch's rows
    """

    def __init__(
        self,
        store: RowReader,
        session: MegatronReplay | None,
        layout: MegatronLayout,
        chunks: Sequence[torch.nn.Module],
        *,
        holder: str = "verl/replay",
    ) -> None:
        self._store = store
        self._session = session
        self._layout = layout
        # A stage of dense layers only has no routers (MegatronReplay refuses such a
        # model: pass None): it reads and replays nothing.
        self._layers = () if session is None else layout.moe_layers(session.spec)
        self._holder = holder
        self._current: MicroBatchRoutes | object | None = None
        self._open: dict[int, tuple[ExitStack, BaseException | None]] = {}
        self._hooks = []
        routed = set() if session is None else {router.chunk for router in session.routers}
        for index, chunk in enumerate(chunks):
            if index not in routed:  # a chunk of dense layers: its forwards stay native
                continue
            self._hooks.append(chunk.register_forward_pre_hook(self._entering(index)))
            self._hooks.append(chunk.register_forward_hook(self._leaving(index), always_call=True))

    def micro_batch(self, handles: Sequence[Handle], tokens: Sequence[int]) -> MicroBatchRoutes:
        """This rank's rows of a micro-batch of ``handles`` (each sample's ``tokens`` input
        ids: its rows plus the last token's), laid out as verl's THD packing does.

        Example:
            >>> mb = replay.micro_batch(handles, [9, 14, 5])
        """
        align = self._layout.seq_align()
        samples = [
            (str(i), h, int(t)) for i, (h, t) in enumerate(zip(handles, tokens, strict=True))
        ]
        padded = sum(-(-t // align) * align for _, _, t in samples)
        plan = pack_samples(
            samples, padded, feeds_last_token=True, seq_align=align, pack_multiple=align
        )
        coords = dataclasses.replace(self._layout.coords(), dp_rank=0)  # the rank's own batch
        with Materializer(
            self._store, plan, coords, prefetch=0, layers=self._layers, name=self._holder
        ) as materializer:
            [routes] = list(materializer)
        return routes

    def prepare(self, batch: Any) -> None:
        """Read the rows of verl's micro-batch ``batch`` (its handle column and its
        nested ``input_ids``) for the forward that follows (one forward: verl prepares
        a micro-batch before each model chunk's forward). A micro-batch without handles
        runs natively, and so does every forward of a rank without MoE layers.

        Example:
            >>> replay.prepare(micro_batch)
        """
        self._current = None  # never the previous micro-batch's rows, also on a refusal
        handles = handles_in(batch)
        if handles is None or not self._layers:
            self._current = _NATIVE
            return
        tokens = batch["input_ids"].offsets().diff().tolist()
        self._current = self.micro_batch(handles, tokens)

    def close(self) -> None:
        """Remove the hooks; a block an interrupted forward left open is closed as
        failed (its recompute markers dropped). Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        while self._open:
            _, (stack, _) = self._open.popitem()
            _abort(stack)

    def __enter__(self) -> VerlReplay:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _entering(self, chunk: int) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            stale = self._open.pop(chunk, None)
            if stale is not None:  # a forward interrupted (not an Exception) left it open
                _abort(stale[0])
            current, self._current = self._current, None  # one forward per prepare
            if current is _NATIVE:
                return
            if not isinstance(current, MicroBatchRoutes):
                raise MisuseError(
                    "a model chunk ran before its micro-batch's routes were read",
                    where=f"model chunk {chunk}",
                    hint="Call replay.prepare(micro_batch) (RouteplayReplay does, in "
                    "prepare_model_inputs) before each forward.",
                )
            assert self._session is not None  # a rank without a session hooks nothing
            stack = ExitStack()
            stack.enter_context(self._session.replay(current, chunk=chunk))
            # An exception already being handled around the forward is not the forward's.
            self._open[chunk] = (stack, sys.exc_info()[1])

        return hook

    def _leaving(self, chunk: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            entry = self._open.pop(chunk, None)
            if entry is None:
                return
            stack, outer = entry
            raised = sys.exc_info()[1]  # set when torch calls this for a failed forward
            if raised is None or raised is outer:
                stack.close()
            else:
                stack.__exit__(type(raised), raised, raised.__traceback__)  # markers go

        return hook


_NATIVE = object()
"""``prepare``'s mark for a forward that replays nothing (no handles, no MoE layers)."""


def _abort(stack: ExitStack) -> None:
    """Close a replay block as failed: its forward's recompute markers are dropped."""
    aborted = MisuseError("the forward of this replay block did not complete")
    with contextlib.suppress(MisuseError):  # the block re-raising the abort: it is closed
        stack.__exit__(MisuseError, aborted, None)


class RouteplayReplay:
    """Mixin for verl's Megatron engine (``MegatronEngineWithLMHead``) with verl's R3
    off: ``prepare_model_inputs`` has ``routeplay_replay`` read the micro-batch's rows
    for the forward that follows. A micro-batch without handles runs natively.

    Example:
        >>> class Engine(RouteplayReplay, MegatronEngineWithLMHead):
        ...     pass
        >>> engine.routeplay_replay = replay     # a VerlReplay, for the step
    """

    routeplay_replay: VerlReplay | None = None

    def prepare_model_inputs(self, batch: Any) -> Any:
        inputs = super().prepare_model_inputs(batch)  # type: ignore[misc]
        if self.routeplay_replay is not None:
            self.routeplay_replay.prepare(batch)  # without handles: a native forward
        elif handles_in(batch) is not None:
            raise MisuseError(
                "a micro-batch carries routeplay handles but the engine has no replay",
                hint="Set engine.routeplay_replay = VerlReplay(...) for the step.",
            )
        return inputs
