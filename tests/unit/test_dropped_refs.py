"""``DroppedRefs``: the references a Ray shard lets go are dropped on a thread of their
own, soon and in order, and nothing of them stays behind."""

from __future__ import annotations

import threading
import time
import weakref

from routeplay.store.remote.actors import StoreShardShell
from routeplay.store.remote.dropped_refs import DroppedRefs
from routeplay.store.shard.shard import StoredPayload

DEADLINE_S = 10.0


class _Ref:
    """Stands in for an ObjectRef: records the thread and order in which it goes."""

    __slots__ = ("__weakref__", "at", "gone")

    def __init__(self, at: int, gone: list[tuple[int, str]]) -> None:
        self.at = at
        self.gone = gone

    def __del__(self) -> None:
        self.gone.append((self.at, threading.current_thread().name))


def test_handed_refs_are_dropped_in_order_on_the_disposer_thread() -> None:
    dropped = DroppedRefs()
    gone: list[tuple[int, str]] = []
    refs = [[_Ref(at, gone)] for at in range(50)]
    alive = [weakref.ref(group[0]) for group in refs]
    for group in refs:
        dropped.put(group)
    del refs, group  # the disposer holds the only references now
    deadline = time.monotonic() + DEADLINE_S
    while any(ref() is not None for ref in alive) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [ref() for ref in alive] == [None] * 50
    assert [at for at, _ in gone] == list(range(50))
    assert {name for _, name in gone} == {"routeplay-dropped-refs"}


def test_the_ray_shard_drops_a_released_payloads_refs_on_the_disposer_thread() -> None:
    """The Ray shard's shell hands what its table drops to its ``DroppedRefs``: the
    release answers with the payload gone from the table, and the reference goes on the
    disposer's thread, not on the thread that served the release."""
    shell = StoreShardShell("run-a", 0, ttl_s=None)
    gone: list[tuple[int, str]] = []
    ref = _Ref(0, gone)
    alive = weakref.ref(ref)
    [stored] = shell.adopt_many([ref], [StoredPayload(blocks=1, rows=4, nbytes=16, block_rows=0)])
    del ref  # the shard's table holds the only reference
    lease = shell.acquire([stored.payload_id], "train/step-1", "run-a")
    assert shell.release_many([lease]) == [stored.payload_id]
    deadline = time.monotonic() + DEADLINE_S
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alive() is None
    assert gone == [(0, "routeplay-dropped-refs")]
    assert shell.stats().live_payloads == 0
