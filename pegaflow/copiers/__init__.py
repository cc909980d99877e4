"""Copy engines (see pegaflow.copiers.base)."""
