"""One TensorBoard directory per run: a config file's relative `tensorboard_dir` follows a run directory given on
the command line.

A recipe pairs `save: checkpoints/NAME` with `tensorboard_dir: tensorboard/NAME`. A user who gives the run its own
`--save runs/a` (and tomorrow `--save runs/b`) would otherwise write both runs' events into the one
`tensorboard/NAME`, where TensorBoard draws them as one tangled curve. So when `--save` / `--output-dir` come from
the command line and `tensorboard_dir` only from the config file, as a relative path, the events go to
`RUN/tensorboard`; the banner's `flags` line says the config file's value was replaced, and its `output` line
where they go. An absolute `tensorboard_dir` (a run's own saved config.yaml: continuing the run keeps its
directory) or one given as a flag stays as it is.
"""

from __future__ import annotations

import os

from moetron.config import RunConfig
from moetron.config_cli import cli_names, yaml_names

RUN_DIR_FLAGS = ("save", "output_dir")


def tensorboard_follows_the_run(cfg: RunConfig, explicit: set[str]) -> None:
    """Move a config file's relative `tensorboard_dir` inside a run directory given on the command line (in place;
    recorded in `explicit.replaced` for the banner)."""
    board, flags = cfg.train.tensorboard_dir, cli_names(explicit)
    if not board or os.path.isabs(board) or "tensorboard_dir" in flags or "tensorboard_dir" not in yaml_names(explicit):
        return
    if not set(RUN_DIR_FLAGS) & flags or cfg.run_dir() is None:
        return
    if "tensorboard_dir" in getattr(explicit, "scaled", {}):  # --scale-down put it inside its run already
        return
    cfg.train.tensorboard_dir = os.path.join(cfg.run_dir(), "tensorboard")
    replaced = getattr(explicit, "replaced", None)
    if replaced is not None:
        replaced["tensorboard_dir"] = board
