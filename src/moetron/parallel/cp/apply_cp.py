"""`apply_cp`: hand every attention layer the context-parallel attention and the model its zigzag positions.

Under context parallelism a rank's forward receives its two zigzag chunks of every sequence (the loader keeps
them, `data/loader.py`). Three things change, all installed here from outside the model:
  - positions: `GPTModel.sequence_positions` gives the absolute position of each local token, so RoPE angles and
    learned position embeddings are those of the one-process run;
  - attention: each `SelfAttention.attend_fn` attends to the whole sequence's keys, by `--cp-comm-type`:
    `all_gather` (K/V gathered, `attention.py`), `p2p` (K/V blocks around a ring, `ring.py`) or `a2a` (heads
    exchanged for tokens, `ulysses.py`); all three are exact (the one-process result up to rounding);
  - attention dropout: each rank's stream key gets its CP rank (as TP's head shards do), so peers draw
    independent masks (SDPA draws inside the kernel: no layout can reproduce the one-process masks).
  - the aux losses: each router's `sequence_mean` averages the route fractions over the CP ranks
    (`SequenceMean`): of every sequence for `--moe-aux-loss-type seq`, of the micro-batch for `global`, so each is
    the loss of the whole sequences (`model/moe/routing/router.py`);
  - the routers' random draws and capacity decisions: each router's `token_rows` places its tokens in the whole
    micro-batch (`whole_sequence.py`), so the sampled second expert, RSample / Jitter noise, the RTS keys, the
    capacity and the dropped routes are the one-process run's;
  - hidden dropout: the one-process mask at this rank's positions (`apply_cp_dropout`, before tensor parallelism,
    whose sequence shards then keep their part of it: `parallel/sequence_dropout.py`).
Everything else is per token and runs on the local tokens as it is. The loss needs no change: every rank holds
the same number of tokens and the LM loss is a plain mean, so the mean over CP ranks of the local means is the
mean over the whole sequence (Σ token losses / global token count), and the dense gradients, averaged over the
dp × cp ranks (`dp_cp`, parallel/dp/replicate.py), are the one-process gradients. So every layout with CP follows
the one-process run with the default routing and dropout on — except attention dropout, which SDPA draws inside
its kernel (no split can reproduce those masks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetron.data.context_chunks import zigzag_positions
from moetron.model.gpt import GPTModel
from moetron.model.mtp import mtp_transformer_layers
from moetron.parallel.cp.attention import ContextParallelAttention
from moetron.parallel.cp.ring import RingAttention
from moetron.parallel.cp.ulysses import UlyssesAttention
from moetron.parallel.cp.whole_sequence import ZigzagTokens
from moetron.parallel.diagnosis import Site
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.sequence_dropout import zigzag_dropout

# `--cp-comm-type` → the attention every layer gets (Megatron-Core's names)
ATTENTIONS = {"all_gather": ContextParallelAttention, "p2p": RingAttention, "a2a": UlyssesAttention}


def apply_cp(model: GPTModel, mesh: ParallelMesh, comm_type: str = "all_gather") -> None:
    """Install context parallelism on `model` (nothing when cp == 1), attending as `comm_type` says."""
    size = mesh.size("cp")
    if size == 1:
        return
    rank = mesh.coords.cp
    attend = ATTENTIONS[comm_type](mesh.group("cp"), rank, size)

    def sequence_positions(local_length: int, device: torch.device) -> torch.Tensor:
        return zigzag_positions(local_length * size, rank, size, device)

    model.sequence_positions = sequence_positions
    for _, layer in model.layer_items():
        layer.self_attention.attend_fn = attend
        layer.self_attention.stream_shard += ("cp", rank)
    for moe in model.moe_layers():
        moe.router.sequence_mean = SequenceMean(mesh.group("cp"), size)
        moe.router.token_rows = ZigzagTokens(mesh.group("cp"), rank, size)


def apply_cp_dropout(model: GPTModel, mesh: ParallelMesh) -> None:
    """Hidden and embedding dropout with the one-process masks at this CP rank's zigzag positions (nothing when
    cp == 1). Before `apply_tp`: sequence parallelism keeps its shard of these positions, and the module it hooks
    (the embedding dropout) is then the one that stays."""
    size = mesh.size("cp")
    if size == 1:
        return
    rank = mesh.coords.cp
    for layer in [layer for _, layer in model.layer_items()] + mtp_transformer_layers(model):
        layer.hidden_dropout = zigzag_dropout(layer.hidden_dropout, rank, size)
    if getattr(model, "embedding_dropout", None) is not None:
        model.embedding_dropout = zigzag_dropout(model.embedding_dropout, rank, size)


class SequenceMean:
    """A per-sequence statistic (no gradient) averaged over the CP ranks, each of which holds an equal part of every
    sequence: an all-reduce, written here because the router's statistic is a plain tensor, not a DTensor."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size
        self.site = Site("the context-parallel all-reduce of the sequence aux loss's route fractions", group,
                         "context-parallel")  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.detach().clone()
        with self.site:
            dist.all_reduce(out, group=self.group)
        return out / self.size
