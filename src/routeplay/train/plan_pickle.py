"""How a ``PackingPlan`` pickles: as columns of plain tuples, every pack and sample rebuilt
by one call on arrival.

Why: a driver pickles each trainer rank's share of a step's plan before it can send that
rank its call (``PackingPlan.share``), and the rank unpickles it before its first read.
Pickled object by object, each pack, sample and handle took Ray's pickler two Python
hooks (a dispatch-table lookup and ``reducer_override``) and a ``__reduce__``: about
12 ms a share of 1,024 samples, four shares on the driver's critical path per step.
As plain tuples only their payload references and the spec are objects (each pickled
once, then memoized). A sample's handle still travels as its own ``__reduce__``, so it
is checked again where it lands (``Handle``); packs and samples are trusted as built,
as their own pickled forms were.

Example:
    >>> share = plan.share(0)                              # doctest: +SKIP
    >>> pickle.loads(pickle.dumps(share)) == share
    True
"""

from __future__ import annotations

from typing import Any

from routeplay.core.records import restored_fields

__all__ = ["plan_reduced"]

Columns = tuple[Any, ...]


def plan_reduced(
    plan: Any, pack_cls: type[Any], sample_cls: type[Any]
) -> tuple[Any, tuple[Any, ...]] | None:
    """``plan.__reduce__()`` (a ``PackingPlan``: typed ``Any``, as ``packing`` imports
    this module): its classes, spec, micro-batches and ranks, and per pack its length
    and its samples as ``(sample_id, tokens, offset, span, handle.__reduce__())``.
    None when a pack or a sample is not exactly ``pack_cls`` / ``sample_cls`` (a
    subclass may add fields: the plan then pickles the standard way). Handles travel
    as values: two samples naming one ``Handle`` object arrive with equal ones."""
    columns = []
    for pack in plan.packs:
        samples = pack.samples
        if type(pack) is not pack_cls or any([type(s) is not sample_cls for s in samples]):
            return None
        rows = [(s.sample_id, s.tokens, s.offset, s.span, s.handle.__reduce__()) for s in samples]
        columns.append((pack.length, tuple(rows)))
    return (
        _restored_plan,
        (
            type(plan),
            pack_cls,
            sample_cls,
            plan.spec,
            tuple(columns),
            plan.micro_batches,
            plan.dp_ranks,
        ),
    )


def _restored_plan(
    plan_cls: type[Any],
    pack_cls: type[Any],
    sample_cls: type[Any],
    spec: Any,
    columns: tuple[tuple[int, Columns], ...],
    micro_batches: tuple[tuple[int, ...], ...],
    dp_ranks: tuple[int, ...] | None,
) -> Any:
    packs = []
    for length, samples in columns:
        pack: Any = object.__new__(pack_cls)
        pack.__setstate__((tuple(_sample(sample_cls, row) for row in samples), length))
        packs.append(pack)
    return restored_fields(
        plan_cls,
        ("spec", "packs", "micro_batches", "dp_ranks"),
        (spec, tuple(packs), micro_batches, dp_ranks),
    )


def _sample(sample_cls: Any, row: Columns) -> Any:
    sample_id, tokens, offset, span, (build, args) = row
    sample = object.__new__(sample_cls)
    sample.__setstate__((sample_id, build(*args), tokens, offset, span))
    return sample
