"""pegaflow-metaserver: an approximate global index of which node holds which KV
block, so a server missing a prefix can read it from a peer (docs/metaserver.md).

It imports the server's shared values (keys, errors, boundary, http) and
nothing of the engine, pool or copiers.
"""
