"""``DroppedRefs``: the block references a shard lets go, dropped off its calls' path.

A shard owns every stored block (``routeplay.store.remote.producer``), and a payload's
bytes go when the shard drops its references, after the payload's last lease ended. On
Ray, dropping the last reference to an object its process owns runs Ray's deletion of
it in the dropping thread: inside the call that ended the lease, before its answer. A
training batch's close (one ``release_many``) at 1,024 samples drops 128 payloads: its
call spent 14-35 ms ending the leases with the drops inline, 2-6 ms with the drops
handed to a thread of their own, and the close was answered in 6-20 ms against 22-46
(at 4,096 samples, 512 payloads: 45-56 ms against 85-168). Measured on the RL step's own
cluster, the two ways alternating step by step (``docs/scale.md``).

The lease table forgets a payload at once (its state, its counts, a later read's
``RoutesLost`` are as before); only Ray's freeing of its bytes runs a moment later, on
this thread, in the order the payloads were dropped.

Example:
    dropped = DroppedRefs()
    shard = StoreShard(run, index, dispose=dropped.put)
"""

from __future__ import annotations

import queue
import threading

__all__ = ["DroppedRefs"]


class DroppedRefs:
    """A daemon thread that drops the references handed to it, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(target=self._drain, name="routeplay-dropped-refs", daemon=True).start()

    def put(self, refs: object) -> None:
        """Take over ``refs`` (the caller keeps no other reference): dropped soon."""
        self._queue.put(refs)

    def _drain(self) -> None:
        while True:
            refs = self._queue.get()
            del refs  # the last reference: Ray frees the object from this thread
