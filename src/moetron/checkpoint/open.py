"""Opening a checkpoint to use it: the one way eval, generate, eval-harness, export, upcycle and import read one.

    run = open_run("runs/moe")                        # a run directory (its `latest`) or one iter_* directory
    run.path, run.cfg, run.state                      # the iter_* directory, its RunConfig, its state.json
    model = run.model("cpu")                          # the whole model in eval mode with the checkpoint's weights
    model, cfg, path = load_model("runs/moe", "cpu")  # the same in one call

Every way a checkpoint can fail to open is one line, the same whichever command opened it: nothing there, no or a
damaged config.yaml, a state.json of moetron 0.1 or of nothing known (`state.check_format`), tensors that do not fit
the model or a truncated shard (`state.load_checkpoint`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from moetron.checkpoint.files import resolve_checkpoint
from moetron.checkpoint.integrity import verify_checkpoint
from moetron.checkpoint.state import check_format, load_weights
from moetron.config import RunConfig
from moetron.data.tokenizer import load_tokenizer
from moetron.errors import UserError


@dataclass
class OpenRun:
    """A checkpoint whose directory, config and state were read and checked (the tensors not yet)."""

    path: Path  # the iter_* directory
    cfg: RunConfig  # its config.yaml (tokenizer fields replaced by the overrides, when open_run was given some)
    state: dict  # its state.json

    @cached_property
    def tokenizer(self):
        """The tokenizer `cfg` names, checked against the model's vocabulary (built once)."""
        return load_tokenizer(self.cfg)

    def model(self, device: torch.device | str | None = None, mesh=None):
        """The model in eval mode with the checkpoint's weights: whole in this process (every expert, whatever
        layout saved them), or this rank's part at `mesh`'s layout (a `ParallelMesh`)."""
        from moetron.model.gpt import create_model

        device = device or default_device()
        if mesh is None:
            from moetron.parallel.device_backends import use_device_backends

            use_device_backends(device)
            model = create_model(self.cfg.model, device, self.cfg.train.seed)
        else:
            from moetron.parallel.parallelize import build_local_model

            model = build_local_model(self.cfg.model, mesh, device, self.cfg.train.seed)
        load_weights(self.path, model, mesh)
        return model.eval()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def open_run(load: str, flag: str = "--load", tokenizer_overrides: dict | None = None) -> OpenRun:
    """The checkpoint `load` names (a run directory, its `latest`, or one iter_* directory), checked.

    `tokenizer_overrides` ({field: path} of the data config's tokenizer files, from --vocab-file/--merge-file/
    --tokenizer-model) replace the tokenizer the config names (its files moved, or were given relative to another
    directory); they are checked against the model's vocabulary here, before any weight is read."""
    from moetron.config_cli import load_config

    path = resolve_checkpoint(load)
    if path is None:
        raise UserError(
            f"{flag} {load}: no checkpoint there (expected a run directory with a 'latest' file or an iter_* "
            f"directory); give the --save directory of a training run"
        )
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise UserError(f"{flag} {load}: {config_file} is missing; the checkpoint is incomplete, {flag} another")
    try:
        cfg, _ = load_config(str(config_file), {})
    except UserError as err:  # ConfigError included: a damaged or foreign config.yaml
        why = str(err).splitlines()[-1].strip(" -")
        raise UserError(f"{flag} {load}: {config_file} cannot be used ({why}); {flag} another checkpoint") from None
    state = check_format(path)
    verify_checkpoint(path)  # before any weight is read: a damaged file is refused here, naming it
    overrides = {k: v for k, v in (tokenizer_overrides or {}).items() if v is not None}
    if not overrides:
        return OpenRun(path, cfg, state)
    run = OpenRun(path, dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **overrides)), state)
    run.tokenizer  # noqa: B018 - the files exist and fit the model, before the weights are read
    return run


def load_model(load: str, device: torch.device | str | None = None,
               tokenizer_overrides: dict | None = None):  # fmt: skip
    """(model in eval mode with the checkpoint's weights, the run config it was saved with, the iter_* path):
    `open_run(load, tokenizer_overrides=...)` then `.model(device)`."""
    run = open_run(load, tokenizer_overrides=tokenizer_overrides)
    return run.model(device), run.cfg, run.path
