"""What both daemons (pegaflow-server, pegaflow-metaserver) share: the one
boundary where an outcome becomes a status, the HTTP endpoint, start-up
errors that name the flag."""
