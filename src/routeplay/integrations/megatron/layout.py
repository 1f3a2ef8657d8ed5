"""Megatron-Core's parallel layout, as far as routing replay cares: no torch, no Megatron.

``MegatronLayout`` says where one rank sits (TP with or without sequence parallelism, CP,
PP with virtual stages, DP) and turns that into the two things routeplay needs:

- the ``RankCoords`` the materializer lays a rank's routing rows out with, so that row
  ``i`` of a micro-batch is the ``i``-th token the rank's routers see: THD packs are cut
  per sequence over CP (``2 * cp`` chunks, rank ``r`` holds chunks ``r`` and
  ``2 * cp - 1 - r``), then the CP-local stream is scattered over TP when sequence
  parallelism is on (TP rank ``t`` holds the ``t``-th contiguous part); BSHD rows are cut
  whole over CP (``get_batch_on_this_cp_rank``);
- which decoder layers each model chunk (virtual stage) of the rank builds, by Megatron's
  own rule (``get_transformer_layer_offset`` / ``get_num_layers_to_build``) for even
  splits and uneven first/last stages. The adapter checks the routers it finds against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, SpecMismatch
from routeplay.train.packing import RankCoords, seq_alignment

__all__ = ["MegatronLayout", "QkvFormat"]

QkvFormat = Literal["thd", "bshd"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronLayout:
    """One rank's place in a Megatron-Core job, and the model's layer split.

    Example:
        >>> layout = MegatronLayout(tp_size=2, tp_rank=1, sequence_parallel=True,
        ...                         cp_size=2, cp_rank=0, num_layers=48)
        >>> coords = layout.coords()                   # for the Materializer
        >>> align = layout.seq_align()                 # for pack_samples(seq_align=...)
    """

    tp_size: int = 1
    """Tensor-parallel ranks."""
    tp_rank: int = 0
    """This rank's TP rank."""
    sequence_parallel: bool = False
    """Megatron's ``sequence_parallel``: the MoE layers see only this TP rank's tokens."""
    cp_size: int = 1
    """Context-parallel ranks."""
    cp_rank: int = 0
    """This rank's CP rank."""
    pp_size: int = 1
    """Pipeline stages."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    vp_size: int | None = None
    """Virtual stages (model chunks) per pipeline rank; None without interleaving."""
    dp_rank: int = 0
    """Data-parallel rank (selects micro-batches in the plan)."""
    qkv_format: QkvFormat = "thd"
    """``thd``: packed sequences, one row per micro-batch; ``bshd``: one pack per row."""
    num_layers: int | None = None
    """Decoder layers of the model (dense ones included); None skips the layer check."""
    first_stage_layers: int | None = None
    """``num_layers_in_first_pipeline_stage`` for uneven pipelines."""
    last_stage_layers: int | None = None
    """``num_layers_in_last_pipeline_stage`` for uneven pipelines."""

    def __post_init__(self) -> None:
        for label, rank, size in (
            ("tp", self.tp_rank, self.tp_size),
            ("cp", self.cp_rank, self.cp_size),
            ("pp", self.pp_rank, self.pp_size),
        ):
            if not 0 <= rank < size:
                raise MisuseError(
                    f"{label}_rank must lie in [0, {label}_size)",
                    expected=f"0 <= {label}_rank < {size}",
                    found=rank,
                )
        if self.vp_size is not None and self.vp_size < 1:
            raise MisuseError("vp_size must be positive or None", found=self.vp_size)
        if self.qkv_format not in ("thd", "bshd"):
            raise MisuseError("unknown qkv_format", expected=("thd", "bshd"), found=self.qkv_format)

    @classmethod
    def from_parallel_state(cls, config: Any = None, **overrides: Any) -> MegatronLayout:
        """The layout of the calling rank, read from ``megatron.core.parallel_state``.

        ``config`` (a ``TransformerConfig``) adds sequence parallelism and the layer
        split; ``overrides`` set any field (e.g. ``qkv_format="bshd"``).
        """
        from megatron.core import parallel_state as ps

        fields: dict[str, Any] = {
            "tp_size": ps.get_tensor_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "cp_size": ps.get_context_parallel_world_size(),
            "cp_rank": ps.get_context_parallel_rank(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "vp_size": ps.get_virtual_pipeline_model_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(),
        }
        if config is not None:
            fields |= {
                "sequence_parallel": bool(config.sequence_parallel),
                "num_layers": config.num_layers,
                "first_stage_layers": config.num_layers_in_first_pipeline_stage,
                "last_stage_layers": config.num_layers_in_last_pipeline_stage,
            }
        return cls(**(fields | overrides))

    @property
    def sp_size(self) -> int:
        """Ranks the MoE layers' tokens are scattered over (TP with sequence parallelism)."""
        return self.tp_size if self.sequence_parallel else 1

    @property
    def chunks(self) -> int:
        """Model chunks (virtual stages) this rank holds."""
        return self.vp_size if self.vp_size is not None and self.pp_size > 1 else 1

    def coords(self) -> RankCoords:
        """The materializer's coordinates for this rank (rows in the routers' token order)."""
        return RankCoords(
            dp_rank=self.dp_rank,
            sp_rank=self.tp_rank if self.sequence_parallel else 0,
            sp_size=self.sp_size,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            cp_split="per_sequence" if self.qkv_format == "thd" else "pack_zigzag",
        )

    def seq_align(self) -> int:
        """Per-sequence padding multiple of THD packs (``pack_samples(seq_align=...)``).

        Megatron-based trainers pad by TP even without sequence parallelism (verl,
        NeMo-RL): ``2 * cp * tp`` with CP, ``tp`` without.
        """
        return seq_alignment(cp_size=self.cp_size, sp_size=self.tp_size)

    def moe_layers(self, spec: RouteSpec) -> tuple[int, ...]:
        """MoE layers (payload columns) of every model chunk this rank holds, in order:
        what its ``Materializer(layers=...)`` reads (a stage copies and holds 1/PP of the
        routing, not all of it). Empty for a stage with dense layers only: it has no
        routing to read or replay (``VerlReplay(store, None, ...)``).

        Example:
            >>> layout = MegatronLayout(pp_size=4, pp_rank=1, vp_size=2, num_layers=16)
            >>> layout.moe_layers(spec)                  # every layer MoE
            (2, 3, 10, 11)
        """
        return _stage_moe_layers(self, spec)

    def chunk_layers(self, vp_stage: int = 0) -> range:
        """Decoder layers (0-based) model chunk ``vp_stage`` of this rank builds."""
        if self.num_layers is None:
            raise MisuseError(
                "the layer split needs num_layers",
                hint="Pass num_layers (or a TransformerConfig to from_parallel_state).",
            )
        if not 0 <= vp_stage < self.chunks:
            raise MisuseError(
                "vp_stage out of range", expected=f"0 <= vp_stage < {self.chunks}", found=vp_stage
            )
        if self.pp_size == 1:
            return range(self.num_layers)
        offset, count = _split(self, vp_stage)
        return range(offset, offset + count)


