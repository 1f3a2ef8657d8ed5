"""verl: a step's routing as handles in its batch, its rows read from the store by the
rank whose micro-batch replays them.

verl 0.9.1 carries R3 routes in the step's ``DataProto``: each sample's ``[T-1, L, K]``
widened to int16 and zero-padded to the batch width, un-padded on the driver, then put whole
in every DP chunk that all TP/PP/CP ranks of that chunk pull. With routeplay the batch
carries a handle per sample (about a hundred bytes) and the routes stay in the store until
a rank's micro-batch needs them:

- **driver**: ``routing_column(handles)`` is the ``non_tensor_batch[ROUTING_KEY]`` column; it
  survives verl's batch operations (``repeat``, ``chunk``, ``concat``, ``reorder``,
  pickling). The step's ``TrainingBatch`` holds the leases until the last pass that
  replays, and closes in ``finally``;
- **trainer**: a Megatron engine class with ``StoreRoutedExperts`` first in its bases
  fills ``model_inputs["routed_experts"]`` from the store in ``prepare_model_inputs``, one
  read per micro-batch of exactly its samples, in the canonical dtype (1 byte an id under 256
  experts); verl's own R3 path (``align_r3_router_replay_data``, ``build_r3_replay_mask``,
  ``set_router_replay_data``) then runs unchanged.

Example:
    >>> data.non_tensor_batch[ROUTING_KEY] = routing_column([s.handle for s in batch.states])
    >>> class Engine(StoreRoutedExperts, MegatronEngineWithLMHead): ...
    >>> engine.routeplay_store = store     # in the worker, before the step
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from routeplay.core.handle import Handle
from routeplay.errors import HandleError, MisuseError
from routeplay.train.materializer import RowReader

__all__ = ["ROUTING_KEY", "StoreRoutedExperts", "handles_in", "routed_experts", "routing_column"]

ROUTING_KEY: Final = "routeplay_routing"
"""The batch column of routeplay handles (``DataProto.non_tensor_batch``; a
``NonTensorStack`` once verl turns the batch into a ``TensorDict``)."""


def routing_column(handles: Sequence[Handle]) -> npt.NDArray[np.object_]:
    """A 1-D object array of ``handles``: the ``non_tensor_batch`` column verl expects.

    Example:
        data.non_tensor_batch[ROUTING_KEY] = routing_column(handles)
    """
    column = np.empty(len(handles), dtype=object)
    for index, handle in enumerate(handles):
        column[index] = _checked(handle, index)
    return column


def handles_in(batch: Any) -> list[Handle] | None:
    """The handles of a verl batch, in its row order (``DataProto``, ``TensorDict`` or a
    mapping); None when it carries none. A column holding anything else is refused.

    Example:
        handles = handles_in(micro_batch)
    """
    non_tensor = getattr(batch, "non_tensor_batch", None)
    source = non_tensor if isinstance(non_tensor, Mapping) else batch
    if ROUTING_KEY not in source:
        return None
    column = source[ROUTING_KEY]
    values = column.tolist() if hasattr(column, "tolist") else list(column)
    return [_checked(value, index) for index, value in enumerate(values)]


def routed_experts(store: RowReader, handles: Sequence[Handle], *, holder: str = "") -> Any:
    """Each handle's rows, read in one ``read_many`` (one ``locate`` per shard; the step's
    batch holds the leases), as the jagged nested tensor verl's R3 expects in
    ``model_inputs["routed_experts"]``: ``[rows_i, L, K]`` per sample, uint8 under 256
    experts (int32 above: torch has no nested uint16), widened by verl per layer.

    Example:
        inputs["routed_experts"] = routed_experts(store, handles_in(micro_batch))
    """
    if not handles:
        raise MisuseError("a micro-batch with no samples has no routing to read")
    arrays = store.read_many(
        [(handle, 0, handle.rows) for handle in handles], holder=holder or "verl micro-batch"
    )
    tensors = [torch.from_numpy(_torch_dtype(array)) for array in arrays]
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


class StoreRoutedExperts:
    """Mixin for verl's Megatron engine (``MegatronEngineWithLMHead``): the micro-batch's
    ``routed_experts`` come from the store by its handles, not from the batch.

    Put it first in the bases and set ``routeplay_store`` on the engine (its
    ``RouteStore``) before the step. A micro-batch without the handle column is left as
    verl built it.

    Example:
        >>> class RouteplayEngine(StoreRoutedExperts, MegatronEngineWithLMHead):
        ...     pass
        >>> engine.routeplay_store = store
    """

    routeplay_store: RowReader | None = None

    def prepare_model_inputs(self, batch: Any) -> Any:
        inputs = super().prepare_model_inputs(batch)  # type: ignore[misc]
        handles = handles_in(batch)
        if handles is None:
            return inputs
        if self.routeplay_store is None:
            raise MisuseError(
                "a micro-batch carries routeplay handles but the engine has no store",
                hint="Set engine.routeplay_store = store (a RouteStore) before the step.",
            )
        inputs["routed_experts"] = routed_experts(self.routeplay_store, handles)
        return inputs


def _checked(value: Any, index: int) -> Handle:
    if not isinstance(value, Handle):
        raise HandleError(
            "the routing column holds something else than routeplay handles",
            expected="a routeplay Handle per row",
            found=type(value).__name__,
            where=f"row {index} of {ROUTING_KEY}",
        )
    return value


def _torch_dtype(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return array if array.dtype == np.uint8 else array.astype(np.int32)
