"""Expert computation: grouped GEMMs and their kernels."""
