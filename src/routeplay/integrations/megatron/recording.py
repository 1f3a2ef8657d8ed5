"""``Recording``: what one chunk's routers chose in recorded forwards (made by
``MegatronReplay.record``, replayed by ``session.replay``, measured apart by the drift
meter, which therefore imports this module and not the session's)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError

__all__ = ["Recording"]


class Recording:
    """What one chunk's routers chose in recorded forwards, compact, in router token order.

    ``ids(moe_layer)`` is that layer's ``[tokens, K]`` ids on the router's device (all
    recorded forwards, rows concatenated). Replay it with ``session.replay(recording)``
    under the same layout: the rows are already the ones each router sees. ``close()``
    drops the ids (idempotent; also on leaving ``with recording:``).

    Example:
        >>> with torch.no_grad(), session.record(chunk=0) as rec:
        ...     old_logits = model_chunks[0](tokens, position_ids, None)
        >>> with rec, session.replay(rec, chunk=0):
        ...     logits = model_chunks[0](tokens, position_ids, None)
    """

    def __init__(self, spec: RouteSpec) -> None:
        self._spec = spec
        self._dtype = torch.uint8 if spec.num_experts <= 256 else torch.int32
        self._layers: dict[int, list[torch.Tensor]] = {}

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layers recorded, in order."""
        return tuple(sorted(self._layers))

    def ids(self, moe_layer: int) -> torch.Tensor:
        """Compact ``[tokens, K]`` ids of one recorded MoE layer."""
        calls = self._layers.get(moe_layer)
        if not calls:
            raise MisuseError(
                "this MoE layer was not recorded",
                expected=f"one of {list(self.layers)}",
                found=moe_layer,
                hint="Record the same model chunk you replay.",
            )
        return calls[0] if len(calls) == 1 else torch.cat(calls)

    def numpy(self) -> npt.NDArray[np.unsignedinteger]:
        """Canonical ``[tokens, recorded layers, K]`` on the host (for inspection or storage)."""
        stacked = torch.stack([self.ids(layer) for layer in self.layers], dim=1)
        return stacked.cpu().numpy().astype(self._spec.dtype)

    @property
    def nbytes(self) -> int:
        """Compact bytes held."""
        return sum(t.numel() * t.element_size() for ts in self._layers.values() for t in ts)

    def close(self) -> None:
        """Drop every recorded id (idempotent)."""
        self._layers.clear()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, moe_layer: int, ids: torch.Tensor) -> torch.Tensor:
        compact = ids.detach().to(self._dtype)
        self._layers.setdefault(moe_layer, []).append(compact)
        return compact
