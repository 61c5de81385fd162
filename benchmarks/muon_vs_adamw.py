"""Muon against AdamW on the quickstart model: equal steps, the same LR schedule, three learning rates each.

    python benchmarks/muon_vs_adamw.py                         # tinyshakespeare, 100 steps, lr 1e-3 2e-3 4e-3
    python benchmarks/muon_vs_adamw.py --iters 300 --lrs 2e-3 4e-3 8e-3

`--model quickstart`: the quickstart recipe itself (`--config quickstart`, one process; its schedule: cosine to
lr/10 after 20 warmup steps). The default, `--model small`: a small tinyshakespeare config (the quickstart's
shape, smaller so that six runs fit in minutes on a loaded 2-core CPU): 2 layers, hidden 64, 4 heads, sequence
64, 4 experts top-2 in layer 2, one process, `moetron train` for `--iters` steps of 8 × 64 tokens, cosine decay to
lr/10 after 10 warmup steps, weight decay 0.1, β2 0.95. Either: a byte-level BPE of `--vocab-size` trained on the
corpus, 5% held out for validation. Both optimizers see the same batches and the same learning-rate grid: Muon's
default scale (0.2·sqrt(max(m, n)), Moonlight's) matches AdamW's update RMS, so the grid is shared. The table gives
each run's final validation loss and the best per optimizer. `--jobs N` trains N runs at once (one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_vs_dense import curves, prepare

REPO = Path(__file__).resolve().parents[1]
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --num-experts 4 --expert-interval 2 "
    "--topk 2 --moe-loss-coeff 0.01 --micro-batch-size 8 --lr-decay-style cosine --lr-warmup-iters 10 "
    "--weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --split 95,5,0 "
    "--log-interval 25 --eval-iters 8"
).split()


# `--model quickstart`: the quickstart recipe itself (4 layers, hidden 128, seq 128, 4 experts top-2 in layers 2 and
# 4, micro batch 4 × 2, cosine after 20 warmup steps, weight decay 0.1, β2 0.95), in one process
QUICKSTART = "--config quickstart --moe-expert-parallel-size 1 --log-interval 25 --eval-iters 8".split()


def train_command(
    prefix: str, tokenizer: Path, run: Path, optimizer: str, lr: float, iters: int, model: str = "small"
) -> list[str]:
    flags = [*(QUICKSTART if model == "quickstart" else FLAGS), "--data-path", prefix]
    if model == "quickstart":  # the recipe's vocab_size is its own tokenizer's; this one's replaces it
        flags += ["--vocab-size", str(len(json.loads((tokenizer / "vocab.json").read_text())))]
    flags += ["--vocab-file", str(tokenizer / "vocab.json")]
    flags += ["--merge-file", str(tokenizer / "merges.txt"), "--output-dir", str(run), "--optimizer", optimizer]
    flags += ["--lr", str(lr), "--min-lr", str(lr / 10), "--train-iters", str(iters), "--eval-interval", str(iters)]
    return [sys.executable, "-m", "moetron", "train", *flags]


def finished(run: Path, iters: int) -> bool:
    """A run of `--work-dir` that already reached its final evaluation (rerunning the script reuses it)."""
    evals = run / "eval.jsonl"
    return evals.is_file() and any(f'"iteration": {iters},' in line for line in evals.read_text().splitlines())


def train_all(runs: dict, prefix: str, tokenizer: Path, iters: int, jobs: int, model: str = "small") -> None:
    """Every (optimizer, lr) run not finished yet, `jobs` at a time (one process each)."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    todo = [(key, run) for key, run in runs.items() if not finished(run, iters)]
    while todo:
        batch, todo = todo[:jobs], todo[jobs:]
        procs = []
        for (optimizer, lr), run in batch:
            cmd = train_command(prefix, tokenizer, run, optimizer, lr, iters, model)
            procs.append(
                (optimizer, lr, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            )
        for optimizer, lr, proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"{optimizer} lr {lr} failed:\n{out.decode()[-2000:]}\n{err.decode()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at the same time (one process each)")
    parser.add_argument("--work-dir", type=Path, help="keep the data and runs here; finished runs there are reused")
    parser.add_argument("--model", choices=("small", "quickstart"), default="small",
                        help="small: the 2 × 64 shape above; quickstart: the quickstart recipe itself")  # fmt: skip
    args = parser.parse_args()
    print(f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moetron-muon-") as tmp:
        work = args.work_dir or Path(tmp)
        prefix, tokenizer = prepare("tinyshakespeare", work / "tinyshakespeare", args.vocab_size)
        runs = {(opt, lr): work / "runs" / f"{args.model}-{opt}-{lr:g}" for opt in ("adam", "muon") for lr in args.lrs}
        train_all(runs, prefix, tokenizer, args.iters, args.jobs, args.model)
        for (optimizer, lr), run in runs.items():
            c = curves(run)
            rows.append((optimizer, lr, c["loss"][-1], c["seconds"][-1]))
            print(f"{optimizer} lr {lr:g}: valid loss {c['loss'][-1]:.4f} ({c['seconds'][-1]:.0f} s)", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    print("| optimizer | lr | final valid loss | training s |\n|---|---|---|---|")
    for optimizer, lr, loss, seconds in rows:
        print(f"| {'AdamW' if optimizer == 'adam' else 'Muon'} | {lr:g} | {loss:.4f} | {seconds:.0f} |")
    best = {opt: min(loss for o, _, loss, _ in rows if o == opt) for opt in ("adam", "muon")}
    print(f"best: AdamW {best['adam']:.4f}, Muon {best['muon']:.4f} (Muon − AdamW {best['muon'] - best['adam']:+.4f})")


if __name__ == "__main__":
    main()
