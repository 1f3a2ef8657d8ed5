"""Busy CPU time of the machine the benchmark's driver runs on, for a timed window.

On the local cluster every node is a set of processes of this machine, so its busy
time over a path's window covers all that path cost in CPU: its own work and Ray's
(serialization, the transfer between raylets), plus whatever else ran meanwhile (Ray's
daemons, frees of earlier objects): an upper bound of the path's own. Next to a path's
wall time it tells whether the path waited or computed: a path whose busy core-ms
fill every core for its whole window cannot get faster here without less work. On a cluster of
other machines (``--address``) it covers the driver's machine only.

Example:
    start = busy_core_ms()
    run_the_step()
    core_ms = busy_core_ms() - start   # <= cores() * wall ms
"""

from __future__ import annotations

import psutil

__all__ = ["busy_core_ms", "cores"]


def busy_core_ms() -> float:
    """CPU time the machine has spent busy since boot, in core-ms (10 ms resolution).

    Guest time is already in user time and steal time is the hypervisor's, so neither
    is added; idle and I/O wait are not busy."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return float(busy) * 1e3


def cores() -> int:
    """Logical cores of the machine."""
    return int(psutil.cpu_count() or 1)