def _stage_moe_layers(layout: MegatronLayout, spec: RouteSpec) -> tuple[int, ...]:
    decoders = [d for chunk in range(layout.chunks) for d in layout.chunk_layers(chunk)]
    if layout.num_layers != spec.decoder_layers:
        raise SpecMismatch(
            "the pipeline splits another number of decoder layers than the spec has",
            expected=f"num_layers = {spec.decoder_layers} (the spec's decoder layers)",
            found=layout.num_layers,
        )
    moe = (spec.moe_layer(decoder) for decoder in sorted(decoders))
    return tuple(layer for layer in moe if layer is not None)


def _split(layout: MegatronLayout, vp_stage: int) -> tuple[int, int]:
    """(offset, count) of a chunk's layers, by Megatron's pipeline split."""
    assert layout.num_layers is not None
    vp = layout.chunks
    first, last = layout.first_stage_layers, layout.last_stage_layers
    middle_stages = layout.pp_size - (first is not None) - (last is not None)
    middle_layers = layout.num_layers - (first or 0) - (last or 0)
    if middle_stages and middle_layers % middle_stages:
        raise MisuseError(
            "the middle pipeline stages cannot share the layers evenly",
            expected=f"a multiple of {middle_stages} layers",
            found=middle_layers,
        )
    per_middle = middle_layers // middle_stages if middle_stages else 0
    per_stage = [per_middle] * layout.pp_size
    if first is not None:
        per_stage[0] = first
    if last is not None:
        per_stage[-1] = last
    if any(count % vp for count in per_stage):
        raise MisuseError(
            "a pipeline stage's layers do not split over its virtual stages",
            expected=f"multiples of vp_size={vp}",
            found=per_stage,
        )
    per_chunk = [count // vp for count in per_stage]
    # Virtual stage v of every rank comes before virtual stage v + 1 of any rank.
    offset = vp_stage * sum(per_chunk) + sum(per_chunk[: layout.pp_rank])
    return offset, per_chunk[layout.pp_rank]
