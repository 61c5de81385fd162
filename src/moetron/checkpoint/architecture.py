"""Whether `--load` may put a checkpoint's weights into this run's model: its saved config against the run's.

Tensor shapes alone cannot tell. A checkpoint of 2 layers loads into 1 (the MoE layer silently dropped), learned
positions into rope (the table ignored), layernorm into rmsnorm (the biases ignored), 4 heads of 4 channels into 8
heads of 2 (same widths, another attention). So every `ModelConfig` field is classified, and a test enumerates the
fields so that a new one has to be:

  FUNCTION   what the weights compute (sizes, norms, positions, biases, which layers are MoE, how the router
             scores and picks experts): a difference is refused, with --finetune too.
  TRAINING   how they are trained, not what they compute (dropout, sequence length, capacity and token dropping,
             routing noise, the auxiliary losses, the expert-bias update rate): refused on a resume, which continues
             the same run exactly; allowed with --finetune, a new training phase that starts from the weights.
  FREE       how the same computation is carried out (activation recompute, the expert kernels) or how weights are
             initialised (the checkpoint replaces them): always allowed.

Values given differently are compared as the model uses them, so `--ffn-hidden-size 64` matches a checkpoint saved
with the default 4·hidden = 64, and `--num-experts 2 2` matches `--num-experts 2` over two MoE layers; a default that
follows another setting (the ffn size of --swiglu, the head size of --num-attention-heads) is not named beside it.
Learned positions add one rule of their own: the position table (`--max-position-embeddings`, default
`--seq-length`) is part of the function. The layout (the parallel section), the batch and the schedule are not model
fields: they may always change.

    problems = checkpoint_model_problems(cfg)   # reads the checkpoint's config.yaml; [] without --load
    problems = load_problems(saved.model, cfg.model, "runs/moe", finetune=False, config_path="runs/moe/.../config.yaml")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from moetron.checkpoint.files import resolve_checkpoint
from moetron.errors import UserError
from moetron.model.config import YARN_SETTINGS, ModelConfig, RouterConfig

if TYPE_CHECKING:
    from moetron.config import RunConfig

FUNCTION, TRAINING, FREE = "function", "training", "free"

KINDS: dict[str, str] = {
    # ---- the dense GPT
    "hidden_size": FUNCTION,
    "num_layers": FUNCTION,
    "num_attention_heads": FUNCTION,
    "num_key_value_heads": FUNCTION,
    "kv_channels": FUNCTION,
    "ffn_hidden_size": FUNCTION,
    "vocab_size": FUNCTION,
    "make_vocab_size_divisible_by": FUNCTION,
    "layernorm_epsilon": FUNCTION,
    "normalization": FUNCTION,
    "position_embedding_type": FUNCTION,
    "rotary_base": FUNCTION,
    "rotary_compat": FUNCTION,  # Megatron-DeepSpeed PR #441 angles: another function of the same weights
    # YaRN: the same weights at other frequencies. A context extension is a training phase of its own (DeepSeek's:
    # pretrain plain, then a --finetune with --rope-type yarn), so: refused on a resume, allowed with --finetune
    "rope_type": TRAINING,
    **dict.fromkeys(YARN_SETTINGS, TRAINING),
    "swiglu": FUNCTION,
    "add_bias_linear": FUNCTION,
    "add_qkv_bias": FUNCTION,
    "qk_layernorm": FUNCTION,
    "qk_layernorm_scope": FUNCTION,
    "multi_latent_attention": FUNCTION,
    "q_lora_rank": FUNCTION,
    "kv_lora_rank": FUNCTION,
    "qk_head_dim": FUNCTION,
    "qk_pos_emb_head_dim": FUNCTION,
    "v_head_dim": FUNCTION,
    "untie_embeddings_and_output_weights": FUNCTION,
    "seq_length": TRAINING,  # the samples' length; a learned table's size has a rule of its own (FUNCTION_RULES)
    "max_position_embeddings": TRAINING,  # with rope: only the longest input allowed
    "hidden_dropout": TRAINING,
    "attention_dropout": TRAINING,
    "init_method_std": FREE,
    "checkpoint_activations": FREE,
    # ---- which layers are MoE, and their experts
    "num_experts": FUNCTION,
    "expert_interval": FUNCTION,
    "moe_first_dense_layers": FUNCTION,
    "mlp_type": FUNCTION,
    "moe_ffn_hidden_size": FUNCTION,
    "num_shared_experts": FUNCTION,
    "shared_expert_gate": FUNCTION,
    "moe_identical_expert_init": FREE,
    "moe_expert_backend": FREE,
    "mtp_num_layers": FUNCTION,  # the MTP modules' weights (generation ignores them; training needs them)
    "mtp_loss_scaling_factor": TRAINING,
    "mtp_dense_layers": FUNCTION,  # the MTP layers' MLP: MoE (like the last layer) or dense
    # ---- routing: how experts are scored and picked (function), how many tokens they take and how routing is
    # trained (training); capacity only drops tokens, it does not change what a kept token computes
    "topk": FUNCTION,
    "moe_router_score_function": FUNCTION,
    "moe_router_pre_softmax": FUNCTION,
    "moe_router_topk_renorm": FUNCTION,
    "moe_router_topk_scaling_factor": FUNCTION,
    "num_expert_groups": FUNCTION,
    "topk_groups": FUNCTION,
    "moe_train_capacity_factor": TRAINING,
    "moe_eval_capacity_factor": TRAINING,
    "moe_min_capacity": TRAINING,
    "moe_token_dropping": TRAINING,
    "moe_use_rts": TRAINING,
    "moe_noisy_gate_policy": TRAINING,
    "moe_top2_2nd_expert_sampling": TRAINING,
    "moe_loss_coeff": TRAINING,
    "moe_z_loss_coeff": TRAINING,
    "moe_aux_loss_type": TRAINING,
    "moe_router_bias_update_rate": TRAINING,  # whether the learned expert bias is used at all: FUNCTION (below)
}


def _experts(m: ModelConfig) -> tuple:
    """`--num-experts 2 2` and `--num-experts 2` are the same model."""
    values = tuple(m.num_experts)
    return values[:1] if len(set(values)) == 1 else values


LATENT_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def _latent(name: str) -> Callable[[ModelConfig], object]:
    """An MLA size means nothing without --multi-latent-attention; --q-lora-rank 0 and none are the same model."""
    return lambda m: (getattr(m, name) or None) if m.multi_latent_attention else None


def _yarn(name: str) -> Callable[[ModelConfig], object]:
    """A YaRN setting means nothing without --rope-type yarn."""
    return lambda m: getattr(m, name) if m.rope_type == "yarn" else None


# Values as the model uses them (defaults resolved; None: the field does not apply to that model), compared when
# the values given differ; fields not listed compare as given.
EFFECTIVE: dict[str, Callable[[ModelConfig], object]] = {
    "num_key_value_heads": lambda m: m.kv_heads,
    "kv_channels": lambda m: m.head_dim,
    "ffn_hidden_size": lambda m: m.ffn_size,
    "moe_ffn_hidden_size": lambda m: m.expert_ffn_size if m.moe_layer_indices() else None,
    "make_vocab_size_divisible_by": lambda m: m.padded_vocab_size(),
    "rotary_base": lambda m: m.rotary_base if m.position_embedding_type == "rope" else None,
    "rotary_compat": lambda m: m.rotary_compat if m.position_embedding_type == "rope" else None,
    "qk_layernorm_scope": lambda m: m.qk_layernorm_scope if m.qk_layernorm else None,
    **{name: _yarn(name) for name in YARN_SETTINGS},
    "num_experts": _experts,
    **{name: _latent(name) for name in LATENT_SIZES},
    "max_position_embeddings": lambda m: m.max_positions,
    "mtp_dense_layers": lambda m: m.mtp_layer_experts() == 1 if m.mtp_num_layers else None,
}

# Rules on values derived from several fields, for fields that are not FUNCTION themselves; None: not applicable.
FUNCTION_RULES: dict[str, Callable[[ModelConfig], object]] = {
    # learned positions: the table's size is part of the model (rope has no table)
    "max_position_embeddings": lambda m: m.max_positions if m.position_embedding_type == "learned_absolute" else None,
    "moe_router_bias_update_rate": lambda m: m.moe_router_bias_update_rate > 0,  # a learned expert bias picks experts
}


# Shown as given: their effective value is not what the flag takes.
SHOWN_AS_GIVEN = ("num_experts", "make_vocab_size_divisible_by")


# The router's settings mean nothing to a model without MoE layers (and a model with them differs in other fields).
ROUTING = {f.name for f in dataclasses.fields(RouterConfig)} - {"hidden_size"}


def _compared(saved: ModelConfig, run: ModelConfig, name: str) -> bool:
    return name not in ROUTING or bool(saved.moe_layer_indices() and run.moe_layer_indices())


def _value(m: ModelConfig, name: str) -> object:
    return EFFECTIVE[name](m) if name in EFFECTIVE else getattr(m, name)


def _differs(saved: ModelConfig, run: ModelConfig, name: str) -> bool:
    if not _compared(saved, run, name):
        return False
    a, b = _value(saved, name), _value(run, name)
    if name in EFFECTIVE and (a is None or b is None or getattr(saved, name) == getattr(run, name)):
        return False  # not given differently, or not applicable: the difference that causes it is named instead
    return a != b


def _function_rule_differs(saved: ModelConfig, run: ModelConfig, name: str) -> bool:
    rule = FUNCTION_RULES.get(name)
    if rule is None or not _compared(saved, run, name):
        return False
    a, b = rule(saved), rule(run)
    return a is not None and b is not None and a != b


def differences(saved: ModelConfig, run: ModelConfig, kind: str) -> list[str]:
    """The fields whose difference between the two configs is of `kind` (FUNCTION or TRAINING), in field order."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    function = [
        n for n in names if (KINDS[n] == FUNCTION and _differs(saved, run, n)) or _function_rule_differs(saved, run, n)
    ]
    if kind == FUNCTION:
        return function
    return [n for n in names if KINDS[n] == kind and n not in function and _differs(saved, run, n)]


