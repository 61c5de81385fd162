"""Whether a run that `--load`s a checkpoint has iterations left to train, before anything starts.

Two cases train nothing. A checkpoint already AT the stop is a finished run resumed as it was (a SLURM requeue of
a job that finished, a restart script run twice): Megatron trains zero iterations and exits 0, and so does moetron,
with one line on stderr naming the continuation command for the user who meant to train longer. A stop BELOW the
checkpoint's iteration is a typo (that run never stopped there): a startup problem, exit status 2. Both name the
continuation command: the stop raised, and the LR schedule stretched to it with `--override-opt-param-scheduler`,
Megatron's way (`train/schedule.py` warns when a longer run would keep a finished schedule).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from moetron.checkpoint.files import read_json, resolve_checkpoint
from moetron.errors import UserError

if TYPE_CHECKING:
    from moetron.config import RunConfig


def checkpoint_iteration(load: str) -> int | None:
    """The iteration of the checkpoint `--load` names; None when there is none yet or it cannot be read (those are
    reported by the checkpoint's other checks, or at load)."""
    try:
        path = resolve_checkpoint(load)
        state = read_json(path / "state.json") if path is not None else None
    except (UserError, OSError, ValueError):
        return None
    return int(state.get("iteration", 0)) if isinstance(state, dict) else None


def _resume_progress(cfg: RunConfig, dp: int) -> tuple[int, int] | None:
    """(checkpoint iteration, this run's stop) of a resume (`--load`, not `--finetune`); None otherwise."""
    train = cfg.train
    if not train.load or train.finetune:
        return None
    done, stop = checkpoint_iteration(train.load), cfg.total_iters(dp)
    return None if done is None or stop <= 0 else (done, stop)


def continuation_flags(cfg: RunConfig, dp: int, done: int) -> str:
    """The flags that train on to twice the checkpoint's iteration, in the unit of the stop that binds (a
    `--train-iters` added beside a `--train-tokens` given on the same command line would not raise the stop)."""
    train, gbs = cfg.train, cfg.global_batch(dp)
    stop = cfg.total_iters(dp)
    if train.train_iters is not None and train.train_iters == stop:
        flag = f"--train-iters {2 * done}"
    elif train.train_samples is not None and -(-train.train_samples // gbs) == stop:
        flag = f"--train-samples {2 * done * gbs}"
    else:
        flag = f"--train-tokens {2 * done * gbs * cfg.model.seq_length}"
    return f"{flag} --override-opt-param-scheduler"


def continuation_problems(cfg: RunConfig, dp: int) -> list[str]:
    """A resume whose stop is before the checkpoint's iteration (a typo: exit status 2); [] otherwise."""
    progress = _resume_progress(cfg, dp)
    if progress is None or progress[1] >= progress[0]:
        return []
    done, stop = progress
    return [
        f"--load {cfg.train.load} is at iteration {done} and this run stops at iteration {stop}, before it: nothing "
        f"to train; to train on, raise the stop past {done}, e.g. {continuation_flags(cfg, dp, done)} (the LR "
        f"schedule then decays over the new length)"
    ]


def continuation_command(cfg: RunConfig, world_size: int, done: int) -> str:
    """The command that trains on from the checkpoint to twice its iteration: from the finished run's saved
    (absolute) config.yaml, whose run-length group a `--train-iters` on the command line replaces; "the same
    command with …" when its run directory has none."""
    checkpoint = resolve_checkpoint(cfg.train.load)
    run = checkpoint.resolve().parent if checkpoint is not None else None
    if run is None or not (run / "config.yaml").is_file():
        return f"the same command with {continuation_flags(cfg, cfg.dims(world_size).dp, done)}"
    save = Path(cfg.run_dir() or run).resolve()
    launcher = "moetron train" if world_size == 1 else "moetron launch <your launch flags> train"
    return (
        f"{launcher} --config {shlex.quote(str(run / 'config.yaml'))} --load {shlex.quote(str(run))} "
        f"--save {shlex.quote(str(save))} --train-iters {2 * done} --override-opt-param-scheduler"
    )


def finished_run_note(cfg: RunConfig, world_size: int) -> str | None:
    """The one line for a resume whose checkpoint is at this run's stop (it exits 0 without training, as Megatron
    does); None when there is something to train or the run is not a resume."""
    progress = _resume_progress(cfg, cfg.dims(world_size).dp)
    if progress is None or progress[0] != progress[1]:
        return None
    done = progress[0]
    return (
        f"run already finished at iteration {done} (--load {cfg.train.load}); nothing to train; to train longer: "
        f"{continuation_command(cfg, world_size, done)}"
    )
