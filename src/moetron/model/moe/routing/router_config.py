"""`RouterConfig`: the settings of an MoE router, and the rules they must satisfy.

`ModelConfig` inherits these fields, so the flat Megatron-named flags and YAML keys (`--topk`,
`--moe-train-capacity-factor`, …) are unchanged, and a `ModelConfig` is passed wherever a router wants its
config. It imports neither torch nor the router, so `model/config.py` gets the routing problems from here
without the old lazy `config.py` -> `router.py` -> `config.py` import.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("global", "seq", "none")


@dataclass
class RouterConfig:
    hidden_size: int = 256  # the model width (each routed token's size, the gate's input)
    topk: int = 1  # experts per token

    # ---- routing: DeepSpeed semantics by default ----
    moe_train_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True  # --disable-moe-token-dropping sets False (capacity = max load)
    moe_use_rts: bool = True  # random token selection when dropping (DeepSpeed's default)
    moe_noisy_gate_policy: str | None = None  # None | Jitter | RSample
    moe_top2_2nd_expert_sampling: bool = True  # Gumbel-perturbed second choice (DeepSpeed's default)
    moe_loss_coeff: float = 0.1

    # ---- routing: modern options ----
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # True: softmax over the top-k logits only (Mixtral)
    moe_router_topk_renorm: bool | None = None  # None: DeepSpeed's rule (k=1 raw, k>=2 renormalised)
    moe_router_topk_scaling_factor: float = 1.0
    moe_z_loss_coeff: float = 0.0
    moe_aux_loss_type: str = "global"  # global (DeepSpeed) | seq (per-sequence) | none
    moe_router_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing by a selection-only expert bias
    num_expert_groups: int = 1  # group-limited routing (DeepSeek-V3): the experts form this many groups
    topk_groups: int = 1  # with --num-expert-groups: a token picks experts only from its best topk_groups groups

    @property
    def uses_generic_path(self) -> bool:
        """True when a modern option changes selection or weights, so DeepSpeed's gating no longer applies."""
        return (
            self.moe_router_score_function != "softmax"
            or self.moe_router_pre_softmax
            or self.moe_router_topk_renorm is not None
            or self.moe_router_topk_scaling_factor != 1.0
            or self.moe_router_bias_update_rate > 0
            or self.num_expert_groups > 1
        )

    def routing_problems(self, expert_counts: Iterable[int] = ()) -> list[str]:
        """Everything wrong with these settings, for MoE layers of each of `expert_counts` experts: one
        message per problem, naming the flag, the value and the fix. Checks of the values alone run once."""
        p = self._value_problems()
        for count in expert_counts:
            p.extend(self._layer_problems(count))
        return p

    def _value_problems(self) -> list[str]:
        p: list[str] = []
        for name, allowed in [
            ("moe_noisy_gate_policy", NOISY_GATE_POLICIES),
            ("moe_router_score_function", SCORE_FUNCTIONS),
            ("moe_aux_loss_type", AUX_LOSS_TYPES),
        ]:
            value = getattr(self, name)
            if value not in allowed:
                p.append(f"--{name.replace('_', '-')} {value!r} is not one of {', '.join(map(str, allowed))}")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            p.append("--moe-router-pre-softmax needs --moe-router-score-function softmax; drop one of the two")
        if self.moe_router_bias_update_rate < 0:
            p.append(f"--moe-router-bias-update-rate must be >= 0, got {self.moe_router_bias_update_rate}")
        if self.moe_min_capacity < 0:
            p.append(f"--moe-min-capacity must be >= 0, got {self.moe_min_capacity}")
        return p

    def _layer_problems(self, num_experts: int) -> list[str]:
        """Settings that cannot work for a layer of `num_experts` experts."""
        p: list[str] = []
        if not 1 <= self.topk <= num_experts:
            p.append(f"--topk {self.topk} must be between 1 and the layer's {num_experts} experts")
        groups = self.num_expert_groups
        if groups > 1:
            if num_experts % groups:
                p.append(f"--num-expert-groups {groups} does not divide the layer's {num_experts} experts")
            elif self.topk > self.topk_groups * (num_experts // groups):
                p.append(
                    f"--topk {self.topk} exceeds the experts reachable in --topk-groups {self.topk_groups} groups "
                    f"of {num_experts // groups}; raise --topk-groups or lower --topk"
                )
        return p
