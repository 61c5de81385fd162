"""Peak memory per device measured by `moetron train` vs `moetron plan`'s prediction, for three layouts on CPU.

Each layout is a real `moetron train` run (torchrun, gloo, one thread per process) of the same MoE GPT for a few
steps on a random-token corpus; the last record of its `metrics.jsonl` gives `peak_memory_gib` (on CPU: rank 0's
peak resident set, `getrusage`) and `planned_memory_gib` (the plan's peak per device for this layout, the heaviest
rank). Layouts (`--layouts`):

  single    1 process
  zero1     2 processes, data parallel 2 with ZeRO stage 1 (Adam state sharded)
  ep2       2 processes, data parallel 2 with expert parallelism 2 (each rank holds half the experts)

On CPU the resident set also holds what every process has before any model exists (the interpreter, torch and
moetron's imports, gloo): the plan does not predict that part. The run logs it itself (`baseline_memory_gib`: rank
0's peak RSS before the loaders and the model were built; the log line's `plan X + Y at start`), and the script
prints both ratios: measured / predicted, and (measured − baseline) / predicted. The run's own allocations beyond
tensors (the data loader's index arrays, the autograd graph's bookkeeping, allocator slack) are in both.

    python benchmarks/peak_memory.py [--steps 4] [--hidden-size 256] [--num-layers 4] [--layouts single zero1 ep2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from moetron.data.indexed import IndexedDatasetBuilder

LAYOUTS = {
    "single": (1, []),
    "zero1": (2, ["--zero-stage", "1"]),
    "ep2": (2, ["--moe-expert-parallel-size", "2"]),
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def write_corpus(prefix: Path, vocab: int) -> str:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(400):
            builder.add_document(rng.integers(0, vocab, int(rng.integers(100, 400))))
        builder.finalize()
    return str(prefix)


def run_layout(name: str, prefix: str, run: Path, args) -> dict:
    nproc, extra = LAYOUTS[name]
    model = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
        "--seq-length", str(args.seq_length), "--num-experts", "8", "--topk", "2", "--vocab-size", str(args.vocab),
        "--hidden-dropout", "0", "--attention-dropout", "0",
    ]  # fmt: skip
    batch = ["--micro-batch-size", "2", "--global-batch-size", str(2 * nproc)]
    steps = ["--train-iters", str(args.steps), "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3"]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd = [*launcher, "-m", "moetron", "train", *model, *batch, *steps, "--data-path", prefix, "--output-dir", str(run)]
    done = subprocess.run([*cmd, *extra], env=ENV, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"layout {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return {
        "peak": last["peak_memory_gib"],
        "planned": last["planned_memory_gib"],
        "baseline": last["baseline_memory_gib"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"
    print(f"model: {args.num_layers} layers × hidden {args.hidden_size}, 8 experts top-2, seq {args.seq_length}, "
          f"vocab {args.vocab}, micro batch 2, {args.steps} steps; load average at start {load}")  # fmt: skip
    print("| layout | measured peak GiB (RSS, rank 0) | baseline GiB (before the model) | plan GiB | measured / plan"
          " | (measured − baseline) / plan |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = write_corpus(Path(tmp) / "corpus_text_document", args.vocab)
        for name in args.layouts:
            r = run_layout(name, prefix, Path(tmp) / name, args)
            if r["planned"] is None:
                print(f"| {name} | {r['peak']:.3f} | {r['baseline']:.3f} | no estimate | – | – |", flush=True)
                continue
            ratio, net = r["peak"] / r["planned"], (r["peak"] - r["baseline"]) / r["planned"]
            cells = f"{r['peak']:.3f} | {r['baseline']:.3f} | {r['planned']:.3f} | {ratio:.2f} | {net:.2f}"
            print(f"| {name} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
