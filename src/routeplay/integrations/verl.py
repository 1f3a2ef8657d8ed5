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
- **rollout**: a verl agent loop's generation (its prompt ids and the server's
  ``TokenOutput``) goes through ``TOKEN_OUTPUT``, an engine adapter for the sample's
  ``SampleRouting`` steps: each turn appends only the rows its history lacks, so a
  multi-turn loop keeps every turn's rows from the turn that sampled them (verl's own
  loop replaces the routes with the last turn's, verl#6054), in the canonical dtype, with
  no zero-filled rows;
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
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from routeplay.core.formats.lmdeploy import decode_lists
from routeplay.core.handle import Handle
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize, expected_rows
from routeplay.core.wires import Engine, EngineRouting
from routeplay.errors import DtypeError, HandleError, MalformedPayload, MisuseError
from routeplay.rollout.adapters import ReadingAdapter
from routeplay.train.materializer import RowReader

__all__ = [
    "ROUTING_KEY",
    "TOKEN_OUTPUT",
    "StoreRoutedExperts",
    "TokenOutputAdapter",
    "VerlTurn",
    "handles_in",
    "routed_experts",
    "routing_column",
]

ROUTING_KEY: Final = "routeplay_routing"
"""The batch column of routeplay handles (``DataProto.non_tensor_batch``; a
``NonTensorStack`` once verl turns the batch into a ``TensorDict``)."""


@dataclass(frozen=True, slots=True)
class VerlTurn:
    """One generation of a verl agent loop: the prompt ids it sent (every token of the
    conversation so far) and the rollout server's ``TokenOutput`` (its response
    ``token_ids`` and ``routed_experts``: ``[prompt + response - 1, L, K]``)."""

    prompt_ids: Sequence[int]
    """The request's prompt ids."""
    output: Any
    """verl's ``TokenOutput`` (``verl.workers.rollout.replica``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenOutputAdapter(ReadingAdapter):
    """Reads a ``VerlTurn`` (an ``EngineAdapter`` for ``RoutingContinuation.ingest``).

    Example:
        >>> with await routing.acontinuation() as cont:     # in an asyncio producer actor
        ...     handle = await cont.aingest(TOKEN_OUTPUT, VerlTurn(prompt_ids, output),
        ...         spec=spec, writer=self.writer, weight_version=version)  # ProducerWriter
        ...     routing = await cont.afinish(store, handle)
    """

    name: str = "verl-token-output"
    """Adapter name (named in refusals)."""

    def read(
        self, response: Any, *, spec: RouteSpec, where: str = "", start_row: int = 0
    ) -> EngineRouting:
        """The turn's routing, validated: every row of prompt and response but the last
        (``start_row`` unused: verl's servers send every row).

        Example:
            >>> routing = TOKEN_OUTPUT.read(VerlTurn(prompt_ids, output), spec=spec)
        """
        where = where or "verl TokenOutput"
        prompt, completion = len(response.prompt_ids), len(response.output.token_ids)
        return EngineRouting(
            engine=Engine.VLLM,
            prompt_tokens=prompt,
            completion_tokens=completion,
            routes=_routes_of(response.output, spec, expected_rows(prompt, completion), where),
        )


TOKEN_OUTPUT: Final = TokenOutputAdapter()
"""The adapter for verl's ``TokenOutput``."""


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


def _routes_of(output: Any, spec: RouteSpec, rows: int, where: str) -> Routes:
    """A ``TokenOutput``'s ``routed_experts`` (an array, a tensor or nested lists, as
    verl's servers hand them over), validated as ``rows`` canonical rows."""
    routes = getattr(output, "routed_experts", None)
    if isinstance(routes, torch.Tensor):
        if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
            raise DtypeError(
                "routed_experts must hold integer expert ids",
                expected="an integer tensor",
                found=str(routes.dtype),
                where=where,
            )
        routes = routes.detach().cpu().numpy()
    if isinstance(routes, list):  # nesting and leaf types checked before numpy converts
        return decode_lists(routes, spec, expected=rows, where=where)
    if isinstance(routes, np.ndarray):
        return canonicalize(routes, spec, expected=rows, where=where)
    raise MalformedPayload(
        "verl's TokenOutput carries no routed_experts array",
        expected="[prompt + response - 1, L, K] expert ids (array, tensor or nested lists)",
        found=type(routes).__name__,
        where=where,
        hint="Turn on routing capture in the rollout server (R3)." if routes is None else "",
    )


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
