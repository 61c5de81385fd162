"""The run configuration: one flat namespace of Megatron flag names, grouped into four dataclasses.

`RunConfig` = `ModelConfig` (model/config.py) + `DataConfig` (data/config.py) + `ParallelConfig` +
`TrainConfig` (both here). Every field is a YAML key and a CLI flag of the same name (`num_layers` ↔
`--num-layers`); field names are unique across the sections, so a flat YAML file needs no sections (the
loader in `config_cli.py` also accepts `model:` / `data:` / `parallel:` / `train:` blocks).

`validate(cfg, world_size)` collects every problem of every section before anything is allocated, each
naming the flag, the value(s) and the fix; `check()` raises them together as one `ConfigError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetron.data.config import DataConfig
from moetron.errors import ConfigError
from moetron.fileio import output_dir_problem
from moetron.model.config import ModelConfig
from moetron.parallel.dims import ParallelDims
from moetron.parallel.dp.zero_spec import zero_problems
from moetron.parallel.pp.stage_layout import pipeline_problems
from moetron.parallel.tp.sizes import tensor_parallel_problems
from moetron.train.schedule import DECAY_STYLES


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1  # TP degree (Megatron-DeepSpeed's MP_SIZE): heads, MLP and vocabulary split
    sequence_parallel: bool = False  # with TP: norms and dropout on sequence shards (their activations / TP)
    pipeline_model_parallel_size: int = 1  # PP degree: pipeline stages on torch.distributed.pipelining
    pipeline_schedule: str | None = None  # 1f1b | interleaved-1f1b | gpipe | zero-bubble (None: 1f1b / interleaved)
    num_layers_per_virtual_pipeline_stage: int | None = None  # interleaving: layers per virtual stage
    decoder_first_pipeline_num_layers: int | None = None  # uneven split: layers of the first stage (+ embedding)
    decoder_last_pipeline_num_layers: int | None = None  # uneven split: layers of the last stage (+ LM head)
    moe_expert_parallel_size: int = 1  # EP degree: divides data-parallel × tensor-parallel ranks (dp·tp % ep == 0)
    expert_tensor_parallel_size: int = 1  # 1: experts whole, EP may span TP ranks (folding); = TP: experts split too
    zero_stage: int = 0  # ZeRO, DeepSpeed's zero_optimization.stage: 1 shards Adam state, 2 + gradients, 3 + weights
    use_distributed_optimizer: bool = False  # Megatron's flag: ZeRO stage 1 (when --zero-stage is lower)
    distributed_backend: str | None = None  # None: nccl on GPU, gloo on CPU
    distributed_timeout_minutes: float = 10.0  # how long a collective waits for its peers (fractions allowed)


@dataclass
class TrainConfig:
    # ---- batch and duration: stop at the first of train_iters / train_samples / train_tokens ----
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None: micro_batch_size · data-parallel size (no accumulation)
    train_iters: int | None = None
    train_samples: int | None = None
    train_tokens: int | None = None

    # ---- learning rate (Megatron's OptimizerParamScheduler; see train/schedule.py) ----
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"  # constant | linear | cosine | inverse-square-root
    lr_warmup_tokens: int | None = None  # token-based warmup; wins over step-based ones set alongside it
    lr_decay_tokens: int | None = None  # token-based decay horizon; wins over step-based ones set alongside it
    lr_warmup_iters: int = 0  # a flag for any warmup option replaces all of the YAML's (also for decay, run length)
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None  # of the decay horizon
    lr_decay_iters: int | None = None  # None: train_iters
    lr_decay_samples: int | None = None  # None: train_samples

    # ---- optimizer: AdamW; no decay on biases, norms and other 1-D tensors ----
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still computed and logged)

    # ---- precision ----
    fp16: bool = False  # autocast fp16 + dynamic loss scaling
    bf16: bool = False  # autocast bf16
    initial_loss_scale: float = 2.0**11  # the seed scripts' DeepSpeed fp16 block: 2^11, window 500, hysteresis 2
    loss_scale_window: int = 500
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    max_skipped_steps: int = 10  # stop after this many consecutive NaN/Inf steps

    seed: int = 1234
    compile: bool = False  # torch.compile each transformer block (see moetron/parallel/compile.py)
    fused_cross_entropy: bool = True  # LM head + cross-entropy in token chunks, never materialising [B, T, V] logits

    # ---- logging and evaluation ----
    log_interval: int = 10
    eval_interval: int = 1000  # 0: only the final evaluation
    eval_iters: int = 10  # global batches per evaluation (0: no evaluation)
    output_dir: str | None = None  # run directory when --save is not given
    tensorboard_dir: str | None = None  # TensorBoard event files (Megatron's tag names)
    peak_tflops: float | None = None  # per device, for MFU; None: looked up from the device name

    # ---- checkpoints ----
    save: str | None = None  # checkpoint directory (also the run directory)
    save_interval: int | None = None  # iterations between checkpoints (one is always saved at the end)
    load: str | None = None  # a run directory (its latest checkpoint) or an iter_* directory to resume from
    finetune: bool = False  # load weights only; iteration, optimizer and data position start at 0 (a new --save)
    no_load_optim: bool = False
    no_load_rng: bool = False
    keep_last_n: int = 3
    exit_on_missing_checkpoint: bool = False
    overwrite: bool = False  # start fresh in a --save directory holding another run: delete its checkpoints/logs
    override_opt_param_scheduler: bool = False  # resume with this run's LR flags, not the checkpoint's schedule

    # ---- stopping early (Megatron's flags for SLURM time limits): exit 0, with a checkpoint when --save is given ----
    exit_interval: int | None = None  # stop after the first iteration divisible by this
    exit_duration_in_mins: float | None = None  # stop after this many minutes of training (wall clock)


# What one invocation intends to do with the run directory, not settings of the run: they stay out of the saved
# config.yaml, so that `--config RUN/config.yaml --load RUN --save RUN` continues the run instead of deleting it
# (`overwrite`), restarting it at iteration 0 (`finetune`) or stopping it again (`exit_*`).
RUN_TIME_INTENTIONS = (
    "load",
    "finetune",
    "no_load_optim",
    "no_load_rng",
    "exit_on_missing_checkpoint",
    "overwrite",
    "override_opt_param_scheduler",
    "exit_interval",
    "exit_duration_in_mins",
)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    SECTIONS = ("model", "data", "parallel", "train")

    # ---------------------------------------------------------------- derived sizes
    def dims(self, world_size: int) -> ParallelDims:
        p = self.parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        dp = max(world_size // max(tp * pp, 1), 1)  # the indivisible case is reported by dims.problems()
        ep, etp, sp = p.moe_expert_parallel_size, p.expert_tensor_parallel_size, p.sequence_parallel
        return ParallelDims(world_size=world_size, dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=sp)

    def global_batch(self, dp: int) -> int:
        return self.train.global_batch_size or self.train.micro_batch_size * dp

    def num_micro_batches(self, dp: int) -> int:
        return self.global_batch(dp) // (self.train.micro_batch_size * dp)

    def total_iters(self, dp: int) -> int:
        """Iterations until the first stopping criterion (ceil: the loop runs while below every limit)."""
        gbs, seq = self.global_batch(dp), self.model.seq_length
        limits = []
        if self.train.train_iters is not None:
            limits.append(self.train.train_iters)
        if self.train.train_samples is not None:
            limits.append(math.ceil(self.train.train_samples / gbs))
        if self.train.train_tokens is not None:
            limits.append(math.ceil(self.train.train_tokens / (gbs * seq)))
        return min(limits) if limits else 0

    def run_dir(self) -> str | None:
        return self.train.save or self.train.output_dir


def _positive(p: list[str], t: TrainConfig, names: tuple[str, ...], allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(t, name)
        if value is not None and (value < 0 if allow_zero else value <= 0):
            bound = ">= 0" if allow_zero else "> 0"
            p.append(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def train_problems(cfg: RunConfig, dp: int) -> list[str]:
    """Problems of the training section, in the light of the model and the data-parallel size."""
    t, p = cfg.train, []
    _positive(p, t, ("micro_batch_size", "global_batch_size", "train_iters", "train_samples", "train_tokens"))
    _positive(p, t, ("log_interval", "loss_scale_window", "hysteresis", "keep_last_n", "save_interval"))
    _positive(p, t, ("lr", "min_lr", "weight_decay", "clip_grad", "eval_interval", "eval_iters"), allow_zero=True)
    _positive(p, t, ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_tokens", "max_skipped_steps"), True)
    if t.micro_batch_size > 0 and dp > 0 and t.global_batch_size and t.global_batch_size % (t.micro_batch_size * dp):
        p.append(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size {t.micro_batch_size} "
            f"× data-parallel size {dp} = {t.micro_batch_size * dp}; use a multiple of {t.micro_batch_size * dp}"
        )
    if t.train_iters is None and t.train_samples is None and t.train_tokens is None:
        p.append("no stopping criterion: give --train-iters, --train-samples or --train-tokens")
    if t.lr_decay_style not in DECAY_STYLES:
        p.append(f"--lr-decay-style {t.lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    if t.min_lr > t.lr:
        p.append(f"--min-lr {t.min_lr} is above --lr {t.lr}; lower --min-lr")
    if t.lr_warmup_fraction is not None and not 0.0 <= t.lr_warmup_fraction <= 1.0:
        p.append(f"--lr-warmup-fraction must be in [0, 1], got {t.lr_warmup_fraction}")
    if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
        p.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive; keep one")
    if t.train_iters is not None and (t.lr_decay_samples is not None or t.lr_warmup_samples):
        p.append("--train-iters is iteration-based; use --lr-decay-iters/--lr-warmup-iters, not the -samples forms")
    if t.lr_warmup_tokens and t.lr_decay_tokens is not None and t.lr_decay_tokens < t.lr_warmup_tokens:
        p.append(f"--lr-decay-tokens {t.lr_decay_tokens} is below --lr-warmup-tokens {t.lr_warmup_tokens}")
    if t.fp16 and t.bf16:
        p.append("--fp16 and --bf16 are both set; choose one")
    if t.save_interval is not None and not t.save:
        p.append(f"--save-interval {t.save_interval} is set without --save; add --save DIR or drop the interval")
    if t.finetune and not t.load:
        p.append("--finetune needs --load CHECKPOINT_DIR (the weights to start from)")
    if t.exit_on_missing_checkpoint and not t.load:
        p.append("--exit-on-missing-checkpoint needs --load")
    _positive(p, t, ("exit_interval", "exit_duration_in_mins"))
    if t.peak_tflops is not None and not (t.peak_tflops > 0 and math.isfinite(t.peak_tflops)):
        p.append(
            f"--peak-tflops {t.peak_tflops:g} must be a positive number of TFLOP/s per device (e.g. 989 for an "
            f"H100's bf16), or leave it unset to look it up from the device name"
        )
    return p


def output_problems(cfg: RunConfig) -> list[str]:
    """Output locations that cannot be written (a file in the way, read-only), checked without writing; and a run
    directory holding another run's output (never destroyed unless --overwrite says so)."""
    t = cfg.train
    flags = [("--save", t.save), ("--output-dir", t.output_dir), ("--tensorboard-dir", t.tensorboard_dir)]
    flags.append(("--data-cache-path", cfg.data.data_cache_path))
    problems = [problem for flag, path in flags if (problem := output_dir_problem(flag, path))]
    run_dir_flag = "--save " if t.save else "--output-dir "
    if any(problem.startswith(run_dir_flag) for problem in problems):
        return problems  # a run directory that cannot be used (or even looked at) holds no previous run to protect
    return problems + run_directory_problems(t)


