"""Checkpoints of routeplay's own ``RolloutState``: the generic checkpoint calls
(``routeplay.rollout.checkpoint``, which take any sample type's ``SampleCodec``) with
``RolloutState``'s codec as the default.

These are what ``routeplay.rollout.save_buffer`` / ``load_buffer`` / ``record_sample`` /
``restore_sample`` name, so calls without ``codec=`` keep working for ``RolloutState``
while the checkpoint module itself knows no sample type. Another sample type passes its
own ``codec=`` here or to the generic calls alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import routeplay.rollout.checkpoint as checkpoint
from routeplay.rollout.checkpoint import SampleCodec
from routeplay.rollout.state import ROLLOUT_STATE_CODEC

if TYPE_CHECKING:
    import numpy.typing as npt

    from routeplay.core.spec import RouteSpec
    from routeplay.rollout.buffer import BufferConfig, ReplayBuffer
    from routeplay.store.client import RouteStore

__all__ = ["load_buffer", "record_sample", "restore_sample", "save_buffer"]


def save_buffer(
    buffer: ReplayBuffer[Any],
    folder: Path,
    spec: RouteSpec,
    *,
    codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC,
) -> None:
    """``checkpoint.save_buffer``, ``RolloutState``'s codec by default.

    Example:
        >>> save_buffer(buffer, Path("ckpt/step-3"), spec)  # doctest: +SKIP
    """
    checkpoint.save_buffer(buffer, folder, spec, codec=codec)


def load_buffer(
    folder: Path,
    store: RouteStore,
    config: BufferConfig,
    *,
    codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC,
) -> ReplayBuffer[Any]:
    """``checkpoint.load_buffer``, ``RolloutState``'s codec by default.

    Example:
        >>> buffer = load_buffer(Path("ckpt/step-3"), store, BufferConfig())  # doctest: +SKIP
    """
    return checkpoint.load_buffer(folder, store, config, codec=codec)


def record_sample(
    sample: Any, store: RouteStore, *, codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC
) -> tuple[dict[str, Any], npt.NDArray[Any] | None]:
    """``checkpoint.record_sample``, ``RolloutState``'s codec by default.

    Example:
        >>> record, rows = record_sample(state, store)  # doctest: +SKIP
    """
    return checkpoint.record_sample(sample, store, codec=codec)


def restore_sample(
    record: dict[str, Any],
    array: npt.NDArray[Any] | None,
    store: RouteStore,
    spec: RouteSpec,
    *,
    codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC,
) -> Any:
    """``checkpoint.restore_sample``, ``RolloutState``'s codec by default.

    Example:
        >>> state = restore_sample(record, rows, store, spec)  # doctest: +SKIP
    """
    return checkpoint.restore_sample(record, array, store, spec, codec=codec)
