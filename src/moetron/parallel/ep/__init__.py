"""Expert parallelism."""
