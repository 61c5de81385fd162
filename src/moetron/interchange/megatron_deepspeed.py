"""`moetron import --megatron-deepspeed DIR --save OUT`: a Megatron-DeepSpeed MoE checkpoint → a moetron run.

The layout read (DeepSpeed engine checkpoints of Megatron-DeepSpeed's `GPTModel`, `--no-pipeline-parallel`):

    DIR/latest                                              "global_step<N>" (or DIR is global_step<N> itself)
    global_step<N>/mp_rank_<TP>_model_states.pt             'module' (Megatron's nested state dict without the
                                                            experts), 'args', 'iteration', 'tokens', 'lr_scheduler'
    global_step<N>/layer_<M>_expert_<G>_mp_rank_<TP>_model_states.pt    MoE layer M's global expert G
    global_step<N>/expp_rank_<R>_mp_rank_<TP>_optim_states.pt           EP rank R's optimizer (no ZeRO)

The model config comes from `args` (moetron's fields are Megatron's flag names), the weights are re-laid out
(`query_key_value` [Q | K | V] thirds or per-head, `--qkv-layout`; experts stacked `[E, …]`; SwiGLU's fused
`[gate | up]` split), and when optimizer files are there the Adam moments follow the same mapping, so
`moetron train --config OUT/config.yaml --load OUT` continues at the saved iteration, consumed samples and LR
schedule (data order: moetron's indexed datasets equal Megatron's). Tensor-parallel shards (mp_rank_01, …) of the
weights are merged. Not read: ZeRO-partitioned or fp16/bf16-wrapped optimizer state (flat fp32 groups) — the weights
import and `--no-optim` says so; pipeline-parallel (GPTModelPipe) checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from moetron.config import RunConfig
from moetron.config_cli import apply_values, field_specs
from moetron.errors import UserError
from moetron.interchange.mds_optimizer import optimizer_tensors
from moetron.interchange.mds_rotary import choose_rotary
from moetron.interchange.mds_tensors import MDSTensors, moetron_tensors
from moetron.interchange.new_run import Progress, check_new_run_dir, write_run
from moetron.interchange.safe_load import load_pt

# Megatron-DeepSpeed's fused QKV rows: [Q | K | V] thirds since PR #441 (Dec 2024, the FPDT commit); before it, per
# head [q_h | k_h | v_h]. The checkpoint does not say which (both are checkpoint_version 3.0): --qkv-layout does.
QKV_LAYOUTS = ("thirds", "per-head")


@dataclass
class MDSImportResult:
    path: Path
    source: Path  # the global_step directory
    iteration: int
    qkv_layout: str
    with_optimizer: bool
    notes: list[str]
    warnings: list[str] = field(default_factory=list)  # also in notes; the CLI prints them as "warning: …"


def find_step_dir(load: str) -> Path:
    path = Path(load)
    if (path / "mp_rank_00_model_states.pt").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        step = path / latest.read_text().strip()
        if (step / "mp_rank_00_model_states.pt").is_file():
            return step
    steps = sorted(path.glob("global_step*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if steps and (steps[-1] / "mp_rank_00_model_states.pt").is_file():
        return steps[-1]
    if list(path.glob("**/layer_*-model_*-model_states.pt")):
        raise UserError(
            f"--megatron-deepspeed {load}: a pipeline-parallel (GPTModelPipe) checkpoint; only "
            f"--no-pipeline-parallel checkpoints import"
        )
    raise UserError(
        f"--megatron-deepspeed {load}: no mp_rank_00_model_states.pt there or under its `latest`; give "
        f"the run's --save directory or one global_step<N> directory"
    )


def _args(states: dict, where: Path) -> dict:
    args = states.get("args")
    if args is None:
        raise UserError(f"{where}: the checkpoint holds no `args` (saved without Megatron's client state?)")
    return vars(args)


def run_config(args: dict, states: dict, where: Path) -> RunConfig:
    """Megatron's args → a moetron RunConfig: every field of the same name, then the few that differ."""
    specs = field_specs()
    values = {k: v for k, v in args.items() if k in specs and v is not None and k not in ("load", "save")}
    cfg, ignored = RunConfig(), []
    apply_values(cfg, values, "args", ignored)  # a value of another type (an enum, a list for a scalar) is skipped
    m = cfg.model
    problems = []
    if args.get("apply_layernorm_1p") or args.get("apply_residual_connection_post_layernorm"):
        problems.append("--apply-layernorm-1p / --apply-residual-connection-post-layernorm have no moetron equivalent")
    if args.get("enable_expert_tensor_parallelism"):
        problems.append("--enable-expert-tensor-parallelism checkpoints (experts split over TP ranks) do not import")
    if float(args.get("rotary_percent", 1.0)) != 1.0:
        problems.append(f"--rotary-percent {args.get('rotary_percent')} has no moetron equivalent")
    if problems:
        raise UserError(f"{where}: " + "; ".join(problems))
    m.position_embedding_type = "rope" if args.get("use_rotary_position_embeddings") else "learned_absolute"
    m.rotary_base = float(args.get("rope_theta", 10000))
    heads, hidden = m.num_attention_heads, m.hidden_size
    m.kv_channels = None if args.get("kv_channels") in (None, hidden // heads) else int(args["kv_channels"])
    tp = int(args.get("tensor_model_parallel_size", 1))
    m.make_vocab_size_divisible_by = int(args.get("make_vocab_size_divisible_by", 128)) * tp
    info = states.get("universal_checkpoint_info") or {}
    m.vocab_size = int(info.get("original_vocab_size") or args.get("padded_vocab_size") or m.vocab_size)
    padded = int(args.get("padded_vocab_size") or m.padded_vocab_size())
    if m.padded_vocab_size() != padded:
        m.vocab_size, m.make_vocab_size_divisible_by = padded, 1  # keep the embedding's rows whatever the tokenizer
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.train.load = cfg.train.save = None
    return cfg


def import_megatron_deepspeed(
    load: str,
    save: str,
    qkv_layout: str = "thirds",
    no_optim: bool = False,
    allow_pickle: bool = False,
    rope_convert: str = "keep",
) -> MDSImportResult:
    check_new_run_dir(save)
    step = find_step_dir(load)
    states = load_pt(step / "mp_rank_00_model_states.pt", allow_pickle)
    args = _args(states, step)
    layout = qkv_layout
    if layout not in QKV_LAYOUTS:
        raise UserError(f"--qkv-layout {layout!r} is not one of {', '.join(QKV_LAYOUTS)}")
    cfg = run_config(args, states, step)
    rotary = choose_rotary(args, rope_convert, str(step))  # PR #441's rotary: keep it exactly, or convert
    cfg.model.rotary_compat = rotary.rotary_compat
    source = MDSTensors.read(step, states, args, allow_pickle)
    tensors = moetron_tensors(source, cfg.model, layout)
    notes = [
        f"imported by `moetron import --megatron-deepspeed {load}` ({step.name}, iteration "
        f"{states.get('iteration', 0)}, query_key_value layout {layout})"
    ]
    notes += [text for text in (rotary.note, rotary.warning) if text]
    optim = None
    if not no_optim:
        ep_size = cfg.parallel.moe_expert_parallel_size  # from the saved args: how many optimizer files to expect
        optim, why = optimizer_tensors(step, source, cfg.model, layout, allow_pickle, ep_size)
        if optim is None:
            notes.append(f"optimizer state not imported: {why}")
    scheduler = states.get("lr_scheduler") or {}
    progress = Progress(
        iteration=int(states.get("iteration", 0)),
        consumed_samples=int(args.get("consumed_train_samples") or 0),
        consumed_tokens=int(states.get("tokens") or args.get("consumed_train_tokens") or 0),
        scheduler_steps=scheduler.get("num_steps"),
        scheduler_tokens=scheduler.get("num_tokens"),
    )
    if cfg.data.vocab_file and not Path(cfg.data.vocab_file).is_file():
        notes.append(f"the tokenizer files in args ({cfg.data.vocab_file}) are not here: set --vocab-file/--merge-file")
    path = write_run(save, cfg, tensors, notes, progress, optim, source=f"--megatron-deepspeed {load}")
    warnings = [rotary.warning] if rotary.warning else []
    return MDSImportResult(path, step, progress.iteration, layout, optim is not None, notes, warnings)
