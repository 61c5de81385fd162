"""Activation checkpointing: recompute each transformer layer in the backward instead of keeping its activations.

Applied as a switch on the model (`GPTModel.recompute_layers`), which wraps each layer's call in PyTorch's
non-reentrant `torch.utils.checkpoint.checkpoint` (see `GPTModel.run_layer`). Not `checkpoint_wrapper`: that
renames every parameter (`…_checkpoint_wrapped_module…`), and names are the keys of checkpoints, the parameter
registry and initialisation. Non-reentrant checkpointing restores the generator state before recomputing, so
dropout masks and the router's random draws are the same in both passes (each layer runs on its own stream,
`moetron.model.rng`), and MoE layers skip their statistics while recomputing.
"""

from __future__ import annotations

from moetron.model.gpt import GPTModel


def apply_ac(model: GPTModel, enabled: bool) -> None:
    """Recompute every layer in the backward (per-layer "full" checkpointing, Megatron's uniform method)."""
    model.recompute_layers = enabled
