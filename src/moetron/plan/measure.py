"""`moetron plan --search --measure`: run the top layouts for a few steps and put the measurements beside the plan.

Each row runs as `torchrun --standalone --nproc-per-node N -m moetron.plan.measure_worker train --config FILE
<the row's flags> <measuring flags>` — `moetron train` itself (gloo on CPU, NCCL on GPUs), on a corpus of random
tokens written once into a temporary directory (the data path is not what is measured, and the config's own
corpus need not exist here), `--train-iters S --log-interval 1`, no evaluation, no checkpoint.

  step time   the median over the steps after the first two (warm-up: allocator, gloo connections, Adam state)
              of tokens per step / metrics.jsonl's tokens_per_sec; and the slowest rank's median CPU time per
              step (on a CPU shared with other work the wall clock measures the load as much as the layout)
  peak memory on GPUs: the largest rank's torch.cuda.max_memory_allocated() (the plan's peak, without the CUDA
              context it adds for the verdict); on CPU: the largest rank's VmHWM less the VmHWM of the same rank
              in a baseline run — the same layout with a tiny model (hidden 8 per head, seq 8 per TP rank, vocab
              64, micro batch 1): torch, moetron, gloo and thread pools loaded, nothing big allocated. Both run
              with MALLOC_MMAP_THRESHOLD_=65536 so glibc returns freed tensors and the RSS follows the live ones
              (tests/integration/test_plan_vs_measured.py explains the method).
A layout whose run fails is reported in its row (the last line of its error), never as a crash of the search.
Rows are re-ranked by measured step time; failed ones go last.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moetron.errors import UserError
from moetron.plan.measure_worker import OUT_ENV
from moetron.plan.search import Row

WARMUP_STEPS = 2
RUN_TIMEOUT_S = 900


@dataclass
class Measurement:
    step_time_s: float | None = None  # wall clock
    cpu_step_s: float | None = None  # CPU time of the slowest rank's step (see measure_worker.py)
    peak_bytes: int | None = None  # the largest rank's (CPU: above its baseline)
    rank: int = 0  # by measured step time, 1 = fastest
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def random_corpus(directory: Path, vocab: int, tokens: int, seed: int = 0) -> str:
    """An indexed dataset of random tokens below `vocab` (documents of 1024 tokens); its prefix."""
    from moetron.data.indexed import IndexedDatasetBuilder

    prefix = directory / f"random_{vocab}"
    dtype = np.uint16 if vocab <= 65535 else np.int32
    builder = IndexedDatasetBuilder(prefix, dtype)
    rng = np.random.default_rng(seed)
    for _ in range(max(tokens // 1024, 4)):
        builder.add_document(rng.integers(0, vocab, 1024).tolist())
    builder.finalize()
    return str(prefix)


def run_flags(data_prefix: str, run_dir: Path, steps: int) -> list[str]:
    """Flags of a measuring run: the random corpus, S steps logged each, no evaluation or checkpoint."""
    return [
        *("--data-path", data_prefix, "--split", "100,0,0", "--data-cache-path", str(run_dir / "cache")),
        *("--vocab-file", "none", "--merge-file", "none", "--tokenizer-model", "none"),
        *("--train-iters", str(steps), "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "0"),
        *("--save", "none", "--save-interval", "none", "--tensorboard-dir", "none", "--output-dir", str(run_dir)),
        *("--exit-interval", "none", "--exit-duration-in-mins", "none"),
    ]


def tiny_flags(row: Row) -> list[str]:
    """The baseline's model: the row's layers, heads and experts (so the layout stays valid), nothing big."""
    m, d = row.plan.cfg.model, row.plan.dims
    hidden, seq = 8 * m.num_attention_heads, 8 * d.tp
    micro = row.plan.accumulation_steps
    return [
        *("--hidden-size", str(hidden), "--ffn-hidden-size", str(4 * hidden), "--moe-ffn-hidden-size", "none"),
        *("--kv-channels", "none", "--seq-length", str(seq), "--max-position-embeddings", "none"),
        *("--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", str(d.dp * micro)),
    ]


def launch(config: str, flags: list[str], gpus: int, out: Path, timeout: int) -> tuple[dict, str]:
    """Run the worker under torchrun; (rank records, error text or '')."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, OUT_ENV: str(out), "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // gpus)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    command += ["-m", "moetron.plan.measure_worker", "train", "--config", config, *flags]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, f"timed out after {timeout} s"
    records = {}
    for path in out.glob("rank*.json"):
        record = json.loads(path.read_text())
        records[record["rank"]] = record
    if proc.returncode != 0:
        lines = [x for x in (proc.stderr + proc.stdout).splitlines() if x.strip()]
        ours = [x for x in lines if x.startswith("error:")]  # moetron's one-line errors
        raised = [x for x in lines if "Error" in x and "torch.distributed.elastic" not in x]  # a rank's traceback
        return records, (ours or raised or lines or [f"exit status {proc.returncode}"])[-1].strip()
    return records, ""


