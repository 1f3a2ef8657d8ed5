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
        session: MegatronReplay,
        layout: MegatronLayout,
        chunks: Sequence[torch.nn.Module],
        *,
        holder: str = "verl/replay",
    ) -> None:
        self._store = store
        self._session = session
        self._layout = layout
        self._layers = layout.moe_layers(session.spec)
        self._holder = holder
        self._current: MicroBatchRoutes | None = None
        self._open: dict[int, ExitStack] = {}
        self._hooks = []
        for index, chunk in enumerate(chunks):
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
        nested ``input_ids``) for the forwards that follow.

        Example:
            >>> replay.prepare(micro_batch)
        """
        handles = handles_in(batch)
        if handles is None:
            raise MisuseError(
                "the micro-batch carries no routeplay handles",
                hint="Put routing_column(handles) in the step's DataProto.",
            )
        tokens = batch["input_ids"].offsets().diff().tolist()
        self._current = self.micro_batch(handles, tokens)

    def close(self) -> None:
        """Remove the hooks; a block a failed forward left open is closed (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for stack in self._open.values():
            stack.close()
        self._open.clear()

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
            if self._current is None:
                raise MisuseError(
                    "a model chunk ran before its micro-batch's routes were read",
                    where=f"model chunk {chunk}",
                    hint="Call replay.prepare(micro_batch) (RouteplayReplay does, in "
                    "prepare_model_inputs) before the forward.",
                )
            stack = ExitStack()
            stack.enter_context(self._session.replay(self._current, chunk=chunk))
            self._open[chunk] = stack

        return hook

    def _leaving(self, chunk: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            stack = self._open.pop(chunk, None)
            if stack is not None:
                stack.__exit__(*sys.exc_info())  # a failed forward: its markers go

        return hook


class RouteplayReplay:
    """Mixin for verl's Megatron engine (``MegatronEngineWithLMHead``) with verl's R3
    off: ``prepare_model_inputs`` has ``routeplay_replay`` read the micro-batch's rows
    for the forward that follows. A micro-batch without handles is left to verl.

    Example:
        >>> class Engine(RouteplayReplay, MegatronEngineWithLMHead):
        ...     pass
        >>> engine.routeplay_replay = replay     # a VerlReplay, for the step
    """

    routeplay_replay: VerlReplay | None = None

    def prepare_model_inputs(self, batch: Any) -> Any:
        inputs = super().prepare_model_inputs(batch)  # type: ignore[misc]
        if handles_in(batch) is None:
            return inputs
        if self.routeplay_replay is None:
            raise MisuseError(
                "a micro-batch carries routeplay handles but the engine has no replay",
                hint="Set engine.routeplay_replay = VerlReplay(...) for the step.",
            )
        self.routeplay_replay.prepare(batch)
        return inputs
