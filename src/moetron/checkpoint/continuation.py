"""Whether a run that `--load`s a checkpoint has iterations left to train, before anything starts.

Resuming a finished run with the stop it finished at trains nothing and exits 0, which looks like success to the
user who meant to train longer and forgot to raise `--train-iters`; a stop below the checkpoint's iteration is a
typo. Either is a startup problem that names the continuation command (the stop raised, and the LR schedule
stretched to it with `--override-opt-param-scheduler`, Megatron's way; `train/schedule.py` warns when a longer run
would keep a finished schedule).
"""

from __future__ import annotations

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


def continuation_problems(cfg: RunConfig, dp: int) -> list[str]:
    """A resume (`--load`, not `--finetune`) whose stop is not past the checkpoint's iteration; [] otherwise."""
    load, train = cfg.train.load, cfg.train
    if not load or train.finetune:
        return []
    done, stop = checkpoint_iteration(load), cfg.total_iters(dp)
    if done is None or stop <= 0 or stop > done:
        return []
    return [
        f"--load {load} is at iteration {done} and this run stops at iteration {stop}: nothing to train; to train "
        f"on, raise the stop, e.g. --train-iters {2 * done} --override-opt-param-scheduler (the LR schedule then "
        f"decays over the new length)"
    ]
