"""The store's Ray plumbing: actor shells, backends, deadlines on every Ray wait, peer
version checks, producer actors and Ray's object-store counters."""
