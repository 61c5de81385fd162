"""PNG plots of a run: the expert-load heatmap of a routing report, and the training / validation loss curves.

matplotlib is optional (`pip install moetron[plot]`): `matplotlib_missing()` says why plots cannot be drawn
(None when they can), so callers print one clear note instead of failing. The Agg backend is used: no
display is needed.
"""

from __future__ import annotations

import json
from pathlib import Path


def matplotlib_missing() -> str | None:
    """None when matplotlib imports, else a one-line reason with the fix."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed; `pip install moetron[plot]` (or `pip install matplotlib`) adds it"
    return None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file (an absent file is no records; torn last lines of a killed run are skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def expert_load_heatmap(routing: list[dict], path: Path) -> Path:
    """Layers × experts heatmap of each expert's share of its layer's routes (1/E = balanced)."""
    plt = _pyplot()
    width = max((len(r["tokens_per_expert"]) for r in routing), default=1)
    shares = []
    for r in routing:
        total = max(sum(r["tokens_per_expert"]), 1)
        row = [n / total for n in r["tokens_per_expert"]]
        shares.append(row + [float("nan")] * (width - len(row)))  # pyramid MoE: fewer experts in some layers
    fig, ax = plt.subplots(figsize=(max(4.0, 0.4 * width + 2), max(2.0, 0.5 * len(shares) + 1.5)))
    image = ax.imshow(shares or [[float("nan")]], aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(routing)), [f"layer {r['layer']}" for r in routing])
    ax.set_xlabel("expert")
    ax.set_title("share of routes per expert (balanced = 1/E)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_curves(run_dir: Path, path: Path) -> Path | None:
    """Training lm loss (metrics.jsonl) and validation loss (eval.jsonl) against iterations; None without data."""
    train = read_jsonl(Path(run_dir) / "metrics.jsonl")
    valid = read_jsonl(Path(run_dir) / "eval.jsonl")
    if not train and not valid:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot([r["iteration"] for r in train], [r["lm_loss"] for r in train], label="training lm loss")
    if valid:
        ax.plot([r["iteration"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
