"""`python -m pegaflow.metaserver ...`: the same command line as
`pegaflow-metaserver`."""

from .meta_cli import main

raise SystemExit(main())
