"""One micro-batch as both executors (`executor.py`, `pipeline_executor.py`) receive it; a module of its own so that
the pipeline executor does not import the module that builds it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    tokens_BT: torch.Tensor
    labels_BT: torch.Tensor
    first_sample: int  # dataset index of the batch's first sample: keys the layers' random streams

    @classmethod
    def from_loader(cls, loader, device: torch.device) -> MicroBatch:
        """The loader's next `[mbs, seq + 1]` batch, split into inputs and next-token labels (under context
        parallelism: this rank's chunks of both, `loader.local_chunks`)."""
        first = loader.next_first_sample
        batch = loader.next_micro_batch().to(device, non_blocking=True)
        return cls(local_chunks(loader, batch[:, :-1]), local_chunks(loader, batch[:, 1:]), first)


def local_chunks(loader, x_BT: torch.Tensor) -> torch.Tensor:
    """This context-parallel rank's part of `x_BT` (`DistributedBatchLoader.local_chunks`); all of it from a loader
    that does not split sequences."""
    split = getattr(loader, "local_chunks", None)
    return x_BT if split is None else split(x_BT)
