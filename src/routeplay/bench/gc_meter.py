"""Python's garbage collections in a bench process: settled before a timed run, counted
during it.

Why: the RL step runs its four paths one after the other in the same processes (the
driver, the rollout worker, the ranks). A path that imports a large library (verl's
path imports torch: 85k tracked objects become 400k) or leaves many objects behind
leaves the collector's counters where the next path's first allocations trigger a full
collection of the whole heap, 210 ms of CPU in each such process on this VM, charged to
whichever path comes next. Measured at 1,024 samples, the producer path took 1,193 ms
right after verl's path and 879 ms right after Ray's floor; with a settle before each
run, 763 and 912 (medians of 3). So each run starts settled (``settle``: one full
collection, untimed), and what its own allocations trigger during it is counted
(``collected``): the CPU of every collection in the process and how many of each
generation, reported with the run, so that this cost is shown, not hidden.

Example:
    settle()
    ...  # the timed run
    collected()  # {"cpu_ms": 3.1, "by_generation": [12, 1, 0]}
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

__all__ = ["collected", "settle"]

# Reentrant: a collection can start inside ``settle`` or ``collected`` (they allocate while
# holding the lock), and its hook then takes the lock again on the same thread.
_lock = threading.RLock()
_started: dict[int, float] = {}  # thread id -> its collection's start (thread CPU)
_cpu_s = 0.0
_by_generation = [0, 0, 0]
_installed = False


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    """``gc.callbacks`` hook: a collection's CPU, on the thread that runs it."""
    global _cpu_s
    me = threading.get_ident()
    if phase == "start":
        _started[me] = time.thread_time()
        return
    began = _started.pop(me, None)
    if began is None:  # installed mid-collection
        return
    with _lock:
        _cpu_s += time.thread_time() - began
        _by_generation[info["generation"]] += 1


def settle() -> None:
    """One full collection (the garbage and counters earlier runs left), then the count
    starts from zero; installs the counting hook on first use.

    Example:
        settle()
    """
    global _installed, _cpu_s
    if not _installed:
        gc.callbacks.append(_on_collection)
        _installed = True
    gc.collect()
    with _lock:
        _cpu_s = 0.0
        _by_generation[:] = [0, 0, 0]


def collected() -> dict[str, Any]:
    """Collections since the last ``settle``: their CPU (ms) and how many of each
    generation (0, 1, 2: a 2 is a full collection of the heap). Asked before any settle
    it raises: nothing was counted, and zeros would read as "no collections".

    Example:
        collected()["cpu_ms"]
    """
    if not _installed:
        raise RuntimeError("gc_meter.collected() before any settle(): nothing was counted")
    with _lock:
        return {"cpu_ms": round(_cpu_s * 1e3, 2), "by_generation": list(_by_generation)}
