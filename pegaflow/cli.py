"""`python -m pegaflow.cli` and `pegaflow-server`: pegaflow.server.cli."""

from pegaflow.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
