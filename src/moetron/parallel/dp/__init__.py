"""Data parallelism and ZeRO."""
