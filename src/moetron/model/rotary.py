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

YaRN (`--rope-type yarn`, Peng et al. 2023, arXiv 2309.00071; DeepSeek-V2/V3's context extension) rescales the
frequencies: with D rotary channels, pair i's wavelength λ_i = 2π·base^(2i/D) is compared with the pretraining length
L (`--original-max-position-embeddings`). Pairs turning more than `--beta-fast` times over L keep their frequency
(extrapolation), pairs turning fewer than `--beta-slow` times are divided by `--rotary-scaling-factor` s
(interpolation), and a linear ramp over the pair index blends the two between (the index bounds floored / ceiled, as
transformers' `truncate` default and Megatron-Core do). cos and sin are multiplied by the attention factor
mscale(s, `--mscale`) / mscale(s, `--mscale-all-dim`), mscale(s, m) = 0.1·m·ln s + 1 (1 for s <= 1): with both on
the rotated q and k that scales the positional part of the scores. Multi-head latent attention also multiplies its
softmax scale by mscale(s, `--mscale-all-dim`)² (`yarn_softmax_factor`; DeepSeek's correction, Megatron-Core's MLA,
transformers' `yarn_apply_mscale`). The formulas are transformers' `_compute_yarn_parameters`, so imported models
keep their logits (tests/unit/test_hf_deepseek_v3.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetron.model.config import ModelConfig


@dataclass(frozen=True)
class Yarn:
    """YaRN's settings (`yarn_of(cfg)`; the module docstring): Megatron-Core's names."""

    factor: float  # --rotary-scaling-factor
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    def inverse_frequencies(self, pos_freqs_F: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
        """The blended inverse frequencies of the pairs whose plain ones are `1 / pos_freqs_F`."""

        def correction_dim(rotations: float) -> float:  # the pair index turning `rotations` times over L
            length = self.original_max_position_embeddings
            return head_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), head_dim - 1)
        high = high + 0.001 if low == high else high  # no division by zero (transformers does the same)
        index_F = torch.arange(head_dim // 2, device=pos_freqs_F.device, dtype=torch.float32)
        extrapolated_F = 1 - torch.clamp((index_F - low) / (high - low), 0, 1)  # 1: keep the frequency
        return (1.0 / (self.factor * pos_freqs_F)) * (1 - extrapolated_F) + (1.0 / pos_freqs_F) * extrapolated_F


def yarn_of(cfg: ModelConfig) -> Yarn | None:
    """YaRN's settings of a model with --rope-type yarn, else None."""
    if cfg.rope_type != "yarn":
        return None
    return Yarn(
        cfg.rotary_scaling_factor,
        cfg.original_max_position_embeddings or 0,
        cfg.beta_fast,
        cfg.beta_slow,
        cfg.mscale,
        cfg.mscale_all_dim,
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(factor) + 1 (1 when the factor does not extend the context)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_factor(yarn: Yarn | None) -> float:
    """What multi-head latent attention multiplies its softmax scale by (1 without YaRN or --mscale-all-dim)."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    return yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def rotary_angles(
    positions_T: torch.Tensor, head_dim: int, base: float, compat: str = "none", yarn: Yarn | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_TD, sin_TD) in fp32 for the given absolute positions (`compat`: `ModelConfig.rotary_compat`; `yarn`:
    YaRN's frequencies and attention factor, see the module docstring)."""
    exponent_F = torch.arange(0, head_dim, 2, device=positions_T.device, dtype=torch.float32) / head_dim
    pos_freqs_F = base**exponent_F
    inv_freq_F = 1.0 / pos_freqs_F if yarn is None else yarn.inverse_frequencies(pos_freqs_F, head_dim, base)
    angles_TF = positions_T.to(torch.float32)[:, None] * inv_freq_F[None, :]
    angles_TD = torch.cat([angles_TF, angles_TF], dim=-1)
    if compat == "megatron-deepspeed-441":
        # Megatron-DeepSpeed rotated by its cos table taken as angles (see the module docstring); in fp32 this is
        # its function bit for bit. Under --bf16/--fp16 it rounded cos(mθ) to that precision before taking cos/sin.
        angles_TD = angles_TD.cos()
    factor = 1.0 if yarn is None else yarn.attention_factor()
    if factor != 1.0:
        return angles_TD.cos() * factor, angles_TD.sin() * factor
    return angles_TD.cos(), angles_TD.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys; computed in fp32 and returned in the input's dtype."""
    x = x_BHTD.float()
    return (x * cos_TD + _rotate_half(x) * sin_TD).to(x_BHTD.dtype)
