"""Copy engines (see pegaflow.copiers.copier)."""
