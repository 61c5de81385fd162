"""What every transformers class moetron exports to has in common: `Architecture` (the base each class in
`hf_architectures.py` and `hf_gpt2.py` derives from), `Tokens`, and the MoE checks they share. A module of its own
so that the registry (`hf_architectures.architectures()`) can import every class without a circle."""

from __future__ import annotations

from dataclasses import dataclass

from moetron.interchange.hf_tensor_rules import Rule
from moetron.model.config import ModelConfig
from moetron.model.moe.routing.generic_gating import renormalises


@dataclass(frozen=True)
class Tokens:
    """Special tokens of the exported tokenizer (None when it has none)."""

    bos: int | None = None
    eos: int | None = None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class Architecture:
    name = ""
    hf_class = ""
    model_type = ""

    def problems(self, cfg: ModelConfig) -> list[str]:
        raise NotImplementedError

    def hf_config(self, cfg: ModelConfig, tokens: Tokens) -> dict:
        raise NotImplementedError

    def model_fields(self, hf: dict) -> dict:
        raise NotImplementedError

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        raise NotImplementedError

    def import_rules(self, cfg: ModelConfig, hf: dict) -> list[Rule]:
        """The rules that read the checkpoint `hf` (its config.json) describes: `rules`, unless a layout choice of
        the checkpoint (DeepSeek-V3's RoPE order) changes them."""
        return self.rules(cfg)

    def need(self, cfg: ModelConfig, field: str, wanted, problems: list[str]) -> None:
        value = getattr(cfg, field)
        if value != wanted:
            problems.append(f"{flag(field)} {value!r} has no {self.hf_class} equivalent (it needs {wanted!r})")


# ---------------------------------------------------------------------------- routing, shared by the MoE classes
def normalised_weights(cfg: ModelConfig) -> bool:
    """Whether each token's kept expert weights sum to one (pre-softmax, or renormalised top-k)."""
    return cfg.moe_router_pre_softmax or renormalises(cfg, cfg.topk)


def routing_problems(arch: Architecture, cfg: ModelConfig, sigmoid: bool) -> list[str]:
    """What the class's router (dropless softmax or sigmoid top-k) cannot do that this config does."""
    p: list[str] = []
    if cfg.moe_token_dropping:
        p.append(
            f"--moe-token-dropping (capacity factor {cfg.moe_eval_capacity_factor} in eval) has no {arch.hf_class} "
            f"equivalent: transformers routes dropless; export --dropless for the dropless model"
        )
    if not cfg.uses_generic_path and cfg.topk == 2 and cfg.moe_top2_2nd_expert_sampling:
        p.append(
            f"--moe-top2-2nd-expert-sampling (DeepSpeed's random second expert, also in eval) has no "
            f"{arch.hf_class} equivalent; train with --disable-moe-top2-2nd-expert-sampling"
        )
    arch.need(cfg, "moe_router_score_function", "sigmoid" if sigmoid else "softmax", p)
    if not sigmoid:
        arch.need(cfg, "moe_router_topk_scaling_factor", 1.0, p)
        arch.need(cfg, "num_expert_groups", 1, p)
        arch.need(cfg, "moe_router_bias_update_rate", 0.0, p)
    return p


def experts_of(cfg: ModelConfig) -> int:
    """The (single) expert count of the MoE layers; 0 when dense."""
    counts = {e for e in cfg.experts_per_layer() if e > 1}
    return counts.pop() if len(counts) == 1 else (0 if not counts else -1)


def moe_layout_problems(arch: Architecture, cfg: ModelConfig, placement: str) -> list[str]:
    """placement: "every" (all layers MoE), "interval" (Qwen's decoder_sparse_step + mlp_only_layers), "first_k"."""
    p: list[str] = []
    if experts_of(cfg) < 1:
        p.append(f"--num-experts {cfg.num_experts}: {arch.hf_class} needs one expert count for every MoE layer")
        return p
    if placement == "every" and any(e == 1 for e in cfg.experts_per_layer()):
        p.append(
            f"{arch.hf_class} has a MoE block in every layer; this config has dense layers "
            f"(--expert-interval {cfg.expert_interval}, --moe-first-dense-layers {cfg.moe_first_dense_layers})"
        )
    if placement == "first_k":
        arch.need(cfg, "expert_interval", 1, p)
    arch.need(cfg, "mlp_type", "standard", p)
    return p
