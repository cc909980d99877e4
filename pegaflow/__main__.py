"""`python -m pegaflow ...`: the same command line as `pegaflow-server`
(including `python -m pegaflow status --http-addr HOST:PORT`)."""

from pegaflow.server.cli import main

raise SystemExit(main())
