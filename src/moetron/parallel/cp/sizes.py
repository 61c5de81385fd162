"""What context parallelism needs of a run, as pure arithmetic: its problems, found before launch.

`--context-parallel-size N` (Megatron's flag) splits every sequence over N ranks in 2·N zigzag chunks, so the
sequence length must be a multiple of 2·N. The layouts it composes with today: data parallelism at ZeRO stage 0
(the dense gradients averaged over dp × cp), expert parallelism (folded over dp × cp) and tensor parallelism with or
without sequence parallelism (TP splits the heads each CP rank attends with; SP the CP rank's tokens). Pipeline
parallelism, ZeRO stages 1–3, `--compile`, multi-latent attention, MTP and expert replicas are refused with a
one-line reason rather than run wrongly (each needs the split sequence handled in its own code: the pipeline's
stage inputs and positions, ZeRO's shards over dp only, a compiled block's collectives, MLA's attention, the MTP
modules' shifted labels, the replica plan's ranks).
"""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dims import ParallelDims

CP_FLAG = "--context-parallel-size"


def context_parallel_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """Every problem the run has with its context-parallel size, each with its fix (none at cp == 1)."""
    cp = dims.cp
    if cp <= 1:
        return []
    seq = cfg.model.seq_length
    p: list[str] = []
    if seq % (2 * cp):
        p.append(
            f"--seq-length {seq} is not divisible by 2 × {CP_FLAG} {cp} = {2 * cp}: every context-parallel rank "
            f"holds two equal chunks of each sequence; use a multiple of {2 * cp}"
        )
    p += [f"{CP_FLAG} {cp} with {what} is not supported yet; {fix}" for what, fix in _unsupported(cfg, dims)]
    return p


def _unsupported(cfg: RunConfig, dims: ParallelDims) -> list[tuple[str, str]]:
    """(what the run asks for, the fix) for every option context parallelism does not compose with yet."""
    par, out = cfg.parallel, []
    if dims.pp > 1:
        out.append((f"--pipeline-model-parallel-size {dims.pp}", "use one of the two"))
    if par.zero_stage > 0 or par.use_distributed_optimizer:
        stage = f"--zero-stage {par.zero_stage}" if par.zero_stage > 0 else "--use-distributed-optimizer"
        out.append((stage, "use --zero-stage 0 (ZeRO shards over the data-parallel ranks only)"))
    if cfg.train.compile:
        out.append(("--compile", "drop --compile (the attention's collectives are not compiled)"))
    if cfg.model.multi_latent_attention:  # MLA's attention has no context-parallel path: it would see its chunks only
        out.append(("--multi-latent-attention", "use one of the two"))
    if cfg.model.mtp_num_layers:  # the MTP modules' layers and shifted labels would see one rank's chunks only
        out.append((f"--mtp-num-layers {cfg.model.mtp_num_layers}", "use one of the two"))
    if par.moe_expert_replicas:  # the replica plan is made over the expert ranks of dp only
        out.append((f"--moe-expert-replicas {par.moe_expert_replicas}", "use one of the two"))
    return out
