"""The run configuration: one flat namespace of Megatron flag names, grouped into four dataclasses.

`RunConfig` = `ModelConfig` (model/config.py) + `DataConfig` (data/config.py) + `ParallelConfig` +
`TrainConfig` (both here). Every field is a YAML key and a CLI flag of the same name (`num_layers` ↔
`--num-layers`); field names are unique across the sections, so a flat YAML file needs no sections (the
loader in `config_cli.py` also accepts `model:` / `data:` / `parallel:` / `train:` blocks).

A leaf: dataclasses and the sizes derived from them, importing only the other sections' dataclasses (and
`ParallelDims`, the layout arithmetic `dims()` returns). The checks live on top of the packages they need, in
`moetron/validate.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetron.data.config import DataConfig
from moetron.model.config import ModelConfig
from moetron.parallel.dims import ParallelDims


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1  # TP degree (Megatron-DeepSpeed's MP_SIZE): heads, MLP and vocabulary split
    sequence_parallel: bool = False  # with TP: norms and dropout on sequence shards (their activations / TP)
    context_parallel_size: int = 1  # CP degree: every sequence split over CP ranks (two zigzag chunks each)
    cp_comm_type: str = "all_gather"  # CP attention: all_gather (K/V gathered) | p2p (ring) | a2a (Ulysses, heads)
    pipeline_model_parallel_size: int = 1  # PP degree: pipeline stages on torch.distributed.pipelining
    pipeline_schedule: str | None = None  # 1f1b | interleaved-1f1b | gpipe | zero-bubble (None: 1f1b / interleaved)
    num_layers_per_virtual_pipeline_stage: int | None = None  # interleaving: layers per virtual stage
    decoder_first_pipeline_num_layers: int | None = None  # uneven split: layers of the first stage (+ embedding)
    decoder_last_pipeline_num_layers: int | None = None  # uneven split: layers of the last stage (+ LM head)
    moe_expert_parallel_size: int = 1  # EP degree: divides data-parallel × tensor-parallel ranks (dp·tp % ep == 0)
    moe_expert_replicas: int = 0  # replica slots per EP rank for hot experts, replanned every step (0: off)
    moe_ep_dispatch: str = "uneven"  # uneven: split sizes read per MoE layer | static: fixed blocks, no host read
    moe_ep_buffer_factor: float = 1.5  # static, dropless: block rows = factor × T·K / EP at first (grown on overflow)
    moe_ep_overlap_chunks: int = 1  # > 1: EP all-to-alls overlap expert compute, in chunks of local experts
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
    optimizer: str = "adam"  # adam (AdamW) | muon: Muon for hidden matrices, AdamW for the rest (train/muon.py)
    muon_momentum: float = 0.95  # Megatron-Core's Muon flags (train/muon.py)
    muon_use_nesterov: bool = True  # Nesterov momentum (Keller Jordan's, Moonlight's; Megatron-Core's default: off)
    muon_num_ns_steps: int = 5  # Newton–Schulz iterations
    muon_scale_mode: str = "spectral"  # spectral | shape_scaling | unit_rms_norm: the update's scale by shape
    muon_extra_scale_factor: float = 0.2  # spectral × 0.2 = Moonlight's AdamW-RMS match: AdamW's --lr carries over
    muon_tp_mode: str = "duplicated"  # duplicated: gather TP shards, orthogonalise whole | blockwise: each shard
    muon_split_qkv: bool = True  # fused QKV: Q, K, V orthogonalised apart (Megatron-Core; --muon-no-split-qkv: whole)

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
    moe_dead_expert_steps: int = 100  # alarm: an expert got no token for this many steps (0: off)
    moe_collapse_entropy: float = 0.5  # alarm: mean routing distribution's entropy below this × log E (0: off)
    moe_aux_hacking_window: int = 100  # alarm: aux loss falls while load imbalance does not improve over it (0: off)
    memory_snapshot_steps: list[int] = field(default_factory=list)  # CUDA allocator snapshots after these iterations

    # ---- checkpoints ----
    save: str | None = None  # checkpoint directory (also the run directory)
    save_interval: int | None = None  # iterations between checkpoints (one is always saved at the end)
    async_save: bool = False  # copy the tensors to CPU and write them in the background while training goes on
    # a periodic save that fails (a full disk): by default the run stops with one line (rc 2), the previous
    # checkpoint intact; with this, it says so and trains on (the final save must still succeed)
    continue_on_save_failure: bool = False
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
        tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
        dp = max(world_size // max(tp * pp * cp, 1), 1)  # the indivisible case is reported by dims.problems()
        ep, etp, sp = p.moe_expert_parallel_size, p.expert_tensor_parallel_size, p.sequence_parallel
        return ParallelDims(world_size=world_size, dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=sp, cp=cp)

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
