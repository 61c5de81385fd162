"""The plan as a readable table (`moetron plan`) or as JSON (`moetron plan --json`)."""

from __future__ import annotations

from moetron.model.kv_cache import kv_cache_bytes_per_token
from moetron.parallel.dp.memory import describe
from moetron.plan import lm_head
from moetron.plan.advice import Suggestion
from moetron.plan.estimate import Plan
from moetron.plan.hardware import GIB, with_article
from moetron.plan.peak_parts import held_at_peak, overlap_note
from moetron.plan.stages import pipeline_dict, pipeline_words, stage_lines

MEMORY_ROWS = [  # (MemoryEstimate field, label)
    ("weights", "weights (fp32; also the master copy{sharded_weights})"),
    ("gradients", "gradients (fp32{sharded_gradients})"),
    ("ddp_buckets", "DDP gradient buckets (fp32)"),
    ("optimizer", "{optimizer_state} (fp32{sharded_optimizer})"),
    ("weight_casts", "{dtype} copies of the matmul weights"),
    ("gathered", "{gathered}"),
    ("activations", "activations ({activations})"),
    ("logits", "{lm_loss}"),
    ("all_to_all", "all-to-all send/receive buffers"),
]


OPTIMIZER_STATE = {  # --optimizer → what its state row holds (parallel/terms/optimizer_state.py)
    "adam": "Adam moments exp_avg + exp_avg_sq",
    "muon": "Muon momentum + Adam moments of the rest",
}


def precision(plan: Plan) -> str:
    t = plan.cfg.train
    return "fp16" if t.fp16 else "bf16" if t.bf16 else "fp32"


def zero_labels(plan: Plan) -> dict[str, str]:
    """What the ZeRO stage shards, for the memory rows' labels."""
    stage = plan.memory.zero_stage
    shard = ", sharded"
    return {
        "sharded_weights": shard if stage >= 2 else "",
        "sharded_gradients": shard if stage >= 2 else "",
        "sharded_optimizer": shard if stage >= 1 else "",
        "gathered": describe(stage, precision(plan)) if stage else "",
    }


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def describe_model(plan: Plan) -> str:
    m = plan.cfg.model
    moe = [e for e in m.experts_per_layer() if e > 1]
    experts = "dense" if not moe else f"{len(moe)} MoE layers of {'/'.join(map(str, sorted(set(moe))))} experts"
    extra = ", residual (PR-MoE)" if moe and m.mlp_type == "residual" else ""
    top = f", top-{m.topk}" if moe else ""
    return (
        f"{human(plan.params.total)} parameters, {human(plan.params.active)} active per token "
        f"({m.num_layers} layers, hidden {m.hidden_size}, {experts}{top}{extra})"
    )


