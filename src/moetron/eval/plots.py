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


def load_ratios(routing: list[dict]) -> list[list[float]]:
    """Each expert's routes / its layer's balanced share (1 = exactly 1/E of the routes), NaN past a layer's last
    expert (a pyramid's layers of 4 and 8 experts share one grid)."""
    width = max((len(r["tokens_per_expert"]) for r in routing), default=1)
    ratios = []
    for r in routing:
        counts = r["tokens_per_expert"]
        balanced = max(sum(counts), 1) / len(counts)
        ratios.append([n / balanced for n in counts] + [float("nan")] * (width - len(counts)))
    return ratios


def heatmap_colours(ratios: list[list[float]]):
    """(RGBA per cell, norm, colormap): diverging from white at the balanced share 1 (red above, blue below, dark
    blue a dead expert, transparent no expert), on one scale for every layer, so 1 never sits mid-colour."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    values = np.array(ratios or [[float("nan")]], dtype=float)
    top = max(float(np.nanmax(values)) if np.isfinite(values).any() else 0.0, 2.0)  # at least 0 … 1 … 2
    norm, cmap = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top), matplotlib.colormaps["RdBu_r"]
    rgba = cmap(norm(np.nan_to_num(values, nan=1.0)))
    rgba[np.isnan(values)] = (0.0, 0.0, 0.0, 0.0)
    return rgba, norm, cmap


def expert_load_heatmap(routing: list[dict], path: Path) -> Path:
    """Layers × experts heatmap of each expert's routes against the balanced share, centred on it (white = 1/E)."""
    plt = _pyplot()
    fig = heatmap_figure(routing)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def heatmap_figure(routing: list[dict]):
    """The heatmap's figure: its title on two lines within the figure at any expert count (4 experts included)."""
    plt = _pyplot()
    from matplotlib.cm import ScalarMappable

    ratios = load_ratios(routing)
    rgba, norm, cmap = heatmap_colours(ratios)
    width = len(rgba[0])
    fig, ax = plt.subplots(figsize=(max(4.5, 0.4 * width + 2), max(2.5, 0.5 * len(ratios) + 1.8)))
    ax.imshow(rgba, aspect="auto")
    ax.set_yticks(range(len(routing)), [f"layer {r['layer']}" for r in routing])
    ax.set_xlabel("expert")
    ax.set_title("routes per expert / balanced share\n(white: 1 = 1/E)", fontsize=10)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax)
    bar.set_ticks(colour_bar_ticks(norm.vmax))
    fig.tight_layout()
    return fig


def colour_bar_ticks(top: float) -> list[float]:
    """0, ½, 1 (balanced), 1.5 and whole ratios up to the scale's top, at most about six of those (a tick one past
    the top would stretch the bar's axis)."""
    whole = range(2, int(top) + 1, max(1, (int(top) - 1) // 4))
    return [0.0, 0.5, 1.0, 1.5, *whole]


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