def run_directory_problems(t: TrainConfig) -> list[str]:
    """A run must not destroy a previous run's checkpoints or logs: a new run (no --load inside that directory) is
    refused unless --overwrite says so; --overwrite and --finetune are refused with a --load inside the directory
    (the one would delete the checkpoint it is about to load, the other restart the run at iteration 0 over it)."""
    from moetron.checkpoint.files import previous_run

    flag, run_dir = ("--save", t.save) if t.save else ("--output-dir", t.output_dir)
    if not run_dir:
        return []
    loads_from_it = bool(t.load) and _is_inside(t.load, run_dir)
    if loads_from_it and t.overwrite:
        return [
            f"--overwrite would delete the checkpoint --load {t.load} names (it is inside {flag} {run_dir}); to "
            f"continue the run drop --overwrite (also `overwrite: true` from a --config file: older moetron saved it "
            f"in config.yaml), or give --load and {flag} different directories"
        ]
    if loads_from_it and t.finetune:
        return [
            f"--finetune --load {t.load} with {flag} {run_dir}: --finetune starts a new run at iteration 0, which "
            f"would replace the checkpoints and logs of the run it loads; give a new {flag} (to continue the run "
            f"itself drop --finetune, also `finetune: true` from a --config file: older moetron saved it there)"
        ]
    found = None if t.overwrite else previous_run(run_dir)
    if found is None or loads_from_it:  # nothing there, --overwrite, or resuming the run that lives there
        return []
    resume = f"resume it with --load {run_dir}" if flag == "--save" else f"pass --save {run_dir} --load {run_dir}"
    return [
        f"{flag} {run_dir} already holds another run's output ({found}) that this run would overwrite; {resume}, "
        f"give another {flag}, or pass --overwrite to delete it"
    ]


