"""A new moetron run directory from converted tensors (the last step of every import and of upcycling).

    check_new_run_dir(save)                               # before any work: --save must be new or empty
    path = write_run(save, cfg, tensors, notes=[...], progress=Progress(iteration=3, consumed_samples=12, ...))

The checkpoint is the trainer's own format (`checkpoint/state.write_checkpoint`), so
`moetron train --config SAVE/config.yaml --load SAVE --finetune` trains from it, and with optimizer state and
progress (a Megatron-DeepSpeed import) `--load SAVE` resumes the run where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.checkpoint.state import write_checkpoint
from moetron.config import RunConfig
from moetron.config_cli import to_yaml
from moetron.errors import ConfigError, UserError
from moetron.fileio import writable_dir_problem, write_atomic
from moetron.model.gpt import GPTModel


@dataclass
class Progress:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    scheduler_steps: int | None = None  # the LR schedule's position in samples (None: consumed_samples)
    scheduler_tokens: int | None = None


def check_new_run_dir(save: str, flag: str = "--save") -> Path:
    path = Path(save)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(
            f"{flag} {save} exists and is not an empty directory; give a new directory (nothing is overwritten)"
        )
    problem = writable_dir_problem(path.parent)  # a file in the way, a read-only disk (missing parents are made)
    if problem is not None:
        raise UserError(f"{flag} {save}: {problem}; give a directory you can write to")
    return path


def trainer_state(cfg: RunConfig, progress: Progress) -> dict:
    """A state.json the trainer resumes from (the same fields `Trainer.trainer_state` writes)."""
    t = cfg.train
    return {
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "consumed_tokens": progress.consumed_tokens,
        "skipped_steps": 0,
        "consecutive_skips": 0,
        "scheduler": {
            "num_steps": progress.consumed_samples if progress.scheduler_steps is None else progress.scheduler_steps,
            "num_tokens": progress.consumed_tokens if progress.scheduler_tokens is None else progress.scheduler_tokens,
        },
        "loss_scaler": {"scale": t.initial_loss_scale, "clean_steps": 0, "hysteresis_left": t.hysteresis},
        "train_loader": {"consumed_samples": progress.consumed_samples},
        "world_size": 1,
        "global_batch_size": cfg.global_batch(1),
    }


def model_shapes(cfg: RunConfig) -> dict[str, torch.Size]:
    """Every tensor of the model's checkpoint and its global shape (built on the meta device: no memory)."""
    problems = cfg.model.problems()
    if problems:
        raise ConfigError(problems)
    with torch.device("meta"):
        model = GPTModel(cfg.model)
    return {name: t.shape for name, t in model.state_dict().items()}


def check_tensors(cfg: RunConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """The converted tensors are exactly the model's, with its shapes (else the conversion is wrong: one line)."""
    shapes = model_shapes(cfg)
    missing = [n for n in shapes if n not in tensors]
    extra = [n for n in tensors if n not in shapes]
    wrong = [
        f"{n} {tuple(tensors[n].shape)} (expected {tuple(s)})"
        for n, s in shapes.items()
        if n in tensors and tensors[n].shape != s
    ]
    if missing or extra or wrong:
        what = "; ".join(
            x
            for x in [
                f"missing {missing[:3]}" if missing else "",
                f"unexpected {extra[:3]}" if extra else "",
                f"shapes {wrong[:3]}" if wrong else "",
            ]
            if x
        )
        raise UserError(f"{source}: the converted tensors do not fit the model its config describes ({what})")


def write_run(
    save: str,
    cfg: RunConfig,
    tensors: dict[str, torch.Tensor],
    notes: list[str],
    progress: Progress | None = None,
    optim: dict[str, torch.Tensor] | None = None,
    source: str = "import",
) -> Path:
    """Write checkpoint + config.yaml (with `notes` as comments at its top) into the new run directory `save`."""
    check_tensors(cfg, tensors, source)
    progress = progress or Progress()
    header = "".join(f"# {line}\n" for line in notes)
    path = write_checkpoint(
        save, progress.iteration, tensors, trainer_state(cfg, progress), header + to_yaml(cfg), optim
    )
    write_atomic(Path(save) / "config.yaml", header + to_yaml(cfg))
    return path
