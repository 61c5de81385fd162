"""Peak memory of this rank's device, for the log line and metrics.jsonl, and PyTorch's allocator snapshots.

CUDA: `torch.cuda.max_memory_allocated` (what tensors held at the peak) and `max_memory_reserved` (what the caching
allocator took from the driver: what `nvidia-smi` shows), both since the start of the run. They are counters of the
allocator read on the host: no device synchronisation, and they are read only when a log line is written. CPU: the
process's peak resident set (`process_memory.py`: VmHWM, this process's own; the interpreter and libraries
included, so on small models it is mostly not tensors); no reserved figure. The log line is rank 0's (its device);
`moetron plan` predicts the heaviest rank's peak, which the startup banner prints beside (`planned_line`). On CPU
the process's peak RSS before the model is built (`startup_baseline`: the interpreter, torch's libraries, the
process groups; about 0.3 GiB, which no tensor accounting holds) is logged beside it (`baseline_memory_gib`), so
that measured − baseline is what compares with the plan: `mem 0.52 GiB RSS (plan 0.16 + 0.29 at start)`.

`--memory-snapshot-steps N …`: on CUDA the allocator records every allocation's stack from the start
(`torch.cuda.memory._record_memory_history`) and after each listed iteration writes the snapshot to
`RUN_DIR/memory_snapshots/iter_NNNNNNN_rankR.pickle` (open it at https://pytorch.org/memory_viz). On another device
there is no such allocator: the startup prints a note and nothing is written.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from moetron.fileio import write_atomic
from moetron.process_memory import peak_rss_bytes

GIB = 1024**3
SNAPSHOT_ENTRIES = 100_000  # allocation events kept (torchtitan's default)


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """`peak_memory_gib` (CUDA: max allocated; CPU: peak RSS) and `reserved_memory_gib` (CUDA only, else None)."""
    if device.type == "cuda":
        return {
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "reserved_memory_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    return {"peak_memory_gib": peak_rss_bytes() / GIB, "reserved_memory_gib": None}


def startup_baseline(device: torch.device) -> float | None:
    """On CPU, the process's peak RSS so far, in bytes (taken before the model is built: what the plan does not
    model); None on CUDA, whose allocator counters hold tensors only."""
    return None if device.type == "cuda" else peak_memory(device)["peak_memory_gib"] * GIB


def memory_text(m: dict) -> str:
    """The log line's memory part: `mem 1.23 GiB (reserved 1.50, plan 1.10)` on CUDA, `mem 0.61 GiB RSS (plan
    0.02 + 0.29 at start)` on CPU (the process's RSS before the model was built, which the plan does not count)."""
    notes = [] if m.get("reserved_memory_gib") is None else [f"reserved {m['reserved_memory_gib']:.2f}"]
    if m.get("planned_memory_gib") is not None:
        baseline = m.get("baseline_memory_gib")
        notes.append(
            f"plan {m['planned_memory_gib']:.2f}" + ("" if baseline is None else f" + {baseline:.2f} at start")
        )
    kind = " RSS" if m.get("reserved_memory_gib") is None else ""
    return f"mem {m['peak_memory_gib']:.2f} GiB{kind}" + (f" ({', '.join(notes)})" if notes else "")


def planned_line(planned_bytes: float | None, device_type: str, baseline_bytes: float | None = None) -> str:
    """The startup banner's memory line: the plan's prediction for this layout and what the log lines measure."""
    measured = "max_memory_allocated" if device_type == "cuda" else "peak RSS"
    held = "" if baseline_bytes is None else (
        f"; it includes the {baseline_bytes / GIB:.2f} GiB the process held before the model, which the plan does not"
        " count"
    )  # fmt: skip
    if planned_bytes is None:
        return f"memory     no plan estimate for this layout; the log lines give the measured peak ({measured}{held})"
    return (
        f"memory     plan predicts {planned_bytes / GIB:.2f} GiB peak per device (heaviest rank); the log lines give "
        f"the measured peak ({measured}, rank 0{held})"
    )


def memory_snapshot_problems(steps: list[int], run_dir: str | None) -> list[str]:
    problems = [f"--memory-snapshot-steps {s} is not a positive iteration" for s in steps if s < 1]
    if steps and not run_dir:
        problems.append("--memory-snapshot-steps writes into the run directory: add --save DIR or --output-dir DIR")
    return problems


class MemorySnapshots:
    """`--memory-snapshot-steps`: allocator history from the start, one snapshot file after each listed step."""

    def __init__(self, steps: list[int], device: torch.device, run_dir: str | None, rank: int):
        self.steps = set(steps) if device.type == "cuda" and run_dir else set()
        self.directory = Path(run_dir) / "memory_snapshots" if run_dir else None
        self.rank = rank
        self.note = None
        if steps and device.type != "cuda":
            self.note = f"note: --memory-snapshot-steps skipped on {device.type}: the allocator snapshot is CUDA's"
        if self.steps:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)

    def after_step(self, iteration: int) -> Path | None:
        if iteration not in self.steps:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"iter_{iteration:07d}_rank{self.rank}.pickle"
        write_atomic(path, pickle.dumps(torch.cuda.memory._snapshot()))
        return path