def step_time(run_dir: Path, tokens_per_step: int) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_sec"] for r in records if r["iteration"] > WARMUP_STEPS and r.get("tokens_per_sec")]
    return tokens_per_step / statistics.median(rates) if rates else None


def cpu_step_time(records: dict) -> float | None:
    """The slowest rank's median CPU time per step, after the warm-up steps."""
    medians = [statistics.median(r["cpu_step_s"][WARMUP_STEPS:]) for r in records.values()
               if len(r.get("cpu_step_s") or []) > WARMUP_STEPS]  # fmt: skip
    return max(medians, default=None)


def check_devices(gpus: int, device_kind: str) -> None:
    if device_kind == "cpu":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < gpus:
        raise UserError(
            f"--measure runs every layout on this machine: --gpus {gpus} needs {gpus} GPUs here, found {have}; "
            "measure on a node with that many GPUs, or plan for --gpu-type cpu with --gpus ≤ this machine's cores"
        )


def measure_rows(rows: list[Row], config: str, gpus: int, steps: int, timeout: int = RUN_TIMEOUT_S) -> list[Row]:
    """Measure each row (see the module docstring); the rows re-ranked by measured step time."""
    kind = rows[0].plan.device.kind
    check_devices(gpus, kind)
    with tempfile.TemporaryDirectory(prefix="moetron-measure-") as tmp:
        work = Path(tmp)
        corpora: dict[int, str] = {}
        baselines: dict[tuple, tuple[dict, str]] = {}
        for i, row in enumerate(rows):
            cfg = row.plan.cfg
            tokens = (steps + 1) * row.plan.tokens_per_step
            vocab = cfg.model.vocab_size
            if vocab not in corpora:
                corpora[vocab] = random_corpus(work, vocab, min(tokens + 4096, 1 << 26))
            run_dir = work / f"row{i}"
            records, error = launch(config, [*row.flags, *run_flags(corpora[vocab], run_dir, steps)], gpus,
                                    run_dir / "ranks", timeout)  # fmt: skip
            seconds = None if error else step_time(run_dir, row.plan.tokens_per_step)
            if kind == "cpu" and not error:
                key = baseline_key(row)
                if key not in baselines:
                    if 64 not in corpora:
                        corpora[64] = random_corpus(work, 64, 1 << 16)
                    base_dir = work / f"baseline{len(baselines)}"
                    flags = [*row.flags, *run_flags(corpora[64], base_dir, 3), *tiny_flags(row)]
                    baselines[key] = launch(config, flags, gpus, base_dir / "ranks", timeout)
                base, base_error = baselines[key]
                error = f"baseline run: {base_error}" if base_error else ""
                peak = None if error else rss_above(records, base)
            else:
                peak = max((r["cuda_bytes"] or 0 for r in records.values()), default=None) if not error else None
            if not error and seconds is None:
                error = "no step time in metrics.jsonl"
            row.measured = Measurement(seconds, None if error else cpu_step_time(records), peak, error=error)
    ok = sorted((r for r in rows if not r.measured.error), key=lambda r: r.measured.step_time_s)
    for rank, row in enumerate(ok, 1):
        row.measured.rank = rank
    return ok + [r for r in rows if r.measured.error]


def baseline_key(row: Row) -> tuple:
    """Rows that share a baseline run: the same degrees (and, with pipelining, the same micro-batch count, which
    the schedule's rules depend on)."""
    layout = row.layout
    micro = row.plan.accumulation_steps if layout.pp > 1 else 0
    return layout.tp, layout.sp, layout.pp, layout.virtual_layers, layout.ep, layout.etp, layout.zero, micro


def rss_above(records: dict, baseline: dict) -> int | None:
    """The largest rank's peak RSS above the same rank's baseline."""
    pairs = [(r["vmhwm_bytes"], baseline.get(k, {}).get("vmhwm_bytes")) for k, r in records.items()]
    pairs = [(p, b) for p, b in pairs if p is not None and b is not None]
    return max((p - b for p, b in pairs), default=None)
