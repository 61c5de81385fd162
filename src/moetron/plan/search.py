"""`moetron plan --search`: every parallel layout of a config on N GPUs, the ones that fit, ranked by step time.

A layout is (tp, sequence parallel, cp, CP attention, pp, pipeline schedule, virtual stages, uneven first/last
stages, ep, etp, ZeRO stage, micro batch, activation checkpointing) at the config's global batch;
dp = gpus / (tp · cp · pp). Enumerated:
  tp       divisors of the GPUs up to the GPUs per node (TP across nodes would put every layer's collectives on
           the slowest link), with and without sequence parallelism, experts whole (etp 1) or split (etp = tp)
  cp       divisors of the remaining GPUs with tp · cp within a node (CP's K/V exchange is per layer, on the
           critical path like TP's), the sequence length a multiple of 2 · cp and at least MIN_CP_TOKENS tokens
           per rank (shorter chunks leave the attention kernels too little work to hide the exchange: the
           long-context regime CP is for); each with --cp-comm-type all_gather, p2p and a2a
  pp       divisors of the remaining GPUs, each with every schedule (`pipeline_options`): 1F1B, GPipe and zero
           bubble with one stage per rank — evenly split, and with the first/last stages' layer counts that
           balance the embedding and the LM head (+ MTP modules) (`balanced_ends`; GPipe only where no even
           split exists) —, interleaved 1F1B with 2–4 and zero bubble with 2 virtual stages per rank
  ep       divisors of every MoE layer's expert count
  ZeRO     stages 0–3
  micro batch   divisors of the global batch per data-parallel rank, smallest first (memory grows with it:
                the first that does not fit ends that layout's list)
  checkpointing off and on
Flags given on the command line (`--tensor-model-parallel-size 1`, `--zero-stage 0`, `--pipeline-schedule gpipe`,
...) fix that dimension; --use-distributed-optimizer is never varied (the command line's value, else the
default). Each row's command is `--config FILE`, the command line's other flags, and the flags that turn the
file's layout into the row's: it runs exactly the config the row planned.
Each candidate goes through `moetron.validate.validate` (the rules and words of `moetron train`; only the checks
of this machine's files aside, as in any plan: `plan.estimate.on_disk_problems`), then the memory plan
(`plan/memory.py`) and the cost model (`plan/cost_model.py`); the ones that fit are ranked by predicted step time.
Variants of one layout that differ only in the pipeline schedule / stage split or the CP attention are pruned
when another variant is at least as fast AND needs no more memory (`prune_dominated`): the table keeps each
layout's best trade-offs, not its every schedule.
"""

from __future__ import annotations

import math
import shlex
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from moetron.config import RunConfig
from moetron.config_cli import field_specs
from moetron.fileio import directories_checked_once
from moetron.model.config import ModelConfig
from moetron.model.flops import (
    attention_params,
    attention_score_flops,
    embedding_params,
    mlp_params,
    moe_layer_params,
    mtp_module_params,
    mtp_module_routed_params,
)
from moetron.parallel.cp.sizes import COMM_TYPES
from moetron.parallel.dimensions import DIMENSIONS
from moetron.parallel.dp.zero_spec import effective_stage
from moetron.parallel.pp.stage_layout import schedule_name
from moetron.parallel.terms.model_cache import model_cache
from moetron.plan.cost_model import DEFAULT_EFFICIENCY, Network, StepCost, step_cost
from moetron.plan.estimate import Plan, layout_problems, make_plan
from moetron.plan.hardware import Accelerator
from moetron.progress import Progress

# Layout fields `structures` enumerates (the command line's flags fix them: `fixed_dimensions`)
STRUCTURE = ("tp", "sp", "cp", "cp_comm", "pp", "schedule", "virtual_layers", "first_layers", "last_layers", "ep",
             "etp", "zero")  # fmt: skip
