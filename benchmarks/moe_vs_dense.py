"""Why MoE: moetron's MoE (8 and 32 experts) against its dense model at equal active parameters and FLOPs per token.

    python benchmarks/moe_vs_dense.py                        # both corpora, 3 models each; writes docs/moe_vs_dense.png
    python benchmarks/moe_vs_dense.py --iters 100 --corpora tinyshakespeare --out /tmp/study.png

For each corpus (tinyshakespeare from ../shared/data, and `moetron quickstart`'s built-in corpus of Python's help
topics and docstrings) one byte-level BPE tokenizer (`--vocab-size`, trained on that corpus) and one preprocessed
dataset serve all three models. The models share everything but the MLPs of layers 2 and 4 (1-based): 4 layers,
hidden 128, 4 heads, sequence 128, GELU MLP of 512; MoE-E replaces those two MLPs by E experts of the same size,
top-1, dropless (every token meets exactly one expert of the dense MLP's size: the same active parameters and
FLOPs per token, plus a 128×E router), aux-loss coefficient 0.01. Each trains with `moetron train` (the CLI, one
process) for `--iters` steps of 8 × 128 tokens on the same batches, evaluating on the held-out 5% every
`--eval-interval` steps. Validation loss is plotted against training tokens and against training wall time (the
trainer's own per-interval throughput, evaluation excluded); a markdown table of the final numbers is printed.
The runs go one after another, so machine load shifts the wall-time axis (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
MODELS = {"dense": [], "MoE-8": ["--num-experts", "8"], "MoE-32": ["--num-experts", "32"]}
MOE_FLAGS = ["--expert-interval", "2", "--topk", "1", "--disable-moe-token-dropping", "--moe-loss-coeff", "0.01"]
BASE_FLAGS = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --ffn-hidden-size 512 "
    "--micro-batch-size 8 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 "
    "--adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --split 95,5,0 --log-interval 10"
).split()


def corpus_files(name: str, work: Path) -> list[Path]:
    if name == "tinyshakespeare":
        if not SHAKESPEARE.exists():
            raise SystemExit(f"{SHAKESPEARE} not found (the ../shared checkout beside the repository)")
        return [SHAKESPEARE]
    from moetron.quickstart.pipeline import QuickstartOptions, build_corpus

    (work / "corpus").mkdir(parents=True, exist_ok=True)
    return build_corpus(QuickstartOptions(output_dir=work), work)


def prepare(name: str, work: Path, vocab: int) -> tuple[str, Path]:
    """(dataset prefix, tokenizer dir) for one corpus."""
    from moetron.quickstart.pipeline import build_dataset, build_tokenizer_files

    work.mkdir(parents=True, exist_ok=True)
    files = corpus_files(name, work)
    tokenizer = build_tokenizer_files(files, work, vocab)
    return build_dataset(files, tokenizer, work), tokenizer


def train(prefix: str, tokenizer: Path, run: Path, model: str, args: argparse.Namespace) -> None:
    flags = [*BASE_FLAGS, "--data-path", prefix, "--vocab-file", str(tokenizer / "vocab.json")]
    flags += ["--merge-file", str(tokenizer / "merges.txt"), "--output-dir", str(run)]
    flags += ["--train-iters", str(args.iters), "--eval-interval", str(args.eval_interval), "--eval-iters", "8"]
    flags += MODELS[model] + (MOE_FLAGS if MODELS[model] else [])
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-m", "moetron", "train", *flags], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{model} training failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves(run: Path) -> dict:
    """Validation loss against tokens and against training seconds (Σ interval tokens / interval tokens/s)."""
    train_log, evals = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl")
    seconds, elapsed, previous = {}, 0.0, 0
    for record in train_log:
        elapsed += (record["consumed_tokens"] - previous) / record["tokens_per_sec"]
        previous = record["consumed_tokens"]
        seconds[record["consumed_tokens"]] = elapsed
    times = [seconds.get(e["consumed_tokens"], elapsed) for e in evals]
    return {"tokens": [e["consumed_tokens"] for e in evals], "seconds": times, "loss": [e["valid_loss"] for e in evals]}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.6 * len(results)), squeeze=False)
    for row, (corpus, models) in zip(axes, results.items(), strict=True):
        for model, c in models.items():
            row[0].plot(c["tokens"], c["loss"], marker="o", markersize=3, label=model)
            row[1].plot(c["seconds"], c["loss"], marker="o", markersize=3, label=model)
        row[0].set(title=f"{corpus}: validation loss vs tokens", xlabel="training tokens", ylabel="validation loss")
        row[1].set(title=f"{corpus}: validation loss vs wall time", xlabel="training seconds (CPU, 2 cores)")
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def table(results: dict) -> list[str]:
    lines = ["| corpus | model | final valid loss | vs dense | training s | tokens/s vs dense |"]
    lines.append("|---|---|---|---|---|---|")
    for corpus, models in results.items():
        dense = models["dense"]
        for model, c in models.items():
            rate = (c["tokens"][-1] / c["seconds"][-1]) / (dense["tokens"][-1] / dense["seconds"][-1])
            lines.append(
                f"| {corpus} | {model} | {c['loss'][-1]:.3f} | {c['loss'][-1] - dense['loss'][-1]:+.3f} | "
                f"{c['seconds'][-1]:.0f} | {rate:.2f}× |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", nargs="*", default=["tinyshakespeare", "quickstart"])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "moe_vs_dense.png")
    parser.add_argument("--work-dir", type=Path, help="keep the data and runs here (default: a temporary directory)")
    parser.add_argument(
        "--plot-only", action="store_true", help="no training: plot and tabulate the runs already in --work-dir"
    )
    args = parser.parse_args()
    if args.plot_only and not args.work_dir:
        raise SystemExit("--plot-only reads the runs of an earlier --work-dir DIR: pass --work-dir")
    print(f"load average at start {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="moetron-study-") as tmp:
        work = args.work_dir or Path(tmp)
        results: dict = {}
        for corpus in args.corpora:
            if not args.plot_only:
                prefix, tokenizer = prepare(corpus, work / corpus, args.vocab_size)
            results[corpus] = {}
            for model in MODELS:
                run = work / corpus / "runs" / model
                if not args.plot_only:
                    train(prefix, tokenizer, run, model, args)
                results[corpus][model] = curves(run)
                print(f"{corpus} {model}: final valid loss {results[corpus][model]['loss'][-1]:.3f}", flush=True)
        plot(results, args.out)
    print(f"load average at end {os.getloadavg()[0]:.1f}; plot: {args.out}")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
