"""The L2 remote tier: peers' pools read one-sided, planned by the metaserver
(docs/multinode.md). Imported only when --metaserver-addr is given: the
transfer engine (the `remote` extra) loads lazily, in remote.transport."""
