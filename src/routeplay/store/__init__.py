"""routeplay.store: where routing payloads live on Ray, and who may keep them alive.

Ray actors here are thin shells over plain classes (``LeaseTable`` and friends) that
are unit-tested without Ray.
"""

from routeplay.store.lease_table import LeakRecord, LeaseTable, PayloadState, TableStats

__all__ = ["LeakRecord", "LeaseTable", "PayloadState", "TableStats"]
