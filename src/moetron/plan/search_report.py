"""`moetron plan --search` output: the ranked table with each row's command, or the same as JSON."""

from __future__ import annotations

from moetron.plan.cost_model import Network, communication_parts
from moetron.plan.hardware import GIB
from moetron.plan.search import Row, SearchResult, train_command

PARTS = ("compute", "bubble", *communication_parts(), "overhead")  # StepCost parts, in the table's order
LABELS = {"overhead": "launch"}  # column heads where the field name is too wide


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.0095 else f"{seconds * 1e3:.1f}" if seconds else "0"


def format_search(result: SearchResult, rows: list[Row], config: str, gpus: int, nodes: int, net: Network,
                  efficiency: float) -> str:  # fmt: skip
    first = rows[0].plan
    device, measured = first.device, any(r.measured is not None for r in rows)
    lines = [
        f"moetron plan --search: {config} on {gpus} × {device.name} ({device.memory_bytes / GIB:.3g} GiB), {net.words}",
        f"  global batch {first.cfg.global_batch(first.dims.dp)} × seq {first.cfg.model.seq_length}; "
        f"{result.candidates} layouts tried, {result.valid} valid, {len(result.rows) + result.pruned} fit"
        + (
            f" ({result.pruned} schedule/CP variants dominated by another of their layout left out)"
            if result.pruned
            else ""
        )
        + "; compute at "
        f"{efficiency:.0%} of {device.peak_tflops:g} peak TFLOP/s; times in ms per step",
        "",
    ]
    head = f"  {'#':>2} {'layout':<38} {'GiB':>6} {'step':>7} " + " ".join(f"{LABELS.get(p, p):>7}" for p in PARTS)
    head += f" {'tok/s':>9} {'MFU':>5}"
    if measured:
        head += f" | {'meas GiB':>8} {'meas ms':>8} {'cpu ms':>7} {'rank':>4}"
        lines[-2] += "; # = predicted rank, rows re-ranked by the measured step time (rank)"
    lines.append(head)
    for row in rows:
        c = row.cost
        line = f"  {row.predicted_rank:>2} {row.words:<38} {row.plan.needed_bytes / GIB:>6.2f} {_ms(c.total):>7} "
        line += " ".join(f"{_ms(c.part(p)):>7}" for p in PARTS)
        line += f" {c.tokens_per_s:>9.0f} {c.mfu(gpus, device.peak_tflops):>5.1%}"
        if measured:
            line += " | " + measured_cells(row)
        lines.append(line)
    lines += ["", "  commands:"]
    lines += [f"  {row.predicted_rank:>2} {train_command(row, config, gpus, nodes)}" for row in rows]
    errors = [(r.predicted_rank, r.measured.error) for r in rows if r.measured is not None and r.measured.error]
    lines += [f"  {i:>2} measuring failed: {error}" for i, error in errors]
    if device.assumed:
        lines.append(f"  device: {device.assumed}")
    return "\n".join(lines)


def measured_cells(row: Row) -> str:
    m = row.measured
    if m is None or m.error:
        return f"{'failed':>8} {'':>8} {'':>7} {'':>4}"
    memory = f"{m.peak_bytes / GIB:.2f}" if m.peak_bytes is not None else "n/a"
    cpu = f"{m.cpu_step_s * 1e3:.0f}" if m.cpu_step_s is not None else "n/a"
    return f"{memory:>8} {m.step_time_s * 1e3:>8.0f} {cpu:>7} {m.rank:>4}"


def search_dict(result: SearchResult, rows: list[Row], config: str, gpus: int, nodes: int, net: Network,
                efficiency: float) -> dict:  # fmt: skip
    return {
        "config": config,
        "gpus": gpus,
        "nodes": nodes,
        "network": {
            "words": net.words,
            "gpus_per_node": net.gpus_per_node,
            "intra_gbps": net.intra.gbps,
            "inter_gbps": net.inter.gbps,
        },
        "efficiency": efficiency,
        "candidates": result.candidates,
        "valid": result.valid,
        "fit": len(result.rows) + result.pruned,
        "pruned": result.pruned,
        "rows": [row_dict(row, config, gpus, nodes) for row in rows],
    }


def row_dict(row: Row, config: str, gpus: int, nodes: int) -> dict:
    layout, d, plan = row.layout, row.plan.dims, row.plan
    return {
        "predicted_rank": row.predicted_rank,
        "layout": {**layout.__dict__, "dp": d.dp, "edp": d.edp},
        "words": row.words,
        "flags": row.flags,
        "command": train_command(row, config, gpus, nodes),
        "global_batch_size": plan.cfg.global_batch(d.dp),
        "needed_bytes": plan.needed_bytes,
        "peak_bytes": plan.memory.peak,
        "memory": plan.memory.to_dict(),
        "step_time_s": row.cost.total,
        "step_parts_s": {p: row.cost.part(p) for p in PARTS},
        "tokens_per_s": row.cost.tokens_per_s,
        "mfu": row.cost.mfu(gpus, plan.device.peak_tflops),
        "measured": None if row.measured is None else row.measured.to_dict(),
    }
