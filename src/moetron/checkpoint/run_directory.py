"""Run-directory safety, checked before anything is written: a run never destroys another run's checkpoints or logs.

Here, below `train/`, because both `moetron.validate` (before the run) and `train/run_lock.py` (again, under the
run directory's lock) ask it.
"""

from __future__ import annotations

from pathlib import Path

from moetron.checkpoint.files import previous_run
from moetron.config import TrainConfig


def run_directory_problems(t: TrainConfig) -> list[str]:
    """A run must not destroy a previous run's checkpoints or logs: a new run (no --load inside that directory) is
    refused unless --overwrite says so; --overwrite and --finetune are refused with a --load inside the directory
    (the one would delete the checkpoint it is about to load, the other restart the run at iteration 0 over it)."""
    flag, run_dir = ("--save", t.save) if t.save else ("--output-dir", t.output_dir)
    if not run_dir:
        return []
    loads_from_it = bool(t.load) and _is_inside(t.load, run_dir)
    if loads_from_it and t.overwrite:
        return [
            f"--overwrite would delete the checkpoint --load {t.load} names (it is inside {flag} {run_dir}); to "
            f"continue the run drop --overwrite (also `overwrite: true` from a --config file: older moetron saved it "
            f"in config.yaml), or give --load and {flag} different directories"
        ]
    if loads_from_it and t.finetune:
        return [
            f"--finetune --load {t.load} with {flag} {run_dir}: --finetune starts a new run at iteration 0, which "
            f"would replace the checkpoints and logs of the run it loads; give a new {flag} (to continue the run "
            f"itself drop --finetune, also `finetune: true` from a --config file: older moetron saved it there)"
        ]
    found = None if t.overwrite else previous_run(run_dir)
    if found is None or loads_from_it:  # nothing there, --overwrite, or resuming the run that lives there
        return []
    resume = f"resume it with --load {run_dir}" if flag == "--save" else f"pass --save {run_dir} --load {run_dir}"
    return [
        f"{flag} {run_dir} already holds another run's output ({found}) that this run would overwrite; {resume}, "
        f"give another {flag}, or pass --overwrite to delete it"
    ]


def _is_inside(path: str, directory: str) -> bool:
    """`path` is `directory` or lies below it (symbolic links resolved)."""
    path_, directory_ = Path(path).resolve(), Path(directory).resolve()
    return path_ == directory_ or directory_ in path_.parents
