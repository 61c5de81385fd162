"""moetron: train Mixture-of-Experts GPT models on plain PyTorch."""

__version__ = "0.1.0"