def flag_value(m: ModelConfig, name: str) -> str:
    """`--name value` as a user would type it (the value the model uses where a default stands in)."""
    flag = "--" + name.replace("_", "-")
    value = getattr(m, name) if name in SHOWN_AS_GIVEN else _value(m, name)
    if value is None:
        return f"{flag} unset"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    if isinstance(value, list | tuple):
        return f"{flag} {' '.join(map(str, value))}"
    if name == "max_position_embeddings" and m.max_position_embeddings is None:
        return f"{flag} {value} (--seq-length's)"  # the default the user never typed
    return f"{flag} {value}"


def _settings(m: ModelConfig, names: list[str]) -> str:
    return " ".join(flag_value(m, name) for name in names)


def load_problems(saved: ModelConfig, run: ModelConfig, load: str, finetune: bool, config_path: str) -> list[str]:
    """Why this run may not load a checkpoint saved with `saved` (each kind of difference one line), or []."""
    problems = []
    names = differences(saved, run, FUNCTION)
    if names:
        problems.append(
            f"--load {load}: the checkpoint was trained with {_settings(saved, names)}; this run has "
            f"{_settings(run, names)}, another model that its weights do not fit; pass the checkpoint's values "
            f"(or --config {config_path})"
        )
    names = [] if finetune else differences(saved, run, TRAINING)
    if names:
        problems.append(
            f"--load {load}: a resume continues the checkpoint's training, which used {_settings(saved, names)}; "
            f"this run has {_settings(run, names)}; pass the checkpoint's values (or --config {config_path}), "
            f"or add --finetune to train its weights with new settings from iteration 0"
        )
    return problems


