"""`--scale-down`: one recipe, shrunk in one step to a model that trains on a CPU in seconds.

    cfg, explicit = load_config("gpt-1.3B-moe128", cli_overrides(args))
    scale_down(cfg, explicit, on_gpu=False)   # 24 layers × 2048 × 128 experts → 4 layers × 64 × 8 experts

A recipe is written for its cluster: shrinking it flag by flag meets one warning at a time (a token warmup longer
than the run, a decay horizon of 300B tokens, fp16 on a CPU, an expert-parallel size of 64 on one process, a
vocabulary of the wrong tokenizer). Here every value that has to move moves together, so that the result is a
coherent small run of the same kind: the same layer pattern (which layers are MoE, a pyramid's small-then-large
expert counts, shared experts, the router and its options), at a width, depth, batch and length that one CPU trains
in seconds, with a schedule that warms up and decays within the run and fp32 on a CPU.

Values given on the command line always win: `--scale-down --train-iters 200` trains 200 iterations, and a flag of
one of the warmup / decay / run-length groups keeps that whole group as given. What changed is recorded in
`explicit.scaled` ({name: (recipe value, new value)}) for the startup banner.
"""

from __future__ import annotations

import math

from moetron.config import RunConfig
from moetron.parallel.dims import runnable_expert_parallel

HIDDEN, HEADS, SEQ = 64, 4, 64
MICRO_BATCH, GLOBAL_BATCH = 4, 8  # 2 accumulation steps on one process: the accumulation path runs too
ITERS, WARMUP_ITERS = 20, 2  # warmup: a tenth of the run (2 when the run is given in samples or tokens)
LOG_INTERVAL, EVAL_INTERVAL, EVAL_ITERS = 5, 10, 2
MAX_EXPERTS = 8  # a layer's expert count after scaling; smaller counts shrink by the same factor
LR, MIN_LR = 2e-3, 2e-4  # a 64-wide model learns at the quickstart's rate, not at a 1.3B model's
MOE_SLOTS = 2  # MoE layers kept: a pyramid keeps its first and last expert count

