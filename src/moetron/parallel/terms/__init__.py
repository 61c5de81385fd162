"""The vocabulary the dimensions' memory and cost terms are written in, below `plan/` that adds them up."""
