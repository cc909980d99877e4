"""`python -m pegaflow.metaserver ...`: the same command line as
`pegaflow-metaserver`."""

from .cli import main

raise SystemExit(main())
