"""The plain decisions and figures of verl's data path against routeplay's
(``routeplay.bench.verl_step``), without Ray: which ranks a step has, what a rank reports
of a pass, whether a checked step's two paths delivered the same rows, the medians of a
path's steps and verl's figures over routeplay's.

Example:
    >>> from routeplay.bench.workloads import VerlStepShape
    >>> ranks_of(VerlStepShape(samples=2, dp=2, tp=1, pp=2))
    [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

from routeplay.bench.workloads import VerlStepShape

__all__ = [
    "Rank",
    "RankPass",
    "RowsCheck",
    "check_rows",
    "rank_name",
    "ranks_of",
    "ratios",
    "summary",
]

Rank = tuple[int, int, int]
"""A rank's (dp, tp, pp)."""


class RowsCheck(NamedTuple):
    """What a rank compared on a checked step (its first routeplay pass)."""

    rows: int
    """Sample rows the materializer laid out for this rank (its mask's real rows)."""
    compared: int
    """Rows compared with verl's chunk (every real row, when the layouts agree)."""
    routeplay: str
    """Digest of the compared rows as the materializer gave them, in layout order."""
    verl: str
    """Digest of the same rows taken from verl's chunk (un-padded, this stage's layers)."""


class RankPass(NamedTuple):
    """What a rank reports of one pass."""

    bytes_in: int
    """Routing bytes brought into the process (verl: the deserialized chunk; routeplay:
    the micro-batch arrays the materializer filled, padding included)."""
    peak: int
    """The most routing bytes held at once."""
    check: RowsCheck | None = None
    """On a checked step's routeplay pass: the comparison with verl's rows."""


def rank_name(dp: int, tp: int, pp: int) -> str:
    """A rank's name in holders and errors, e.g. ``dp0-tp1-pp3``."""
    return f"dp{dp}-tp{tp}-pp{pp}"


def ranks_of(shape: VerlStepShape) -> list[Rank]:
    """Every rank's (dp, tp, pp), in order."""
    return [(d, t, p) for d in range(shape.dp) for t in range(shape.tp) for p in range(shape.pp)]


def check_rows(first: dict[Rank, RankPass], shape: VerlStepShape) -> int:
    """A checked step's first routeplay pass: each rank's digests of the rows it compared
    must agree, and for every DP chunk and stage its TP ranks must have compared every
    row of the chunk between them (``RuntimeError`` otherwise); the rows compared.

    Example:
        >>> check_rows({}, VerlStepShape(dp=1, tp=1, pp=1))
        Traceback (most recent call last):
        RuntimeError: verl data path: dp0-tp0-pp0 compared no rows
    """
    for rank in ranks_of(shape):
        check = first[rank].check if rank in first else None
        if check is None:
            raise RuntimeError(f"verl data path: {rank_name(*rank)} compared no rows")
        if check.routeplay != check.verl or check.compared != check.rows:
            raise RuntimeError(
                f"verl data path: {rank_name(*rank)} got other rows from routeplay than "
                f"from verl's chunk ({check.compared} of its {check.rows} rows compared, "
                f"digests {check.routeplay} vs {check.verl})"
            )
    per = shape.samples // shape.dp  # verl's chunks: consecutive samples
    for dp in range(shape.dp):
        chunk_rows = sum(sum(shape.lengths(s)) - 1 for s in range(dp * per, (dp + 1) * per))
        for pp in range(shape.pp):
            seen = sum(_compared(first[dp, tp, pp]) for tp in range(shape.tp))
            if seen != chunk_rows:
                raise RuntimeError(
                    f"verl data path: the TP ranks of dp{dp}-pp{pp} compared {seen} rows, "
                    f"their chunk has {chunk_rows}"
                )
    return sum(_compared(result) for result in first.values())


def _compared(result: RankPass) -> int:
    return 0 if result.check is None else result.check.compared


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a path's timed steps (the bytes into the ranks and the driver's
    routing are the same in every step: the first one's)."""
    ms = [run["ms"] for run in runs]
    roles = runs[0]["bytes_into"]
    return {
        "median_ms": round(statistics.median(ms), 1),
        "min_ms": round(min(ms), 1),
        "max_ms": round(max(ms), 1),
        "bytes_into": {
            role: int(statistics.median(run["bytes_into"][role] for run in runs)) for role in roles
        },
        "bytes_into_ranks": runs[0]["bytes_into_ranks"],
        "driver_routing_bytes": runs[0]["driver_routing_bytes"],
        "rank_peak_bytes": max(run["rank_peak_bytes"] for run in runs),
        "runs": len(runs),
    }


def ratios(paths: dict[str, dict[str, Any]]) -> dict[str, float]:
    """verl's figures over routeplay's (a node routeplay wrote nothing to counts as 1 B).

    Example:
        >>> ratios(paths)["bytes_into_trainer_node"]  # doctest: +SKIP
        38.8
    """
    verl, ours = paths["verl"], paths["routeplay"]
    into_verl, into_ours = verl["bytes_into"], ours["bytes_into"]
    return {
        "step_time": round(verl["median_ms"] / ours["median_ms"], 2),
        "bytes_into_ranks": round(verl["bytes_into_ranks"] / ours["bytes_into_ranks"], 2),
        "bytes_into_trainer_node": round(into_verl["trainer"] / max(1, into_ours["trainer"]), 2),
        "bytes_into_driver_node": round(into_verl["head"] / max(1, into_ours["head"]), 2),
        "rank_peak": round(verl["rank_peak_bytes"] / ours["rank_peak_bytes"], 2),
        "driver_routing": round(verl["driver_routing_bytes"] / ours["driver_routing_bytes"]),
    }
