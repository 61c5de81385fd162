"""Checkpoints that resume exactly, publish atomically and load at any layout.

    view = GlobalView(model, registry, mesh)        # this rank's tensors as layout-free global tensors
    save_checkpoint(run_dir, iteration, view, optimizer, trainer_state, config_yaml, env, keep_last_n)
    path = resolve_checkpoint("runs/moe")           # a run directory (its `latest`) or one iter_* directory
    trainer_state = load_checkpoint(path, view, optimizer)
    run = open_run("runs/moe"); model = run.model("cpu")   # to use a checkpoint: eval, generate, export, upcycle

`async_save.py`: `--async-save` (`AsyncCheckpointer`: the same save, written by a background thread from a CPU copy);
`open.py`: the one way a command opens a checkpoint to use it (`open_run`, `load_model`, one error per failure);
`files.py`: the run directory (atomic publish, `latest`, pruning, one-line errors); `state.py`: what the tensors
are and how DCP writes and reads them; `rng_files.py`: per-rank generator states; `legacy.py`: moetron 0.1's
format, read only by `moetron convert-checkpoint`.
"""

from moetron.checkpoint.files import read_json, resolve_checkpoint
from moetron.checkpoint.open import OpenRun, load_model, open_run
from moetron.checkpoint.state import GlobalView, load_checkpoint, load_weights, save_checkpoint

__all__ = [
    "GlobalView",
    "OpenRun",
    "load_checkpoint",
    "load_model",
    "load_weights",
    "open_run",
    "read_json",
    "resolve_checkpoint",
    "save_checkpoint",
]
