"""Rotary position embeddings (RoPE), the "rotate half" layout used by Megatron, Llama and Mixtral.

Shapes: B batch, H heads, T tokens, D head dim. Each head's channels are split into two halves
(x1, x2) = (x[..., :D/2], x[..., D/2:]); channel pair (i, i + D/2) is rotated by the angle
position · base^(-2i/D). The rotation makes q·k depend only on the distance between positions.

The angles are computed on the fly from integer positions (no buffers), so a model built on the meta
device needs nothing re-initialised, and a KV-cached decode step just passes its absolute positions.

`--rotary-compat megatron-deepspeed-441` reproduces checkpoints trained by Megatron-DeepSpeed after its PR #441
(Dec 2024, the FPDT commit): there `RotaryEmbedding` returns the pair [cos(mθ), sin(mθ)], the attention unpacks the
pair as (query frequencies, key frequencies), and `apply_rotary_pos_emb` turns its frequencies into a cos/sin table
that it caches by sequence length alone. So the queries are rotated by the angle cos(mθ) and the keys, hitting that
cache, by the same angle: q·k then depends on cos(m·θ) − cos(n·θ), not on the distance m − n. The models trained
so work only with that function, so moetron offers it as a setting rather than silently computing standard RoPE.
"""

from __future__ import annotations

import torch


def rotary_angles(
    positions_T: torch.Tensor, head_dim: int, base: float, compat: str = "none"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_TD, sin_TD) in fp32 for the given absolute positions (`compat`: `ModelConfig.rotary_compat`)."""
    exponent_F = torch.arange(0, head_dim, 2, device=positions_T.device, dtype=torch.float32) / head_dim
    inv_freq_F = 1.0 / (base**exponent_F)
    angles_TF = positions_T.to(torch.float32)[:, None] * inv_freq_F[None, :]
    angles_TD = torch.cat([angles_TF, angles_TF], dim=-1)
    if compat == "megatron-deepspeed-441":
        # Megatron-DeepSpeed rotated by its cos table taken as angles (see the module docstring); in fp32 this is
        # its function bit for bit. Under --bf16/--fp16 it rounded cos(mθ) to that precision before taking cos/sin.
        angles_TD = angles_TD.cos()
    return angles_TD.cos(), angles_TD.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys; computed in fp32 and returned in the input's dtype."""
    x = x_BHTD.float()
    return (x * cos_TD + _rotate_half(x) * sin_TD).to(x_BHTD.dtype)
