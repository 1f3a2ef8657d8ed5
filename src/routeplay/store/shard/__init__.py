"""One store shard's tables (payload references, leases, call counters) and the typed
shard operations; never payload bytes."""
