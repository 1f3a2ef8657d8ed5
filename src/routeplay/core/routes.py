"""Routes: one decoded, validated, canonical routing payload (the only in-memory form).

Invariant: ``array`` is C-contiguous, read-only, ``[rows, L, K]`` in ``spec.dtype``,
every id in ``[0, E)`` and distinct within each (row, layer). Only
``routeplay.core.validate.canonicalize`` builds one from untrusted data, and the SGLang
streaming decoder (``routeplay.core.formats.sglang``), which runs the same checks slice by
slice and defers to ``canonicalize`` on any problem.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import Handle, InlineSource, Segment
from routeplay.core.spec import RouteSpec
from routeplay.errors import HandleError

__all__ = ["Routes"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Routes:
    """Validated canonical routing rows ``[start_row, start_row + rows)`` of one sample."""

    array: npt.NDArray[np.unsignedinteger]
    """Canonical ``[rows, L, K]`` array, read-only."""
    spec: RouteSpec
    """Geometry the array was validated against."""
    start_row: int = 0
    """Absolute token row of ``array[0]`` (SGLang ``routed_experts_start_len``)."""
    source_dtype: str = ""
    """Element type the engine sent, before narrowing."""

    @property
    def rows(self) -> int:
        """Token rows held."""
        return int(self.array.shape[0])

    @property
    def stop_row(self) -> int:
        """Absolute row one past the last held."""
        return self.start_row + self.rows

    @property
    def nbytes(self) -> int:
        """Canonical bytes."""
        return int(self.array.nbytes)

    def sha256(self) -> str:
        """Hex digest of the canonical C-contiguous bytes (what ``inspect --json`` reports)."""
        return hashlib.sha256(self.array.data).hexdigest()

    def tail(self, start_row: int) -> Routes:
        """Rows from absolute ``start_row`` on (a view: the rows a resume must append)."""
        if not self.start_row <= start_row <= self.stop_row:
            raise HandleError(
                "resume point outside the payload's rows",
                expected=f"a row in [{self.start_row}, {self.stop_row}]",
                found=start_row,
            )
        rows = self.array[start_row - self.start_row :]
        return Routes(
            array=rows, spec=self.spec, start_row=start_row, source_dtype=self.source_dtype
        )

    def segment(self, *, weight_version: int = 0) -> Segment:
        """The rows as an inline segment (by value: tests, checkpoints, store-less engines)."""
        return Segment(
            source=InlineSource(array=self.array),
            start=0,
            stop=self.rows,
            spec=self.spec,
            weight_version=weight_version,
        )

    def handle(self, *, weight_version: int = 0) -> Handle:
        """A one-segment inline handle covering rows ``[0, rows)`` of the sample."""
        if self.start_row:
            raise HandleError(
                "a payload that starts after row 0 continues a handle; append it instead",
                expected="start_row 0",
                found=f"start_row {self.start_row}",
            )
        return Handle.of(self.segment(weight_version=weight_version))
