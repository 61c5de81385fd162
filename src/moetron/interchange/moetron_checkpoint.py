"""A moetron checkpoint read one tensor at a time (export never holds the whole model).

    ckpt = MoetronCheckpoint.open("runs/moe")        # a run directory (its `latest`) or one iter_* directory
    ckpt.cfg.model, ckpt.shape("layers.1.mlp.experts.w1_EDF"), ckpt.read("word_embeddings.weight")

Opening it is `moetron.checkpoint.open_run` (the directory, config.yaml and state.json, with the same errors as
every other command), then DCP's metadata. The tensors are DCP's global tensors (`model.<name>`), so any layout
that saved the checkpoint reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetron.checkpoint import files
from moetron.checkpoint.open import open_run
from moetron.checkpoint.state import single_process_quiet
from moetron.config import RunConfig


@dataclass
class MoetronCheckpoint:
    path: Path  # the iter_* directory
    cfg: RunConfig
    state: dict  # state.json
    shapes: dict[str, tuple[int, ...]]  # parameter or buffer name (no `model.` prefix) → global shape
    dtypes: dict[str, torch.dtype]

    @classmethod
    def open(cls, load: str, flag: str = "--load") -> MoetronCheckpoint:
        run = open_run(load, flag)
        path = run.path
        try:
            with single_process_quiet():
                metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as err:  # noqa: BLE001 - a truncated or foreign .metadata file
            raise files.corrupt(path, f".metadata: {_reason(err)}") from None
        shapes, dtypes = {}, {}
        for key, meta in metadata.items():
            if key.startswith("model.") and hasattr(meta, "size"):
                shapes[key[len("model.") :]] = tuple(meta.size)
                dtypes[key[len("model.") :]] = meta.properties.dtype
        return cls(path, run.cfg, run.state, shapes, dtypes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise files.corrupt(self.path, f"it lacks model.{name}; saved from another model? (see its config.yaml)")
        return self.shapes[name]

    def meta(self, name: str) -> torch.Tensor:
        """A meta-device tensor of `name`'s global shape (for planning without reading)."""
        return torch.empty(self.shape(name), dtype=self.dtypes[name], device="meta")

    def read(self, name: str) -> torch.Tensor:
        """The global tensor `name`, read alone from the checkpoint's files."""
        out = torch.empty(self.shape(name), dtype=self.dtypes[name])
        try:
            with single_process_quiet() as no_dist:
                reader = dcp.FileSystemReader(str(self.path))
                dcp.load({f"model.{name}": out}, storage_reader=reader, no_dist=no_dist)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - a truncated shard (DCP wraps it)
            raise files.corrupt(self.path, f"reading model.{name}: {_reason(err)}") from None
        return out


def _reason(err: BaseException) -> str:
    """The first line of what went wrong (DCP wraps the reader's exception in a CheckpointException per rank)."""
    if isinstance(err, CheckpointException) and err.failures:
        first = next(iter(err.failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0].split(". ")[0][:200]
