"""A read places each block's rows as soon as that block arrives, whatever the order.

``Backend.fetch_as_created`` hands a read its blocks in batches as they come to exist
(on Ray: an adopted step's payloads, validated one after another). Here the blocks
arrive one per batch, last first, so every copy of a read lands in a batch of its own
and runs of segments split across batches: the rows must still be exactly those of a
read that got every block at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from strategies import random_routing

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.errors import StoreTimeout
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


class OneBlockAtATime(LocalBackend):
    """Hands a read its blocks one per batch, in reverse order."""

    def __init__(self) -> None:
        super().__init__("arrivals", shards=2, ttl_s=600.0)
        self.batches: list[list[int]] = []

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        for index in reversed(range(len(refs))):
            self.batches.append([index])
            yield [index], self.fetch([refs[index]], what)


def test_rows_arriving_block_by_block_in_reverse_are_placed_exactly() -> None:
    backend = OneBlockAtATime()
    store = RouteStore(StoreConfig(run="arrivals", shards=2), backend)
    sizes = (5, 7, 3, 9)
    parts = [canonicalize(random_routing(SPEC, n, seed), SPEC) for seed, n in enumerate(sizes)]
    handles = store.put_many(parts)
    whole = np.concatenate([p.array for p in parts])
    joined = Handle.concat(SPEC, handles)  # 4 segments: one run split over 4 batches
    requests = [(joined, 2, 22), (handles[1], 1, 6), (joined, 0, 24), (handles[3], 0, 9)]
    outs = store.read_many(requests, holder="reader")
    expected = [whole[2:22], parts[1].array[1:6], whole, parts[3].array]
    for out, want in zip(outs, expected, strict=True):
        np.testing.assert_array_equal(out, want)
    assert len(backend.batches) == 4  # one batch per block: each placed on its own


class NeverWritten(LocalBackend):
    """A read whose blocks never come to exist (their writer hung)."""

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        raise StoreTimeout("routing blocks did not arrive in time", where=what)
        yield  # a generator, as the real one


def test_a_read_whose_blocks_never_come_names_its_payload_run_and_reader() -> None:
    store = RouteStore(StoreConfig(run="hung"), NeverWritten("hung", shards=1, ttl_s=600.0))
    [handle] = store.put_many([canonicalize(random_routing(SPEC, 4, 0), SPEC)])
    [segment] = handle.segments
    with pytest.raises(StoreTimeout, match="did not arrive in time") as timed_out:
        store.read_many([(handle, 0, 4)], holder="rank-3")
    assert f"payload {segment.source.payload_id} (run hung), read by rank-3" in str(timed_out.value)
