"""Layout-free randomness: dropout masks and routing draws that do not depend on how the model is split.

Megatron keeps two CUDA RNG streams (one shared by tensor-parallel peers, one per rank) and seeds them per
pipeline stage, so a run's draws change with the layout. moetron goes further: while a micro-batch runs, every
layer draws from its own stream seeded by

    (run seed, phase, index of the micro-batch's first sample in the dataset, layer name[, extra key])

so the draws of layer 7 for samples 128…131 are the same whether that layer runs in one process, on pipeline
stage 2, on any tensor-parallel rank (peers share the stream, as Megatron's default stream is shared) or on
data-parallel rank 3, and in whatever order a pipeline schedule runs the micro-batches. Every parallel layout
therefore reproduces the one-process loss curve even with dropout and random token selection on, and an
evaluation repeats exactly (its micro-batches have fixed sample indices).

Use:

    STREAMS.configure(seed)                         # once per run (the trainer does it)
    with STREAMS.micro_batch("train", sample):      # around one micro-batch's forward (the executor does it)
        with STREAMS.fork("layers", "7"):            # around one layer's forward (GPTModel does it)
            ...dropout, torch.rand...

Outside `micro_batch` (a model called directly, generation, tests) `fork` is a no-op and the global generator is
used as usual. Activation checkpointing composes: it saves the generator state inside the fork at forward time
and restores it for the recomputation. `fork` swaps the CPU generator and, when CUDA is initialised, the current
CUDA device's generator (their states are host-side: no device sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moetron.model.init import stable_seed


class RandomStreams:
    """Per-(micro-batch, layer) generator states, swapped into the default generators for the layer's forward."""

    def __init__(self) -> None:
        self.seed = 0
        self.key: tuple[str, int] | None = None

    def configure(self, seed: int) -> None:
        self.seed = seed

    @property
    def active(self) -> bool:
        return self.key is not None

    @contextlib.contextmanager
    def micro_batch(self, phase: str, first_sample: int) -> Iterator[None]:
        """Key every `fork` inside the block by (phase, the micro-batch's first dataset sample index)."""
        previous, self.key = self.key, (phase, int(first_sample))
        try:
            yield
        finally:
            self.key = previous

    def seed_for(self, *key: object) -> int:
        assert self.key is not None, "seed_for needs an active micro_batch"
        return stable_seed(self.seed, "/".join(str(part) for part in (*self.key, *key)))

    @contextlib.contextmanager
    def fork(self, *key: object) -> Iterator[None]:
        """Inside an active micro-batch: run the block on the stream of `key` (then restore the generators)."""
        if self.key is None:
            yield
            return
        generators = _default_generators()
        saved = [g.get_state() for g in generators]
        seed = self.seed_for(*key)
        for g in generators:
            g.manual_seed(seed)
        try:
            yield
        finally:
            for g, state in zip(generators, saved, strict=True):
                g.set_state(state)


def _default_generators() -> list[torch.Generator]:
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return generators


STREAMS = RandomStreams()
