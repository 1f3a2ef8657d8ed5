"""verl 0.9.1's routing path, as its agent loop and trainer move routed experts.

verl's rollout returns each sample's routed experts as an array inside the step's
``DataProto``: ``AgentLoopWorker._agent_loop_postprocess`` widens it to int16 and
zero-pads it to the whole prompt + response width (``[1, prompt_length +
response_length, L, K]``, the prompt left-padded), ``_postprocess`` concatenates the
worker's samples, the driver concatenates its workers' outputs (``DataProto.concat``),
chunks the batch over the data-parallel ranks (``DataProto.chunk``) and hands each rank
its chunk as a call argument (Ray serializes it: ``DataProto.__getstate__`` writes the
chunk with ``torch.save``), and each rank pulls its chunk whole.

This module does those steps with verl's own ``DataProto`` when verl and torch import
(the test and benchmark venvs install verl 0.9.1); elsewhere (``pip install
routeplay[ray]`` has neither) with numpy arrays of the same shapes and dtype, which
``kind()`` names. Both are imported on first use, so the bench imports without them.

Example:
    >>> batch = sample_batch([rows_a, rows_b], ["0.0", "0.1"], prompt_length=512,  # doctest: +SKIP
    ...                      response_length=512, prompt_tokens=512)
    >>> [routed_experts(c).shape for c in chunk(batch, 2)]  # doctest: +SKIP
    [(1, 1024, 48, 8), (1, 1024, 48, 8)]
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["chunk", "concat", "kind", "routed_experts", "sample_batch", "sample_ids"]

ROUTED = "routed_experts"
"""verl's batch key of the routing (``[bsz, prompt_length + response_length, L, K]``)."""
IDS = "sample_id"
"""The non-tensor key naming each row's sample (verl keeps ``uid`` there the same way)."""


@functools.cache
def _dataproto() -> Any:
    """verl's ``DataProto`` class, or None when verl (or torch) does not import."""
    try:
        return importlib.import_module("verl.protocol").DataProto
    except ImportError:
        return None


def kind() -> str:
    """Which batch this process builds: verl's ``DataProto`` or the numpy stand-in."""
    if _dataproto() is None:
        return "numpy stand-in (verl does not import: int16 arrays of verl's shapes)"
    version = importlib.import_module("verl").__version__
    return f"verl.protocol.DataProto (verl {version})"


def sample_batch(
    rows: Sequence[npt.NDArray[Any]],
    ids: Sequence[str],
    *,
    prompt_length: int,
    response_length: int,
    prompt_tokens: int,
) -> Any:
    """One rollout worker's output: each sample's routing widened to int16 and placed
    in a zero ``[1, prompt_length + response_length, L, K]`` row from its prompt's first
    position, ``prompt_length - prompt_tokens`` (verl's ``_agent_loop_postprocess``:
    prompts are left-padded to the rollout's ``prompt_length``), then the rows
    concatenated (``_postprocess``)."""
    dataproto = _dataproto()
    tokens = prompt_length + response_length
    start = prompt_length - prompt_tokens
    names = np.array(list(ids), dtype=object)
    if dataproto is None:
        padded = [_padded_numpy(array, tokens, start) for array in rows]
        return {ROUTED: np.concatenate(padded, axis=0), IDS: names}
    torch = importlib.import_module("torch")
    per_sample = []
    for array in rows:
        if not array.flags.writeable:  # verl copies a read-only engine array first
            array = array.copy()
        experts = torch.from_numpy(array).to(torch.int16)
        length, layers, top_k = experts.shape
        routed = torch.zeros(1, tokens, layers, top_k, dtype=experts.dtype)
        routed[:, start : min(start + length, tokens)] = experts.unsqueeze(0)
        per_sample.append(routed)
    batch = torch.cat(per_sample, dim=0)
    return dataproto.from_dict(tensors={ROUTED: batch}, non_tensors={IDS: names})


def _padded_numpy(array: npt.NDArray[Any], tokens: int, start: int) -> npt.NDArray[np.int16]:
    routed = np.zeros((1, tokens, *array.shape[1:]), dtype=np.int16)
    stop = min(start + array.shape[0], tokens)
    routed[0, start:stop] = array[: stop - start]
    return routed


def concat(outputs: Sequence[Any]) -> Any:
    """The driver's batch from its rollout workers' outputs (``DataProto.concat``)."""
    dataproto = _dataproto()
    if dataproto is None:
        return {key: np.concatenate([o[key] for o in outputs]) for key in (ROUTED, IDS)}
    return dataproto.concat(list(outputs))


def chunk(batch: Any, ranks: int) -> list[Any]:
    """One chunk per data-parallel rank, in batch order (``DataProto.chunk``)."""
    if _dataproto() is None:
        parts = zip(*(np.array_split(batch[key], ranks) for key in (ROUTED, IDS)), strict=True)
        return [{ROUTED: routed, IDS: names} for routed, names in parts]
    return list(batch.chunk(ranks))


def routed_experts(batch: Any) -> npt.NDArray[np.int16]:
    """A batch's (or chunk's) routing as a numpy view ``[bsz, tokens, L, K]`` int16."""
    if _dataproto() is None:
        return np.asarray(batch[ROUTED])
    return np.asarray(batch.batch[ROUTED].numpy())


def sample_ids(batch: Any) -> list[str]:
    """The sample of each row of a batch (or chunk)."""
    names = batch[IDS] if _dataproto() is None else batch.non_tensor_batch[IDS]
    return [str(name) for name in names]
