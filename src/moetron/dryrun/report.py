"""The simulated ranks' records merged into one report: the JSON contract, the printed lines, the verdict.

JSON keys (a stable contract):
  device                    "cuda"
  world_size, ranks         the run's world size; the simulated ranks
  peak_bytes                the largest simulated rank's peak (live tensors, as torch.cuda.max_memory_allocated)
  planned_peak_bytes        `moetron plan`'s peak for this layout (its heaviest rank), null where it has none
  peak_by_category          that rank's bytes at its peak: parameters, gradients, optimizer_state, activations,
                            temporaries, buffers, other
  host_reads_per_step       reads of device values on the host in one step
  host_reads_per_moe_layer  of them, the ones inside MoE layers / (local MoE layers x micro-batches)
  host_reads                [{"where": "file:line", "count": n}] per step
  collectives               [{"op", "dtype", "bytes", "count"}] per step (and "where": the first call's place)
  attention_kernels         {"flash", "efficient", "cudnn", "math"}: SDPA calls per step by kernel
Per-step numbers are the last step's (step 2 holds the optimizer's state); over several ranks the largest of each.
Extra keys: peak_at (rank, step, phase, module), fp32_gemms, cpu_ops, per_rank (peak and seconds of each),
gpu_memory_bytes and fits (null without --gpu-memory).
"""

from __future__ import annotations

from collections import Counter

GIB = 1024**3
EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_ERROR = 0, 1, 2


def merge(records: list[dict], world_size: int, planned: float | None, memory: int | None, context: int) -> dict:
    """One report from the ranks' records (none of them failed)."""
    heaviest = max(records, key=lambda r: r["peak_bytes"])
    reads: Counter = Counter()
    for r in records:
        for at, n in r["host_reads"].items():
            reads[at] = max(reads[at], n)
    per_layer = [
        r["moe_layer_reads_per_step"] / (r["local_moe_layers"] * r["micro_batches"])
        for r in records
        if r["local_moe_layers"]
    ]
    collectives: dict = {}
    sites: dict = {}
    for r in records:
        for op, dtype, size, n, at in r["collectives"]:
            collectives[(op, dtype, size)] = max(collectives.get((op, dtype, size), 0), n)
            sites.setdefault((op, dtype, size), at)
    kernels = {k: max(r["attention_kernels"][k] for r in records) for k in heaviest["attention_kernels"]}
    peak = heaviest["peak_bytes"]
    return {
        "device": "cuda",
        "world_size": world_size,
        "ranks": [r["rank"] for r in records],
        "peak_bytes": peak,
        "planned_peak_bytes": None if planned is None else int(planned),
        "peak_by_category": heaviest["peak_by_category"],
        "peak_at": {**heaviest["peak_at"], "rank": heaviest["rank"]},
        "host_reads_per_step": max(r["host_reads_per_step"] for r in records),
        "host_reads_per_moe_layer": max(per_layer, default=0.0),
        "host_reads": [{"where": at, "count": n} for at, n in sorted(reads.items())],
        "collectives": [
            {"op": op, "dtype": dtype, "bytes": size, "count": n, "where": sites[(op, dtype, size)]}
            for (op, dtype, size), n in sorted(collectives.items())
        ],
        "attention_kernels": kernels,
        "fp32_gemms": sorted({(op, at) for r in records for op, at, _ in r["fp32_gemms"]}),
        "cpu_ops": sorted({(op, at) for r in records for op, at, _ in r["cpu_ops"]}),
        "per_rank": [
            {
                "rank": r["rank"],
                "pp_stage": r["pp_stage"],
                "peak_bytes": r["peak_bytes"],
                "build_seconds": round(r["build_seconds"], 2),
                "step_seconds": [round(s, 2) for s in r["step_seconds"]],
            }
            for r in records
        ],  # fmt: skip
        "gpu_memory_bytes": memory,
        "fits": None if memory is None else peak + context <= memory,
    }


