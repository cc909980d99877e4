"""L1: the host pool and its bookkeeping — blocks and their ready index,
eviction, leases, slabs, hit rates, registered instances, the pool file.
Pure Python and numpy; moves no bytes itself (copiers/ does)."""
