"""`python -m pegaflow.demo`: two engines share one server (single_node), or
two nodes share through a metaserver (`--nodes 2`, nodes)."""