# Layout fields taken from the command line as given, never varied: {ParallelConfig field: Layout field}
KEPT = {"use_distributed_optimizer": "distributed_optimizer"}
MAX_VIRTUAL = 4  # interleaved schedules tried with 2 .. MAX_VIRTUAL virtual stages per pipeline rank
MIN_CP_TOKENS = 1024  # context parallelism tried only where each rank keeps at least this many tokens
# the variants `prune_dominated` compares: the same layout but for these fields
VARIANT_FIELDS = ("schedule", "virtual_layers", "first_layers", "last_layers", "cp_comm")
# the fields a layout sets, in the order their flags are printed
LAYOUT_FIELDS = (
    ("parallel", "tensor_model_parallel_size"),
    ("parallel", "sequence_parallel"),
    ("parallel", "context_parallel_size"),
    ("parallel", "cp_comm_type"),
    ("parallel", "pipeline_model_parallel_size"),
    ("parallel", "pipeline_schedule"),
    ("parallel", "num_layers_per_virtual_pipeline_stage"),
    ("parallel", "decoder_first_pipeline_num_layers"),
    ("parallel", "decoder_last_pipeline_num_layers"),
    ("parallel", "moe_expert_parallel_size"),
    ("parallel", "expert_tensor_parallel_size"),
    ("parallel", "zero_stage"),
    ("parallel", "use_distributed_optimizer"),
    ("train", "micro_batch_size"),
    ("train", "global_batch_size"),
    ("model", "checkpoint_activations"),
)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    sp: bool = False
    pp: int = 1
    virtual_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage (interleaved 1F1B)
    ep: int = 1
    etp: int = 1
    zero: int = 0
    mbs: int = 1
    ckpt: bool = False
    cp: int = 1  # --context-parallel-size
    cp_comm: str = "all_gather"  # --cp-comm-type
    schedule: str | None = None  # --pipeline-schedule; None: 1F1B, interleaved with virtual stages
    first_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_layers: int | None = None  # --decoder-last-pipeline-num-layers
    distributed_optimizer: bool = False  # --use-distributed-optimizer: at least ZeRO stage 1

    @property
    def stage(self) -> int:
        """The ZeRO stage the run uses."""
        return effective_stage(self.zero, self.distributed_optimizer)

    def apply(self, cfg: RunConfig, global_batch: int, model: ModelConfig | None = None) -> RunConfig:
        """A copy of `cfg` with this layout at `global_batch` (the sections it does not change are shared; `model`:
        `cfg.model` at this layout's checkpointing, to share one object over many layouts)."""
        parallel = replace(
            cfg.parallel,
            tensor_model_parallel_size=self.tp,
            sequence_parallel=self.sp,
            context_parallel_size=self.cp,
            cp_comm_type=self.cp_comm,
            pipeline_model_parallel_size=self.pp,
            num_layers_per_virtual_pipeline_stage=self.virtual_layers,
            pipeline_schedule=self.schedule,
            decoder_first_pipeline_num_layers=self.first_layers,
            decoder_last_pipeline_num_layers=self.last_layers,
            moe_expert_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            zero_stage=self.zero,
            use_distributed_optimizer=self.distributed_optimizer,
        )
        train = replace(cfg.train, micro_batch_size=self.mbs, global_batch_size=global_batch)
        model = model or replace(cfg.model, checkpoint_activations=self.ckpt)
        return RunConfig(model=model, data=cfg.data, parallel=parallel, train=train)

    @property
    def schedule_name(self) -> str:
        return schedule_name(self.schedule, self.virtual_layers)

    def words(self, dp: int) -> str:
        parts = [f"dp{dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else "") + (f" etp{self.etp}" if self.etp > 1 else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}:{self.cp_comm.replace('all_gather', 'ag')}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"×v{self.virtual_layers}L" if self.virtual_layers else ""))
            short = {"1f1b": "", "interleaved-1f1b": "", "gpipe": "gpipe", "zero-bubble": "zb"}
            parts += [short[self.schedule_name]] if short[self.schedule_name] else []
            if self.first_layers is not None or self.last_layers is not None:
                parts.append(f"ends{self.first_layers}/{self.last_layers}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.stage:
            parts.append(f"zero{self.stage}")
        parts.append(f"mbs{self.mbs}")
        if self.ckpt:
            parts.append("ckpt")
        return " ".join(parts)


@dataclass
class Row:
    layout: Layout
    plan: Plan
    cost: StepCost
    flags: list[str]  # what to add to `moetron train --config FILE` to run this layout
    measured: object | None = None  # plan.measure.Measurement, filled by --measure
    predicted_rank: int = 0  # 1 = fastest predicted

    @property
    def words(self) -> str:
        return self.layout.words(self.plan.dims.dp)


@dataclass
class SearchResult:
    rows: list[Row]  # every layout that fits, fastest first
    candidates: int  # layouts enumerated
    valid: int  # of which `validate` accepts
    too_big: int  # valid ones that do not fit
    refusals: Counter = field(default_factory=Counter)  # the first problem of each refused layout
    pruned: int = 0  # fitting schedule / CP-attention variants another variant of the same layout dominates


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_global_batch(cfg: RunConfig, gpus: int) -> int:
    """The global batch every layout keeps: the config's, or its micro batch × its own data-parallel size."""
    if cfg.train.global_batch_size:
        return cfg.train.global_batch_size
    p = cfg.parallel
    model_ranks = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    return cfg.train.micro_batch_size * max(gpus // model_ranks, 1)


Pipeline = tuple[str | None, int | None, int | None, int | None]  # (schedule, virtual layers, first, last)


def pipeline_options(cfg: RunConfig, pp: int) -> list[Pipeline]:
    """The (--pipeline-schedule, --num-layers-per-virtual-pipeline-stage, --decoder-first/last-pipeline-num-layers)
    tried at `pp` stages: one stage per rank under 1F1B (None: the default), GPipe and zero bubble, each split
    evenly (where the layers divide) and with `balanced_ends`; 2..MAX_VIRTUAL stages per rank under interleaved
    1F1B (None: the default with virtual stages) and zero bubble."""
    if pp == 1:
        return [(None, None, None, None)]
    num_layers, out = cfg.model.num_layers, []
    ends = balanced_ends(cfg, pp)
    for schedule in (None, "gpipe", "zero-bubble"):
        out += [(schedule, None, None, None)] if num_layers % pp == 0 else []
        # GPipe split unevenly only where no even split exists: its bubble is 1F1B's, its memory more, so an
        # uneven GPipe row is a dominated 1F1B row wherever 1F1B runs (fewer layouts to price)
        out += [(schedule, None, *ends)] if ends and (schedule != "gpipe" or num_layers % pp) else []
    for v in range(2, MAX_VIRTUAL + 1):
        if num_layers % (pp * v) == 0:
            out += [(None, num_layers // (pp * v), None, None)]
            # zero bubble's bubble is a third of interleaved 1F1B's already at v = 2: more virtual stages buy
            # little and cost more sends (and, past 3 per rank, FSDP re-gathers), so only v = 2 is priced
            out += [("zero-bubble", num_layers // (pp * v), None, None)] if v == 2 else []
    return out


def balanced_ends(cfg: RunConfig, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layer counts that balance the pipeline's ends, or None when the even split is already
    the balanced one. The first stage also holds the embedding (memory: its parameters and their gradients and
    Adam state, no matmul), the last the final norm, the LM head (+ the MTP modules; memory and FLOPs), so each
    end is counted as its layers plus the ends' equivalent in mean layers — by parameters (memory) and by
    training FLOPs per token (time), the larger of the two — and the split with the lightest heaviest stage wins
    (Megatron-Core's reason for `--decoder-first/last-pipeline-num-layers`: the ends are heavier)."""
    model, num_layers = cfg.model, cfg.model.num_layers
    layer_params, layer_flops = _mean_layer(cfg)
    vocab = model.padded_vocab_size() * model.hidden_size
    mtp = model.mtp_num_layers * (mtp_module_params(model) + mtp_module_routed_params(model))
    first = embedding_params(model) - (vocab if model.untie_embeddings_and_output_weights else 0)
    last_params = vocab + mtp + (first if model.mtp_num_layers else 0)  # MTP looks tokens up in the embedding
    last_flops = 6 * (vocab + mtp) + model.mtp_num_layers * attention_score_flops(model, model.seq_length)
    first_eq = first / layer_params
    last_eq = max(last_params / layer_params, last_flops / layer_flops)
    middle = pp - 2
    even = num_layers // pp if num_layers % pp == 0 else None
    even_load = max(even + first_eq, even + last_eq, even) if even is not None else math.inf
    best: tuple[float, int, int, int] | None = None
    for f in range(num_layers + 1):
        for last in range(num_layers + 1 - f):
            rest = num_layers - f - last
            if (middle == 0 and rest) or (middle and (rest < middle or rest % middle)):
                continue
            share = rest // middle if middle else 0
            load = max(f + first_eq, last + last_eq, share)
            key = (round(load, 6), abs(f - last), f, last)
            best = key if best is None or key < best else best
    if best is None or best[0] >= round(even_load, 6):
        return None  # the even split is as balanced (whole layers cannot do better)
    return best[2], best[3]


def _mean_layer(cfg: RunConfig) -> tuple[float, float]:
    """(parameters, training FLOPs per token) of the model's mean transformer layer."""
    model = cfg.model
    experts = model.experts_per_layer()
    params = flops = 0.0
    for e in experts:
        if e > 1:
            routed, other = moe_layer_params(model, e)
            params += attention_params(model) + routed + other
            flops += 6 * (attention_params(model) + routed * model.topk / e + other)
        else:
            params += attention_params(model) + mlp_params(model, model.ffn_size)
            flops += 6 * (attention_params(model) + mlp_params(model, model.ffn_size))
        flops += attention_score_flops(model, model.seq_length)
    return params / len(experts), flops / len(experts)


def cp_options(cfg: RunConfig, ranks: int, within_node: int) -> list[int]:
    """The context-parallel sizes tried on `ranks` GPUs (what TP leaves) with `within_node` of them in a node:
    see the module docstring."""
    seq = cfg.model.seq_length
    return [cp for cp in divisors(ranks) if cp == 1 or (cp <= within_node and seq % (2 * cp) == 0
                                                        and seq // cp >= MIN_CP_TOKENS)]  # fmt: skip


def structures(cfg: RunConfig, gpus: int, per_node: int, fixed: dict) -> Iterator[Layout]:
    """Every (tp, sp, cp, CP attention, pp, schedule, virtual, ends, ep, etp, zero) — micro batch and
    checkpointing are added by `search`."""
    kept = {field: fixed[field] for field in KEPT.values() if field in fixed}
    moe = [e for e in cfg.model.experts_per_layer() if e > 1]
    expert_sizes = divisors(math.gcd(*moe)) if moe else [1]
    wanted = {k: v for k, v in fixed.items() if k in STRUCTURE and k not in ("schedule", "first_layers", "last_layers")}
    ends = (
        {k: fixed.get(k) for k in ("first_layers", "last_layers")}
        if {"first_layers", "last_layers"} & set(fixed)
        else None
    )  # the command line's split, with every one-stage-per-rank schedule (None: balanced_ends too)
    schedule = fixed.get("schedule")
    for tp in divisors(gpus):
        if tp > per_node:
            continue
        cps = [fixed["cp"]] if "cp" in fixed else cp_options(cfg, gpus // tp, per_node // tp)
        for cp in cps:
            if gpus % (tp * cp):
                continue
            for comm in COMM_TYPES if cp > 1 else (fixed.get("cp_comm", cfg.parallel.cp_comm_type),):
                for pp in divisors(gpus // (tp * cp)):
                    options = pipeline_options(cfg, pp)
                    if ends is not None:
                        options = [(sched, None, ends["first_layers"], ends["last_layers"])
                                   for sched in (None, "gpipe", "zero-bubble")] if pp > 1 else options  # fmt: skip
                    for pipe in options:
                        if schedule and pp > 1 and schedule_name(*pipe[:2]) != schedule_name(schedule, pipe[1]):
                            continue
                        pipe = (schedule, *pipe[1:]) if schedule else pipe  # as given (the words of the flag)
                        for sp in (False, True) if tp > 1 else (False,):
                            for etp in sorted({1, tp}):
                                for ep in expert_sizes:
                                    for zero in (0, 1, 2, 3) if gpus > 1 else (0,):
                                        layout = Layout(tp, sp, pp, pipe[1], ep, etp, zero, cp=cp, cp_comm=comm,
                                                        schedule=pipe[0], first_layers=pipe[2], last_layers=pipe[3],
                                                        **kept)  # fmt: skip
                                        if all(getattr(layout, k) == v for k, v in wanted.items()):
                                            if not _same_stage_twice(layout, fixed):
                                                yield layout


def _same_stage_twice(layout: Layout, fixed: dict) -> bool:
    """--use-distributed-optimizer makes --zero-stage 0 and 1 the same run: offer it once (at the stage the
    flag alone means), unless --zero-stage is fixed too."""
    return layout.distributed_optimizer and layout.zero == 1 and "zero" not in fixed


def fixed_dimensions(cfg: RunConfig, names: set[str]) -> dict:
    """The layout dimensions the user fixed with flags (field names given on the command line)."""
    p, out = cfg.parallel, {}
    for name, key in (
        ("tensor_model_parallel_size", "tp"),
        ("sequence_parallel", "sp"),
        ("context_parallel_size", "cp"),
        ("cp_comm_type", "cp_comm"),
        ("pipeline_model_parallel_size", "pp"),
        ("pipeline_schedule", "schedule"),
        ("num_layers_per_virtual_pipeline_stage", "virtual_layers"),
        ("decoder_first_pipeline_num_layers", "first_layers"),
        ("decoder_last_pipeline_num_layers", "last_layers"),
        ("moe_expert_parallel_size", "ep"),
        ("expert_tensor_parallel_size", "etp"),
        ("zero_stage", "zero"),
        *KEPT.items(),
    ):
        if name in names:
            out[key] = getattr(p, name)
    if "micro_batch_size" in names:
        out["mbs"] = cfg.train.micro_batch_size
    if "checkpoint_activations" in names:
        out["ckpt"] = cfg.model.checkpoint_activations
    return out


def field_flags(name: str, value) -> list[str]:
    """`name = value` as `moetron train` reads it from the command line (config_cli: switches with a --no- form,
    lists as several values, None as `none`)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, "none" if value is None else str(value)]


def layout_flags(base: RunConfig, cfg: RunConfig) -> list[str]:
    """The flags that turn `base` (the config file) into `cfg`: only layout fields that differ."""
    flags = []
    for section, name in LAYOUT_FIELDS:
        old, new = getattr(getattr(base, section), name), getattr(getattr(cfg, section), name)
        if old != new:
            flags += field_flags(name, new)
    return flags


def given_flags(cfg: RunConfig, names: set[str]) -> list[str]:
    """The command line's flags other than the layout's (`--bf16`, `--seq-length 2048`, ...), with `cfg`'s values:
    every printed command repeats them, since the rows were planned with them."""
    layout = {name for _, name in LAYOUT_FIELDS}
    specs = field_specs()
    return [
        flag
        for name, spec in specs.items()
        if name in names and name not in layout
        for flag in field_flags(name, getattr(getattr(cfg, spec.section), name))
    ]


def search(cfg: RunConfig, gpus: int, device: Accelerator, net: Network, efficiency: float = DEFAULT_EFFICIENCY,
           fixed: dict | None = None, base: RunConfig | None = None, given: list[str] | None = None,
           prune: bool = True) -> SearchResult:  # fmt: skip
    """Every layout of `cfg` on `gpus` GPUs that fits `device`, fastest first (see the module docstring).

    Each row's flags are `given` (the command line's non-layout flags, `given_flags`) and the layout flags that
    turn `base` (the config file alone, as `moetron train --config` reads it; default `cfg`) into the row's config.
    `prune=False` keeps the dominated schedule / CP-attention variants too (`prune_dominated`).
    """
    with model_cache(), directories_checked_once():  # one model, one set of output directories: asked once
        return _search(cfg, gpus, device, net, efficiency, fixed or {}, base or cfg, given or [], prune)


def _search(cfg: RunConfig, gpus: int, device: Accelerator, net: Network, efficiency: float, fixed: dict,
            base: RunConfig, given: list[str], prune: bool) -> SearchResult:  # fmt: skip
    gbs = search_global_batch(cfg, gpus)
    result = SearchResult([], 0, 0, 0)
    models = {ckpt: replace(cfg.model, checkpoint_activations=ckpt) for ckpt in (False, True)}  # `model_cache` keys
    layouts = list(structures(cfg, gpus, net.gpus_per_node, fixed))  # cheap to list: the total for the progress
    for structure in Progress("plan --search", len(layouts), "layouts").track(layouts):
        dp = gpus // (structure.tp * structure.pp * structure.cp)
        per_rank = gbs // dp if gbs % dp == 0 else 0
        sizes = [(ckpt, mbs) for ckpt in (False, True) for mbs in divisors(per_rank) or [max(gbs // max(dp, 1), 1)]]
        sizes = [(c, m) for c, m in sizes if fixed.get("ckpt", c) == c and fixed.get("mbs", m) == m]
        degrees = set(structure_problems(structure.apply(cfg, gbs), gpus))  # problems whatever the micro batch
        too_big: set[bool] = set()  # checkpointing settings whose micro batches stopped fitting
        for i, (ckpt, mbs) in enumerate(sizes):
            if ckpt in too_big:
                continue  # a larger micro batch needs more memory still
            layout = Layout(**{**structure.__dict__, "mbs": mbs, "ckpt": ckpt})
            result.candidates += 1
            candidate = layout.apply(cfg, gbs, models[ckpt])
            problems = layout_problems(candidate, gpus)  # what `moetron train` refuses: the only refusals
            if problems:
                whole = bool(degrees.intersection(problems))  # for the degrees: so is every micro batch of them
                count = len(sizes) - i if whole else 1
                result.candidates += count - 1
                result.refusals[problems[0]] += count
                if whole:
                    break
                continue
            result.valid += 1
            plan = make_plan(candidate, gpus, device)
            if not plan.fits:
                result.too_big += 1
                too_big.add(ckpt)
                continue
            flags = [*given, *layout_flags(base, candidate)]
            result.rows.append(Row(layout, plan, step_cost(plan, net, efficiency), flags))
    kept = prune_dominated(result.rows) if prune else result.rows
    result.pruned, result.rows = len(result.rows) - len(kept), kept
    result.rows.sort(key=rank_key)
    for i, row in enumerate(result.rows, 1):
        row.predicted_rank = i
    return result


def prune_dominated(rows: list[Row]) -> list[Row]:
    """`rows` less those another variant of the same layout (equal but for `VARIANT_FIELDS`: the schedule, the
    stage split, the CP attention) beats: at most its step time and memory, and better in one (or equal in
    both and earlier: the simpler variant, as `structures` lists them)."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        key = tuple(v for k, v in row.layout.__dict__.items() if k not in VARIANT_FIELDS)
        groups.setdefault(key, []).append(row)
    kept = []
    for group in groups.values():
        for i, row in enumerate(group):
            t, b = round(row.cost.total, 9), row.plan.needed_bytes
            if not any(
                (u := round(o.cost.total, 9)) <= t and o.plan.needed_bytes <= b
                and (u < t or o.plan.needed_bytes < b or j < i)
                for j, o in enumerate(group) if o is not row
            ):  # fmt: skip
                kept.append(row)
    return kept


def structure_problems(cfg: RunConfig, gpus: int) -> list[str]:
    """What the parallel degrees alone would be refused for (the degrees' own checks, every dimension's split and
    the flags the search varies whatever the micro batch, as `validate` reports them), so that a refused layout is
    not re-validated for every micro batch; only once `validate` says so too."""
    dims = cfg.dims(gpus)
    problems = dims.problems(cfg.model.experts_per_layer())
    for dimension in DIMENSIONS:
        problems += dimension.split_problems(cfg, dims)
    for dimension in DIMENSIONS:
        problems += dimension.flag_problems(cfg, dims) if dimension.searched_flags else []
    return problems


def rank_key(row: Row) -> tuple:
    """Fastest first; at equal predicted time the simpler layout (lower ZeRO stage, fewer pipeline and tensor
    ranks), then the larger micro batch (larger matmuls than the model's fixed efficiency credits), then the one
    with more memory to spare."""
    layout = row.layout
    return (round(row.cost.total, 9), layout.stage, layout.pp, layout.tp, -layout.mbs, row.plan.needed_bytes)


def nothing_fits(result: SearchResult, gpus: int, device: Accelerator) -> str:
    """One line saying why no layout is offered, and what to change."""
    if not result.candidates:
        return f"--gpus {gpus}: no layout to try (every dimension is fixed by a flag to values that cannot combine)"
    if not result.valid:
        by_flag: Counter = Counter()  # refusals grouped by the flag they name first
        example: dict[str, str] = {}
        for reason, count in result.refusals.items():
            flag = reason.split()[0]
            by_flag[flag] += count
            example.setdefault(flag, reason.split(";")[0])
        reasons = "; ".join(f"{example[flag]} ({count}×)" for flag, count in by_flag.most_common(3))
        return (
            f"--gpus {gpus}: none of the {result.candidates} layouts is one `moetron train` accepts — try a GPU count "
            f"that the heads, layers, experts and global batch divide (usually a power of two); most common: {reasons}"
        )
    return (
        f"--gpus {gpus}: none of the {result.valid} valid layouts fits {device.memory_bytes / 2**30:.3g} GiB per GPU; "
        "use more GPUs (--gpus), GPUs with more memory (--gpu-memory), or a smaller model or global batch"
    )


def train_command(row: Row, config: str, gpus: int, nodes: int) -> str:
    """The `torchrun ... moetron train` line that runs this row's layout."""
    per_node = gpus // nodes
    if nodes > 1:
        launch = f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500"
    elif gpus > 1:
        launch = f"torchrun --nproc-per-node {gpus}"
    else:
        return shlex.join(["moetron", "train", "--config", config, *row.flags])
    return f"{launch} -m moetron train " + shlex.join(["--config", config, *row.flags])
