"""R3 for verl's FSDP engine (HF models), which has none of its own: routeplay's HF
``replay()`` around each micro-batch's forward and backward.

verl's ``FSDPEngine.forward_backward_batch`` runs, for each micro-batch, ``forward_step``
(``prepare_model_inputs``, then the HF module on the packed, padding-free token stream)
and then the loss's backward. ``RouteplayHFReplay.forward_step`` opens a ``replay`` block
for the micro-batch before verl's forward, and leaves it open through the backward:

- a checkpointed layer's recompute replays the same ids;
- the next micro-batch's ``forward_step`` closes it, and so does the end of
  ``forward_backward_batch``, even on an error.

The rows are the micro-batch's samples back to back, in verl's order, as the model sees
them with ``use_remove_padding``: each sample's ``T - 1`` routed rows, then a padding row
for its last token (masked), read once from the store (``VerlHFReplay.rows``).

Example:
    >>> class Engine(RouteplayHFReplay, FSDPEngineWithLMHead): ...
    >>> engine.routeplay_replay = VerlHFReplay(store, hf_model)   # the unwrapped HF model
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.integrations.verl import handles_in
from routeplay.train.drift import DriftMeter
from routeplay.train.hf import replay
from routeplay.train.materializer import Materializer, MicroBatchRoutes, RowReader
from routeplay.train.packing import RankCoords, pack_samples

__all__ = ["RouteplayHFReplay", "VerlHFReplay"]


class VerlHFReplay:
    """One replay block per verl micro-batch, for an HF MoE model.

    Example:
        >>> hf = VerlHFReplay(store, model, drift=meter)
        >>> hf.open(micro_batch)      # what RouteplayHFReplay.forward_step does
        >>> ...                        # verl's forward, the loss's backward
        >>> hf.close()
    """

    def __init__(
        self,
        store: RowReader,
        model: torch.nn.Module,
        *,
        drift: DriftMeter | bool | None = False,
        holder: str = "verl/hf-replay",
    ) -> None:
        self._store = store
        self._model = model
        self._drift = drift
        self._holder = holder
        self._block: ExitStack | None = None

    def rows(self, handles: Sequence[Handle], tokens: Sequence[int]) -> MicroBatchRoutes:
        """The micro-batch's rows in the model's token order (samples back to back, each
        ``tokens`` long: its routed rows and a masked padding row for the last token).

        Example:
            >>> mb = hf.rows(handles, [9, 14, 5])
        """
        samples = [
            (str(i), h, int(t)) for i, (h, t) in enumerate(zip(handles, tokens, strict=True))
        ]
        plan = pack_samples(samples, sum(t for _, _, t in samples), feeds_last_token=True)
        with Materializer(
            self._store, plan, RankCoords(), prefetch=0, name=self._holder
        ) as materializer:
            [routes] = list(materializer)
        return routes

    def open(self, micro_batch: Any) -> None:
        """Close the last micro-batch's block; open this one's (none when it carries no
        handles: its forward runs natively).

        Example:
            >>> hf.open(micro_batch)
        """
        self.close()
        handles = handles_in(micro_batch)
        if handles is None:
            return
        tokens = micro_batch["input_ids"].offsets().diff().tolist()
        rows = self.rows(handles, tokens)
        block = ExitStack()
        # The mask (padding rows) only matters to the drift figures.
        mask = rows.mask if self._drift not in (None, False) else None
        block.enter_context(replay(self._model, rows.routes, mask=mask, drift=self._drift))
        self._block = block

    def close(self) -> None:
        """End the open block (its checks run: every MoE layer must have replayed).

        Example:
            >>> hf.close()
        """
        block, self._block = self._block, None
        if block is not None:
            block.close()

    def abort(self, error: BaseException) -> None:
        """End the open block after ``error`` (its checks are skipped)."""
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(type(error), error, error.__traceback__)


class RouteplayHFReplay:
    """Mixin for verl's ``FSDPEngineWithLMHead``: each micro-batch's forward and backward
    inside its replay block (``routeplay_replay``). Ulysses sequence parallelism is not
    supported (refused).

    Example:
        >>> class Engine(RouteplayHFReplay, FSDPEngineWithLMHead):
        ...     pass
        >>> engine.routeplay_replay = VerlHFReplay(store, hf_model)
    """

    routeplay_replay: VerlHFReplay | None = None

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        if self.routeplay_replay is not None:
            if getattr(self, "use_ulysses_sp", False):
                raise MisuseError(
                    "routeplay's HF replay in verl's FSDP engine does not split rows over "
                    "Ulysses sequence-parallel ranks",
                    hint="Run with ulysses_sequence_parallel_size=1.",
                )
            self.routeplay_replay.open(micro_batch)
        return super().forward_step(micro_batch, loss_function, forward_only)  # type: ignore[misc]

    def forward_backward_batch(
        self, data: Any, loss_function: Any, forward_only: bool = False
    ) -> Any:
        try:
            out = super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
        except BaseException as exc:
            if self.routeplay_replay is not None:
                self.routeplay_replay.abort(exc)
            raise
        if self.routeplay_replay is not None:
            self.routeplay_replay.close()
        return out
