"""`apply_cp`: hand every attention layer the context-parallel attention and the model its zigzag positions.

Under context parallelism a rank's forward receives its two zigzag chunks of every sequence (the loader keeps
them, `data/loader.py`). Three things change, all installed here from outside the model:
  - positions: `GPTModel.sequence_positions` gives the absolute position of each local token, so RoPE angles and
    learned position embeddings are those of the one-process run;
  - attention: each `SelfAttention.attend_fn` attends to the whole sequence's keys (`attention.py`);
  - attention dropout: each rank's stream key gets its CP rank (as TP's head shards do), so peers draw
    independent masks (SDPA draws inside the kernel: no layout can reproduce the one-process masks).
Everything else is per token and runs on the local tokens as it is. The loss needs no change: every rank holds
the same number of tokens and the LM loss is a plain mean, so the mean over CP ranks of the local means is the
mean over the whole sequence (Σ token losses / global token count), and the dense gradients, averaged over the
dp × cp ranks (`dp_cp`, parallel/dp/replicate.py), are the one-process gradients. MoE layers route their local
tokens like any others (capacity and the `global` aux loss per rank, as per data-parallel rank).
"""

from __future__ import annotations

import torch

from moetron.data.context_chunks import zigzag_positions
from moetron.model.gpt import GPTModel
from moetron.parallel.cp.attention import ContextParallelAttention
from moetron.parallel.mesh import ParallelMesh


def apply_cp(model: GPTModel, mesh: ParallelMesh) -> None:
    """Install context parallelism on `model` (nothing when cp == 1)."""
    size = mesh.size("cp")
    if size == 1:
        return
    rank = mesh.coords.cp
    attend = ContextParallelAttention(mesh.group("cp"), rank, size)

    def sequence_positions(local_length: int, device: torch.device) -> torch.Tensor:
        return zigzag_positions(local_length * size, rank, size, device)

    model.sequence_positions = sequence_positions
    for _, layer in model.layer_items():
        layer.self_attention.attend_fn = attend
        layer.self_attention.stream_shard += ("cp", rank)