def _is_inside(path: str, directory: str) -> bool:
    """`path` is `directory` or lies below it (symbolic links resolved)."""
    from pathlib import Path

    path_, directory_ = Path(path).resolve(), Path(directory).resolve()
    return path_ == directory_ or directory_ in path_.parents


def moe_problems(cfg: RunConfig) -> list[str]:
    """MoE settings that have no effect on the model as configured."""
    m = cfg.model
    if m.expert_interval < 1 or any(e > 1 for e in m.experts_per_layer()):
        return []
    if m.topk > 1:
        experts = " ".join(map(str, m.num_experts))
        return [
            f"--topk {m.topk} has no effect: no layer is MoE (--num-experts {experts}, --expert-interval "
            f"{m.expert_interval}, --num-layers {m.num_layers}); give --num-experts N (N >= 2) or drop --topk"
        ]
    return []


def _micro_batches(cfg: RunConfig, dp: int) -> int:
    """Micro-batches per step, 0 when the batch flags are themselves invalid (reported elsewhere)."""
    return cfg.num_micro_batches(dp) if cfg.train.micro_batch_size > 0 and dp > 0 else 0


def validate(cfg: RunConfig, world_size: int) -> list[str]:
    """Every problem of every section, before any process group, data load or allocation."""
    dims = cfg.dims(world_size)
    problems = list(dims.problems(cfg.model.experts_per_layer()))
    problems += cfg.model.problems()
    problems += tensor_parallel_problems(cfg.model, dims)
    problems += cfg.data.problems()
    problems += train_problems(cfg, dims.dp)
    problems += moe_problems(cfg)
    problems += output_problems(cfg)
    problems += zero_problems(cfg.parallel.zero_stage, cfg.parallel.use_distributed_optimizer, dims)
    problems += pipeline_problems(cfg.model.num_layers, cfg.parallel, _micro_batches(cfg, dims.dp), cfg.train.compile)
    backend = cfg.parallel.distributed_backend
    if backend not in (None, "gloo", "nccl"):
        problems.append(f"--distributed-backend {backend!r} is not one of gloo, nccl (or leave it unset: automatic)")
    problems += timeout_problems(cfg.parallel)
    return problems


def timeout_problems(p: ParallelConfig) -> list[str]:
    minutes = p.distributed_timeout_minutes
    if not (minutes > 0 and math.isfinite(minutes)):
        return [f"--distributed-timeout-minutes {minutes:g} must be a positive number of minutes (e.g. 10, or 0.5)"]
    return []


def check(cfg: RunConfig, world_size: int) -> None:
    problems = validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
