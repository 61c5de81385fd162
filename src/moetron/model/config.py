"""Model configuration: every field is named after its Megatron-DeepSpeed flag (`--num-layers` → `num_layers`).
The model section of the run's configuration (`moetron/config.py` is the whole tree: one concept, two levels).

The defaults are Megatron's GPT with DeepSpeed-MoE routing; the "modern" fields express Mixtral /
Qwen-MoE / DeepSeek-style models. `problems()` lists everything wrong at once (as strings naming the
flag, the value and the fix); the top-level config gathers them with the other sections' problems.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("global", "seq", "none")


@dataclass
class RouterConfig:
    """The settings of an MoE router (`moe/routing/router.py`) and the rules they must satisfy. `ModelConfig`
    inherits them, so the flat Megatron-named flags and YAML keys (`--topk`, `--moe-train-capacity-factor`, ...)
    are the model's, and a `ModelConfig` is passed wherever a router wants its config."""

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


# ModelConfig.rotary_compat's values: standard RoPE, or Megatron-DeepSpeed's since its PR #441 (model/rotary.py).
ROTARY_COMPAT = ("none", "megatron-deepspeed-441")
# --rope-type yarn's settings (model/rotary.py): meaningless without it
YARN_SETTINGS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim")  # fmt: skip


@dataclass
class ModelConfig(RouterConfig):
    """The whole model. The routing fields (and `hidden_size`, the gate's input size) come from
    `RouterConfig`, so every router is handed this config as its own."""

    # ---- the dense GPT (Megatron defaults); hidden_size: see RouterConfig ----
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # grouped-query attention; None = one KV head per query head
    kv_channels: int | None = None  # channels per attention head; None: hidden_size / num_attention_heads
    ffn_hidden_size: int | None = None  # None: 4·hidden (GELU) or Megatron's int(8h/3/64)·64 (SwiGLU)
    seq_length: int = 256
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int = 50257  # the tokenizer's vocabulary; the embedding is padded (see padded_vocab_size)
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    normalization: str = "layernorm"  # layernorm | rmsnorm
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope
    rotary_base: float = 10000.0
    # none: standard RoPE | megatron-deepspeed-441: the rotation Megatron-DeepSpeed computes since its PR #441 (queries
    # and keys rotated by the angle cos(mθ), not mθ; see model/rotary.py), for checkpoints trained with it. No
    # transformers class computes it (native export refuses; remote-code export carries it).
    rotary_compat: str = "none"
    # RoPE scaling (Megatron-LM's --rope-type; model/rotary.py): rope = plain | yarn = YaRN's frequencies and attention
    # factor (DeepSeek-V2/V3's context extension); the yarn_* settings below are Megatron-Core's names
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0  # YaRN's context extension factor s
    original_max_position_embeddings: int | None = None  # YaRN: the pretraining length the frequencies were fit to
    beta_fast: float = 32.0  # YaRN: pairs turning more often than this over that length keep their frequency
    beta_slow: float = 1.0  # YaRN: pairs turning less often than this are interpolated (divided by s)
    mscale: float = 1.0  # YaRN's attention factor mscale(s, mscale) / mscale(s, mscale_all_dim) on cos and sin
    mscale_all_dim: float = 0.0  # ... and MLA's softmax scale × mscale(s, mscale_all_dim)² (0: neither)
    swiglu: bool = False  # SwiGLU MLPs instead of GELU
    add_bias_linear: bool = True  # False: no biases in attention and MLP linears (modern models)
    add_qkv_bias: bool = False  # a bias in the QKV projection even without --add-bias-linear (Qwen2)
    qk_layernorm: bool = False  # normalise queries and keys before RoPE (Qwen3, OLMoE; --normalization's kind)
    qk_layernorm_scope: str = "head"  # head: one norm per head (Qwen3) | all_heads: over all heads' channels (OLMoE)
    # multi-head latent attention (DeepSeek-V2/V3, model/mla.py; Megatron-Core's flags): queries from a rank-q latent
    # (or projected directly), keys and values expanded per head from one rank-kv latent that the KV cache holds, and
    # rotary positions on extra per-head query channels and one key shared by all heads (decoupled RoPE)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # the query latent's rank; None or 0: queries projected from the hidden state
    kv_lora_rank: int = 32  # the key/value latent's rank
    qk_head_dim: int = 128  # query/key channels per head without positions
    qk_pos_emb_head_dim: int = 64  # query channels per head with rotary positions; the key's are shared by all heads
    v_head_dim: int = 128  # value channels per head
    untie_embeddings_and_output_weights: bool = False
    checkpoint_activations: bool = False  # recompute each layer in backward

    # ---- which layers are MoE (topk and the routing fields: see RouterConfig) ----
    num_experts: list[int] = field(default_factory=lambda: [1])  # one value, or one per MoE layer (pyramid)
    expert_interval: int = 2  # 1-based layer n is MoE when n % expert_interval == 0
    moe_first_dense_layers: int = 0  # force the first N layers dense (DeepSeek's first_k_dense)
    mlp_type: str = "standard"  # standard | residual (PR-MoE: dense MLP + MoE mixed by a 2-way softmax)
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    num_shared_experts: int = 0  # always-on experts of moe_ffn_hidden_size each (fused into one MLP)
    shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x·w)
    moe_identical_expert_init: bool = False  # DeepSpeed's deep copies: all local experts start identical
    moe_expert_backend: str = "auto"  # auto | grouped_mm | batched | loop

    # ---- multi-token prediction (DeepSeek-V3's sequential MTP modules; Megatron-Core's flags, model/mtp.py) ----
    mtp_num_layers: int = 0  # D modules after the last layer: module k predicts the token k + 1 ahead (training only)
    mtp_loss_scaling_factor: float = 0.1  # the MTP loss added to the LM loss: factor × mean over the D modules
    # each module's layer is a MoE layer like the last main layer (DeepSeek-V3's MTP block; Megatron-Core builds it
    # from the decoder's layer spec); True: a dense layer of --ffn-hidden-size channels instead
    mtp_dense_layers: bool = False

    # ------------------------------------------------------------------ derived values
    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels RoPE rotates: every head channel, or MLA's decoupled positional channels."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:  # Megatron's rule keeps the SwiGLU MLP's parameters close to a 4h GELU MLP's
            return int(8 * self.hidden_size / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_moe_layer_slots(self) -> int:
        return self.num_layers // self.expert_interval

    def experts_per_layer(self) -> list[int]:
        """Experts of each layer (0-based), 1 = dense; Megatron's `get_num_experts_per_layer`."""
        # memoised on the four fields it reads: `plan --search` asks it ~10^6 times for one model
        key = (tuple(self.num_experts), self.num_layers, self.expert_interval, self.moe_first_dense_layers)
        return list(_experts_per_layer(*key))

    def moe_layer_indices(self) -> list[int]:
        return [i for i, e in enumerate(self.experts_per_layer()) if e > 1]

    def mtp_layer_experts(self) -> int:
        """Experts of each MTP module's layer (model/mtp.py): the last main layer's, 1 (dense) with
        --mtp-dense-layers or without MTP."""
        if not self.mtp_num_layers or self.mtp_dense_layers or self.expert_interval < 1:
            return 1
        return self.experts_per_layer()[-1]

    def routed_layer_indices(self) -> list[int]:
        """The MoE layers' indices, the MTP modules' MoE layers included (num_layers + k − 1 for depth k): the rows
        of the per-layer routing statistics (`GPTModel.moe_layers()`)."""
        if self.mtp_layer_experts() == 1:
            return self.moe_layer_indices()
        return self.moe_layer_indices() + list(range(self.num_layers, self.num_layers + self.mtp_num_layers))

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        p: list[str] = []
        if not self.multi_latent_attention and self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            p.append(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; pick a head count that divides it"
            )
        if self.num_attention_heads % self.kv_heads:
            p.append(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-key-value-heads "
                f"{self.kv_heads}; use a divisor of the head count"
            )
        if self.seq_length > self.max_positions:
            p.append(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_positions}; "
                f"raise --max-position-embeddings or lower --seq-length"
            )
        if self.multi_latent_attention:  # its rotary channels are --qk-pos-emb-head-dim (checked there)
            p.extend(self.latent_attention_problems())
        else:
            p.extend(self.unused_latent_sizes())
            if self.position_embedding_type == "rope" and self.head_dim % 2:
                p.append(f"rotary positions need an even head dim, got {self.head_dim}; change --hidden-size")
        if self.rotary_compat != "none" and self.position_embedding_type != "rope":
            p.append(
                f"--rotary-compat {self.rotary_compat} changes rotary embeddings, but --position-embedding-type is "
                f"{self.position_embedding_type!r}; set it to rope or drop --rotary-compat"
            )
        p.extend(self.rope_scaling_problems())
        if self.expert_interval < 1:
            p.append(f"--expert-interval must be >= 1, got {self.expert_interval}")
        slots = self.num_moe_layer_slots() if self.expert_interval >= 1 else 0
        if len(self.num_experts) not in (1, slots):
            p.append(
                f"--num-experts has {len(self.num_experts)} values but --num-layers {self.num_layers} // "
                f"--expert-interval {self.expert_interval} = {slots} MoE layers; give one value or {slots}"
            )
        if any(e < 1 for e in self.num_experts):
            p.append(f"--num-experts values must be >= 1, got {self.num_experts}")
        for name, allowed in [
            ("normalization", ("layernorm", "rmsnorm")),
            ("position_embedding_type", ("learned_absolute", "rope")),
            ("rotary_compat", ROTARY_COMPAT),
            ("rope_type", ("rope", "yarn")),
            ("mlp_type", ("standard", "residual")),
            ("qk_layernorm_scope", ("head", "all_heads")),
            ("moe_expert_backend", ("auto", "grouped_mm", "batched", "loop")),
        ]:
            value = getattr(self, name)
            if value not in allowed:
                flag = "--" + name.replace("_", "-")
                p.append(f"{flag} {value!r} is not one of {', '.join(map(str, allowed))}")
        # The routing rules live with the routing fields: once for the values, once per distinct expert count.
        p.extend(self.routing_problems(sorted({e for e in self.num_experts if e > 1})))
        if self.mtp_num_layers < 0 or self.mtp_num_layers >= self.seq_length:
            p.append(f"--mtp-num-layers must be in [0, --seq-length {self.seq_length}), got {self.mtp_num_layers}")
        if not 0.0 <= self.mtp_loss_scaling_factor < float("inf"):
            p.append(f"--mtp-loss-scaling-factor must be a finite value >= 0, got {self.mtp_loss_scaling_factor}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        return p

    def rope_scaling_problems(self) -> list[str]:
        """What --rope-type yarn needs (rotary positions, a pretraining length, positive sizes); its settings
        changed without it would do nothing."""
        if self.rope_type != "yarn":
            defaults = ModelConfig.__dataclass_fields__
            return [
                f"--{n.replace('_', '-')} {getattr(self, n)} has no effect without --rope-type yarn; add "
                f"--rope-type yarn or drop it"
                for n in YARN_SETTINGS
                if getattr(self, n) != defaults[n].default
            ]
        p: list[str] = []
        if self.position_embedding_type != "rope":
            p.append(
                f"--rope-type yarn scales rotary positions, but --position-embedding-type is "
                f"{self.position_embedding_type!r}; set it to rope"
            )
        if self.rotary_compat != "none":
            p.append(f"--rope-type yarn with --rotary-compat {self.rotary_compat} is not supported; drop one of them")
        if not self.original_max_position_embeddings or self.original_max_position_embeddings < 1:
            p.append(
                "--rope-type yarn needs --original-max-position-embeddings (the length the model was pretrained at, "
                "e.g. 4096 for DeepSeek-V3)"
            )
        for n in ("rotary_scaling_factor", "beta_fast", "beta_slow"):
            if not 0.0 < getattr(self, n) < float("inf"):
                flag = "--" + n.replace("_", "-")
                p.append(f"{flag} must be a finite value > 0 with --rope-type yarn, got {getattr(self, n)}")
        for n in ("mscale", "mscale_all_dim"):
            if not 0.0 <= getattr(self, n) < float("inf"):
                p.append(f"--{n.replace('_', '-')} must be a finite value >= 0, got {getattr(self, n)}")
        return p

    def unused_latent_sizes(self) -> list[str]:
        """MLA sizes changed from their defaults without --multi-latent-attention: they would do nothing."""
        defaults = ModelConfig.__dataclass_fields__
        names = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        return [
            f"--{name.replace('_', '-')} {getattr(self, name)} has no effect without --multi-latent-attention; add "
            f"--multi-latent-attention or drop it"
            for name in names
            if getattr(self, name) != defaults[name].default
        ]

    def latent_attention_problems(self) -> list[str]:
        """What `--multi-latent-attention` needs (model/mla.py): rotary positions, sizes >= 1, no GQA or QKV options."""
        p: list[str] = []
        flag = "--multi-latent-attention"
        if self.position_embedding_type != "rope":
            p.append(
                f"{flag} puts rotary positions on its decoupled channels, but --position-embedding-type is "
                f"{self.position_embedding_type!r}; set it to rope"
            )
        if self.qk_pos_emb_head_dim < 2 or self.qk_pos_emb_head_dim % 2:
            p.append(
                f"--qk-pos-emb-head-dim must be even and >= 2 (RoPE rotates channel pairs), got "
                f"{self.qk_pos_emb_head_dim}"
            )
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} must be >= 1 with {flag}, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 0:
            p.append(f"--q-lora-rank must be >= 0 (0: no query latent), got {self.q_lora_rank}")
        unused = [
            ("num_key_value_heads", self.num_key_value_heads not in (None, self.num_attention_heads)),
            ("kv_channels", self.kv_channels is not None),
            ("add_qkv_bias", self.add_qkv_bias),
            ("qk_layernorm", self.qk_layernorm),
            ("rotary_compat", self.rotary_compat != "none"),
        ]
        for name, given in unused:
            if given:
                p.append(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} has no meaning with {flag} (its head sizes "
                    f"are --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim; its latents have own norms); drop it"
                )
        return p


@functools.lru_cache(maxsize=64)
def _experts_per_layer(num_experts: tuple[int, ...], num_layers: int, interval: int, first_dense: int) -> tuple:
    per_slot = list(num_experts)
    if len(per_slot) == 1:
        per_slot = per_slot * max(1, num_layers // interval)
    out = []
    for layer in range(num_layers):
        n = layer + 1
        is_moe = n % interval == 0 and layer >= first_dense
        out.append(per_slot[(n - 1) // interval] if is_moe else 1)
    return tuple(out)