def gib(n: float | None) -> str:
    """Bytes in GiB, or in MiB / KiB below one (a tiny config's step)."""
    if n is None:
        return "?"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_report(report: dict, context: int) -> str:
    lines = [
        f"dry run: {len(report['ranks'])} simulated rank(s) {report['ranks']} of {report['world_size']} (fake cuda)"
    ]
    for r in report["per_rank"]:
        steps = ", ".join(f"{s:.1f}" for s in r["step_seconds"])
        lines.append(f"  rank {r['rank']} (stage {r['pp_stage']}): peak {gib(r['peak_bytes'])}; steps {steps} s")
    planned, peak = report["planned_peak_bytes"], report["peak_bytes"]
    ratio = f" (measured / plan {peak / planned:.2f})" if planned else ""
    at = report["peak_at"]
    lines.append(f"peak memory {gib(peak)}, plan {gib(planned)}{ratio}")
    site = f" ({at['where']})" if at.get("where", "?") != "?" else ""
    lines.append(f"  at: rank {at['rank']}, step {at['step']}, {at['phase']} of {at['module'] or 'the model'}{site}")
    for name, n in sorted(report["peak_by_category"].items(), key=lambda kv: -kv[1]):
        if n:
            lines.append(f"  {name:<16} {gib(n)}")
    lines.append(
        f"host reads per step: {report['host_reads_per_step']}; per MoE layer and micro-batch: "
        f"{report['host_reads_per_moe_layer']:g}"
    )
    lines += [f"  {r['where']} ×{r['count']}" for r in report["host_reads"]]
    lines.append(f"collectives per step: {sum(c['count'] for c in report['collectives'])}")
    lines += [f"  {c['op']} {c['dtype']} {c['bytes']:,} B ×{c['count']}  ({c['where']})" for c in report["collectives"]]
    kernels = ", ".join(f"{k} {n}" for k, n in report["attention_kernels"].items())
    lines.append(f"attention kernels per step: {kernels}")
    if report["fp32_gemms"]:
        lines.append("fp32 GEMMs: " + "; ".join(f"{op} at {at}" for op, at in report["fp32_gemms"]))
    if report["cpu_ops"]:
        lines.append("CPU tensors made inside the model: " + "; ".join(f"{op} at {at}" for op, at in report["cpu_ops"]))
    lines.append(verdict(report, context))
    return "\n".join(lines)


# `moetron plan --dry-run`: the plan's memory rows (plan/peak_parts.py, at the peak's moment) and the dry run's
# categories (torch's MemTracker) grouped so that each line compares like with like
BESIDE_PLAN = (  # (label, the plan's rows, the dry run's categories)
    ("parameters (and their copies)", ("weights", "weight_casts", "gathered"), ("parameters",)),
    ("gradients", ("gradients", "ddp_buckets"), ("gradients",)),
    ("optimizer state", ("optimizer",), ("optimizer_state",)),
    ("activations and temporaries", ("activations", "logits", "all_to_all"),
     ("activations", "temporaries", "buffers", "other")),
)  # fmt: skip


def format_beside_plan(held: dict[str, int], report: dict) -> str:
    """The plan's peak and the dry run's, group by group (`held`: the plan's bytes per row at its peak)."""
    ranks = report["ranks"]
    lines = [
        f"plan vs dry run (the real step on fake CUDA devices: rank(s) {ranks} of {report['world_size']})",
        f"  {'':<30} {'plan':>12} {'dry run':>12}",
    ]
    measured = report["peak_by_category"]
    for label, rows, categories in BESIDE_PLAN:
        planned = sum(held.get(r, 0) for r in rows)
        lines.append(f"  {label:<30} {gib(planned):>12} {gib(sum(measured.get(c, 0) for c in categories)):>12}")
    planned, peak = report["planned_peak_bytes"], report["peak_bytes"]
    ratio = f"   (dry run / plan {peak / planned:.2f})" if planned else ""
    lines.append(f"  {'peak':<30} {gib(planned):>12} {gib(peak):>12}{ratio}")
    at = report["peak_at"]
    site = f" ({at['where']})" if at.get("where", "?") != "?" else ""
    lines.append(f"  the dry run's peak: rank {at['rank']}, step {at['step']}, {at['phase']} of "
                 f"{at['module'] or 'the model'}{site}")  # fmt: skip
    kernels = ", ".join(f"{k} {n}" for k, n in report["attention_kernels"].items() if n) or "none"
    lines.append(
        f"  per step: {report['host_reads_per_step']} host read(s) ({report['host_reads_per_moe_layer']:g} per MoE "
        f"layer and micro-batch), {sum(c['count'] for c in report['collectives'])} collective(s), attention "
        f"kernels {kernels}; `moetron dry-run` with the same flags lists them"
    )
    return "\n".join(lines)


def verdict(report: dict, context: int) -> str:
    memory = report["gpu_memory_bytes"]
    if memory is None:
        return "verdict: the step runs on the GPU path; no --gpu-memory given, so no fit verdict"
    word = "fits" if report["fits"] else "does NOT fit"
    return f"verdict: {word} {gib(memory)} (peak {gib(report['peak_bytes'])} + {gib(context)} CUDA context)"


def exit_status(report: dict) -> int:
    return EXIT_DOES_NOT_FIT if report["fits"] is False else EXIT_FITS