def checkpoint_model_problems(cfg: RunConfig) -> list[str]:
    """The checkpoint `--load` names against this run's model, before anything is built. Nothing to compare (no
    --load, no checkpoint there yet, a checkpoint without a config.yaml): []; the tensor shapes are still checked
    when the weights are read."""
    from moetron.config_cli import load_config

    load = cfg.train.load
    if not load:
        return []
    try:
        path = resolve_checkpoint(load)
    except UserError as err:
        return [str(err)]
    config_path = path / "config.yaml" if path is not None else None
    if config_path is None or not config_path.is_file():
        return []
    try:
        saved, _ = load_config(str(config_path), {})
    except UserError as err:
        why = str(err).splitlines()[-1].strip(" -")
        return [f"--load {load}: its {config_path} cannot be read ({why}); --load another checkpoint"]
    return load_problems(saved.model, cfg.model, load, cfg.train.finetune, str(config_path)) + optimizer_problems(
        saved.train.optimizer, cfg.train, load
    )


def optimizer_problems(saved_optimizer: str, train, load: str) -> list[str]:
    """The optimizer state of a checkpoint saved with another `--optimizer` (AdamW's moments, Muon's momentum) does
    not fit this run's optimizer; the weights do."""
    if saved_optimizer == train.optimizer or train.no_load_optim or train.finetune:
        return []
    return [
        f"--load {load} was saved with --optimizer {saved_optimizer}, this run uses --optimizer {train.optimizer}: its "
        f"optimizer state does not fit; resume with --optimizer {saved_optimizer}, or add --no-load-optim to start "
        f"the optimizer fresh (or --finetune)"
    ]