def describe_layout(plan: Plan) -> str:
    d, t = plan.dims, plan.cfg.train
    local = [e // d.ep for e in plan.cfg.model.num_experts if e > 1]
    split = f", each split over {d.etp} TP ranks" if d.etp > 1 else ""
    experts = f" ({'/'.join(map(str, sorted(set(local))))} experts per GPU{split})" if local else ""
    tensor = f", tensor parallel {d.tp}" + (" + sequence parallel" if d.sp else "") if d.tp > 1 else ""
    stage = plan.memory.zero_stage
    zero = f", ZeRO stage {stage} (dense state 1/{d.dp}, expert state 1/{d.edp} per GPU)" if stage else ""
    pipeline = f", {pipeline_words(plan)}" if d.pp > 1 else ""
    context = f", context parallel {d.cp} (seq {plan.cfg.model.seq_length // d.cp} per GPU)" if d.cp > 1 else ""
    return (
        f"{plan.gpus} GPU(s): data parallel {d.dp}{tensor}{context}, expert parallel {d.ep}{experts}{zero}{pipeline}; "
        "micro batch "
        f"{t.micro_batch_size} × {plan.accumulation_steps} accumulation step(s) × {d.dp} = global batch "
        f"{plan.cfg.global_batch(d.dp)}, seq {plan.cfg.model.seq_length}"
    )


def memory_lines(plan: Plan) -> list[str]:
    m, mem = plan.cfg.model, plan.memory
    ckpt = ", checkpointed" if m.checkpoint_activations else ""
    fill = {
        "dtype": precision(plan),
        "activations": f"micro batch {plan.cfg.train.micro_batch_size} × seq {m.seq_length // plan.dims.cp}{ckpt}",
        "tokens": plan.cfg.train.micro_batch_size * m.seq_length // plan.dims.cp,
        "lm_loss": lm_head.describe(plan.cfg, plan.device.kind, plan.dims),
        "optimizer_state": OPTIMIZER_STATE[plan.cfg.train.optimizer],
        **zero_labels(plan),
    }
    lines = [f"  {'memory per GPU':<52} {'GiB':>8}"]
    for name, label in MEMORY_ROWS:
        value = getattr(mem, name)
        if value:
            lines.append(f"  {label.format(**fill):<52} {gib(value):>8}")
    if plan.device.context_bytes:
        lines.append(f"  {'CUDA context and library workspaces (typical)':<52} {gib(plan.device.context_bytes):>8}")
    lines += stage_lines(plan)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    room = plan.device.memory_bytes - plan.needed_bytes
    lines.append(f"  {f'needed at the peak ({mem.phase})':<52} {gib(plan.needed_bytes):>8}")
    note = overlap_note(mem, gib, plan.device.context_bytes)  # the rows: each term at its largest; the peak: a moment
    lines += [note] if note else []
    lines.append(
        f"  {'available on ' + with_article(plan.device.name):<52} {gib(plan.device.memory_bytes):>8}   → {verdict} "
        f"({gib(abs(room))} GiB {'free' if room >= 0 else 'short'})"
    )
    return lines


def milliseconds(seconds: float) -> str:
    """A step time as `plan --search` prints it: whole milliseconds (tenths below 10 ms)."""
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def step_time_line(plan: Plan) -> str:
    """The step time with its parts, priced as `plan --search` prices the same layout (`cost_model.step_cost`)."""
    cost = plan.cost
    if cost is None:  # a plan made without pricing (a library call of make_plan): compute at the assumed MFU
        return f"  step time  ~{milliseconds(plan.step_time_s)} for {human(plan.tokens_per_step)} tokens (compute only)"
    parts = [("compute", cost.compute), ("bubble", cost.bubble), *cost.communication.items(), ("launch", cost.overhead)]
    shown = ", ".join(f"{name} {milliseconds(t)}" for name, t in parts if t)
    mfu = cost.mfu(plan.gpus, plan.device.peak_tflops)
    return (
        f"  step time  ~{milliseconds(plan.step_time_s)} for {human(plan.tokens_per_step)} tokens ({shown}; matmuls at "
        f"{plan.efficiency:.0%} of {plan.device.peak_tflops:g} peak TFLOP/s, --efficiency; MFU {mfu:.1%}; as "
        f"`plan --search` prices this layout)"
    )


def format_plan(plan: Plan, suggestions: list[Suggestion], source: str = "", larger: Suggestion | None = None) -> str:
    t = plan.cfg.train
    title = f"moetron plan{': ' + source if source else ''} on {plan.gpus} × {plan.device.name}"
    lines = [
        title,
        f"  model      {describe_model(plan)}",
        f"  layout     {describe_layout(plan)}",
        f"  precision  {precision(plan)}"
        + ("" if precision(plan) == "fp32" else f" autocast; fp32 weights, grads and {t.optimizer.capitalize()}"),
        f"  FLOPs      {human(plan.flops_per_token)} per token (6·active + attention, forward + backward)",
        f"  KV cache   {kv_cache_words(plan)}",
        *([f"  device     {plan.device.assumed}"] if plan.device.assumed else []),
        "",
        *memory_lines(plan),
        "",
        step_time_line(plan),
    ]
    if t.train_iters or t.train_tokens:
        lines.append(f"  run        ~{human(plan.cfg.total_iters(plan.dims.dp))} steps ≈ {_duration(plan)}")
    if plan.tp_comm_bytes:
        lines.append(
            f"  TP comm    ~{gib(plan.tp_comm_bytes)} GiB sent per GPU per step to its {plan.dims.tp - 1} "
            "tensor-parallel peer(s) (all-reduces / all-gathers of activations: keep TP within NVLink)"
        )
    if larger is not None:
        lines.append(
            f"  headroom   micro batch {larger.plan.cfg.train.micro_batch_size} still fits "
            f"({gib(larger.plan.needed_bytes)} GiB): {larger.flags}"
        )
    if not plan.fits:
        lines += ["", *suggestion_lines(plan, suggestions)]
    return "\n".join(lines)


def kv_cache_words(plan: Plan) -> str:
    """Generation's KV cache in bf16: per token of context, and for one sequence of --seq-length."""
    m = plan.cfg.model
    per_token = kv_cache_bytes_per_token(m, 2)
    kind = "latent + shared rotary key" if m.multi_latent_attention else "keys + values"
    return (
        f"{human(per_token)}B per token of context in bf16 ({kind}, {m.num_layers} layers), "
        f"{gib(per_token * m.seq_length)} GiB per sequence of {m.seq_length} (generation)"
    )


def _duration(plan: Plan) -> str:
    seconds = plan.cfg.total_iters(plan.dims.dp) * plan.step_time_s
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def suggestion_lines(plan: Plan, suggestions: list[Suggestion]) -> list[str]:
    if not suggestions:
        replicated = plan.memory.weights + plan.memory.gradients + plan.memory.optimizer
        return [
            "  no change tried fits (more expert or tensor parallelism or GPUs, a smaller micro batch, checkpointing, "
            f"bf16, ZeRO stages, and all of them together); in this layout the fp32 weights, gradients and Adam "
            f"state alone take {gib(replicated)} GiB per GPU. Use GPUs with more memory, more GPUs with tensor "
            "parallelism (--tensor-model-parallel-size, within a node), or a smaller model."
        ]
    lines = ["  changes that fit (needed GiB per GPU, step time):"]
    for s in suggestions:
        lines.append(
            f"    {s.change}: {gib(s.plan.needed_bytes)} GiB, ~{milliseconds(s.plan.step_time_s)}  →  {s.flags}"
        )
    return lines


def step_parts(plan: Plan) -> dict[str, float] | None:
    cost = plan.cost
    if cost is None:
        return None
    return {"compute": cost.compute, "bubble": cost.bubble, **cost.communication, "launch": cost.overhead}


def plan_dict(plan: Plan, suggestions: list[Suggestion], source: str = "", larger: Suggestion | None = None) -> dict:
    d = plan.dims
    return {
        "config": source,
        "gpus": plan.gpus,
        "device": {
            "name": plan.device.name,
            "memory_bytes": plan.device.memory_bytes,
            "peak_tflops": plan.device.peak_tflops,
            "context_bytes": plan.device.context_bytes,
            "assumed": plan.device.assumed,
        },
        "parallel": {"dp": d.dp, "ep": d.ep, "tp": d.tp, "pp": d.pp},
        "pipeline": pipeline_dict(plan),
        "tensor_parallel": {
            "sequence_parallel": d.sp,
            "expert_tensor_parallel_size": d.etp,
            "comm_bytes_per_step": plan.tp_comm_bytes,
        },
        "precision": precision(plan),
        "micro_batch_size": plan.cfg.train.micro_batch_size,
        "global_batch_size": plan.cfg.global_batch(d.dp),
        "accumulation_steps": plan.accumulation_steps,
        "seq_length": plan.cfg.model.seq_length,
        "parameters": {"total": plan.params.total, "active": plan.params.active, "per_gpu": plan.local.total},
        "flops_per_token": plan.flops_per_token,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(plan.cfg.model, 2),
        "memory": plan.memory.to_dict(),
        "memory_at_peak": held_at_peak(plan.memory),  # each row's bytes at the peak's moment: they add up to it
        "needed_bytes": plan.needed_bytes,
        "fits": plan.fits,
        "step_time_s": plan.step_time_s,
        "step_parts_s": step_parts(plan),
        "efficiency": plan.efficiency,
        "suggestions": [
            {
                "change": s.change,
                "flags": s.flags,
                "needed_bytes": s.plan.needed_bytes,
                "step_time_s": s.plan.step_time_s,
            }
            for s in suggestions
        ],
        "largest_micro_batch": larger.plan.cfg.train.micro_batch_size if larger else None,
    }
