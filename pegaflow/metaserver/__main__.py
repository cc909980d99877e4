"""`python -m pegaflow.metaserver ...`: the same command line as
`pegaflow-metaserver`."""

from pegaflow.metaserver.cli import main

raise SystemExit(main())
