"""Pipeline parallelism."""