# Groups of options that say one thing in different units (as in config_cli.EXCLUSIVE_GROUPS): a flag for any of
# them keeps the whole group as the user gave it.
WARMUP = ("lr_warmup_tokens", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction")
DECAY = ("lr_decay_tokens", "lr_decay_iters", "lr_decay_samples")
RUN_LENGTH = ("train_iters", "train_samples", "train_tokens")


def scale_down(cfg: RunConfig, explicit: set[str], on_gpu: bool, world_size: int = 1) -> dict[str, tuple]:
    """Shrink `cfg` in place (flags in `explicit.cli` are kept); returns {name: (old, new)} of what changed, also
    stored as `explicit.scaled`. `on_gpu`: keep the recipe's fp16/bf16 (on a CPU they only slow the run down).
    `world_size`: the processes of the run (torchrun's), over which the recipe's expert parallelism is kept where
    it can run and the global batch is sized."""
    given = set(getattr(explicit, "cli", explicit))
    old = _snapshot(cfg)
    _shrink_model(cfg, given)
    _shrink_parallel(cfg, given, world_size)
    _shrink_run(cfg, given, on_gpu, world_size)
    if "vocab_size" not in given:
        _drop_from_yaml(explicit, "vocab_size")  # the tokenizer sizes the vocabulary (a recipe's 50257 is GPT-2's)
    new = _snapshot(cfg)
    changed = {name: (old[name], new[name]) for name in new if old[name] != new[name]}
    if hasattr(explicit, "cli"):
        explicit.scaled = changed
    return changed


def describe(changed: dict[str, tuple]) -> str:
    """One line: what --scale-down changed, `name old→new` each."""
    if not changed:
        return "--scale-down changed nothing (every value it sets was given on the command line)"
    parts = ", ".join(f"{name} {_show(a)}→{_show(b)}" for name, (a, b) in changed.items())
    return f"--scale-down changed {parts} (flags given on the command line are kept)"


# ---------------------------------------------------------------------------- the sections
def _set(section, name: str, value, given: set[str]) -> None:
    if name not in given:
        setattr(section, name, value)


def _shrink_model(cfg: RunConfig, given: set[str]) -> None:
    m = cfg.model
    ratio_ffn = m.ffn_hidden_size / m.hidden_size if m.ffn_hidden_size else None
    ratio_moe_ffn = m.moe_ffn_hidden_size / m.hidden_size if m.moe_ffn_hidden_size else None
    queries_per_kv = m.num_attention_heads // m.kv_heads if m.num_key_value_heads else None
    is_moe = any(e > 1 for e in m.num_experts)
    _set(m, "hidden_size", HIDDEN, given)
    _set(m, "num_attention_heads", HEADS, given)
    if queries_per_kv:
        _set(m, "num_key_value_heads", max(1, m.num_attention_heads // queries_per_kv), given)
    if m.kv_channels:
        _set(m, "kv_channels", m.hidden_size // m.num_attention_heads, given)
    if ratio_ffn:
        _set(m, "ffn_hidden_size", _multiple_of_8(ratio_ffn * m.hidden_size), given)
    if ratio_moe_ffn:
        _set(m, "moe_ffn_hidden_size", _multiple_of_8(ratio_moe_ffn * m.hidden_size), given)
    _set(m, "seq_length", SEQ, given)
    if m.max_position_embeddings:
        _set(m, "max_position_embeddings", m.seq_length, given)
    _set(m, "checkpoint_activations", False, given)  # nothing to save at this size; recomputing only costs time
    if m.multi_latent_attention:  # the latents and per-head sizes shrink with the width (a DeepSeek-V2-Lite ratio)
        head = m.hidden_size // m.num_attention_heads
        if m.q_lora_rank:
            _set(m, "q_lora_rank", m.hidden_size // 2, given)
        _set(m, "kv_lora_rank", m.hidden_size // 2, given)
        _set(m, "qk_head_dim", head, given)
        _set(m, "qk_pos_emb_head_dim", max(2, head // 2), given)
        _set(m, "v_head_dim", head, given)
    if is_moe:
        _shrink_moe(cfg, given)
    else:
        _set(m, "num_layers", 2, given)


def _shrink_moe(cfg: RunConfig, given: set[str]) -> None:
    """Layers: the first dense layer (if the recipe has any) and MOE_SLOTS MoE slots of the recipe's interval;
    experts: at most MAX_EXPERTS per layer, a pyramid's counts divided by one factor; top-k below the expert count."""
    m = cfg.model
    first_dense = min(m.moe_first_dense_layers, 1)
    _set(m, "moe_first_dense_layers", first_dense, given)
    _set(m, "num_layers", first_dense + MOE_SLOTS * m.expert_interval, given)
    slots = max(1, m.num_layers // m.expert_interval)
    counts = m.num_experts if len(m.num_experts) == 1 else _resample(m.num_experts, slots)
    factor = math.ceil(max(counts) / MAX_EXPERTS)
    _set(m, "num_experts", [e if e <= 1 else max(2, e // factor) for e in counts], given)
    moe = [e for e in m.num_experts if e > 1]
    if moe:  # sparse routing still: at most half the experts of the smallest layer (top-8 of 128 → top-4 of 8)
        _set(m, "topk", min(m.topk, max(1, min(moe) // 2)), given)
        _shrink_expert_groups(cfg, moe, given)
    _set(m, "num_shared_experts", min(m.num_shared_experts, 1), given)


def _shrink_expert_groups(cfg: RunConfig, moe_counts: list[int], given: set[str]) -> None:
    """Group-limited routing (DeepSeek-V3): the groups must still divide every layer's experts, and the chosen groups
    hold top-k's experts (more groups chosen where the shrunk groups are too small: top-k itself is kept)."""
    m = cfg.model
    if m.num_expert_groups <= 1:
        return
    groups = math.gcd(m.num_expert_groups, *moe_counts)
    _set(m, "num_expert_groups", groups, given)
    reaching_topk = math.ceil(m.topk / (min(moe_counts) // groups))  # the groups top-k's experts need
    _set(m, "topk_groups", max(1, min(max(m.topk_groups, reaching_topk), m.num_expert_groups)), given)


def _shrink_parallel(cfg: RunConfig, given: set[str], world_size: int) -> None:
    """Data parallelism over the processes, and the recipe's expert parallelism where it divides them and the
    scaled expert counts (else the largest size that does: EP 64 on 2 processes runs EP 2); every other degree
    back to 1."""
    p = cfg.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        _set(p, name, 1, given)
    if "moe_expert_parallel_size" not in given:
        counts = [e for e in cfg.model.experts_per_layer() if e > 1]
        replicas = world_size // p.context_parallel_size if world_size % p.context_parallel_size == 0 else 1
        p.moe_expert_parallel_size = runnable_expert_parallel(p.moe_expert_parallel_size, replicas, counts)
    _set(p, "expert_tensor_parallel_size", 1, given)
    _set(p, "sequence_parallel", False, given)
    for name in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers"):
        _set(p, name, None, given)
    _set(p, "decoder_last_pipeline_num_layers", None, given)
    _set(p, "pipeline_schedule", None, given)
    _set(p, "zero_stage", 0, given)
    _set(p, "use_distributed_optimizer", False, given)


def _shrink_run(cfg: RunConfig, given: set[str], on_gpu: bool, world_size: int) -> None:
    t = cfg.train
    _set(t, "micro_batch_size", MICRO_BATCH, given)
    # the smallest multiple of one micro-batch per data-parallel rank that holds GLOBAL_BATCH samples
    dp = max(1, world_size // cfg.parallel.context_parallel_size)
    per_step = t.micro_batch_size * dp
    _set(t, "global_batch_size", per_step * math.ceil(GLOBAL_BATCH / per_step), given)
    if not given & set(RUN_LENGTH):
        t.train_iters, t.train_samples, t.train_tokens = ITERS, None, None
    if not given & set(WARMUP):  # a tenth of the run, in iterations: nothing token-based shadows it
        t.lr_warmup_tokens, t.lr_warmup_samples, t.lr_warmup_fraction = None, 0, None
        t.lr_warmup_iters = WARMUP_ITERS if t.train_iters is None else max(1, t.train_iters // 10)
    if not given & set(DECAY):  # decay over the run itself, down to --min-lr
        t.lr_decay_tokens, t.lr_decay_iters, t.lr_decay_samples = None, None, None
    _set(t, "lr", LR, given)
    _set(t, "min_lr", min(MIN_LR, t.lr), given)
    if not on_gpu:
        _set(t, "fp16", False, given)
        _set(t, "bf16", False, given)
    _set(t, "log_interval", LOG_INTERVAL, given)
    _set(t, "eval_interval", EVAL_INTERVAL, given)
    _set(t, "eval_iters", EVAL_ITERS, given)
    _set(t, "save_interval", None, given)  # one checkpoint, at the end
    if t.save and "save" not in given:  # never into the full-size run's directory
        t.save = f"{t.save.rstrip('/')}-scaled-down"
    if t.tensorboard_dir and "tensorboard_dir" not in given and cfg.run_dir():  # inside the run, not the cwd
        t.tensorboard_dir = f"{cfg.run_dir().rstrip('/')}/tensorboard"


# ---------------------------------------------------------------------------- helpers
def _resample(values: list[int], count: int) -> list[int]:
    """`count` values spread evenly over `values` (first and last kept): a pyramid keeps its shape."""
    if count == 1:
        return [values[-1]]
    return [values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)]


def _multiple_of_8(size: float) -> int:
    return max(8, int(round(size / 8)) * 8)


def _drop_from_yaml(explicit: set[str], name: str) -> None:
    explicit.discard(name)
    getattr(explicit, "yaml", set()).discard(name)


def _snapshot(cfg: RunConfig) -> dict[str, object]:
    out = {}
    for section in RunConfig.SECTIONS:
        out |= {k: v for k, v in vars(getattr(cfg, section)).items()}
    return out


def _show(value) -> str:
    if value is None:  # a field scale-down cleared (the recipe's token horizons, its save interval): not "None"
        return "unset"
    if isinstance(value, list):
        return "/".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
