"""What context parallelism needs of a run, as pure arithmetic: its problems, found before launch.

`--context-parallel-size N` (Megatron's flag) splits every sequence over N ranks in 2·N zigzag chunks, so the
sequence length must be a multiple of 2·N. The layouts it composes with today: data parallelism at every ZeRO
stage (the dense gradients averaged, and at stages 1–3 the dense state sharded, over dp × cp: `dp_cp`), expert
parallelism (folded over dp × cp), tensor parallelism with or without sequence parallelism (TP splits the heads
each CP rank attends with; SP the CP rank's tokens) and pipeline parallelism (every stage runs the micro-batches'
zigzag chunks; a later stage takes their positions from `GPTModel.sequence_positions`, pp/split.py) and `--compile`
(the CP attention stays eager inside each compiled block, `parallel/compile.py`). Multi-latent attention, MTP and
expert replicas are refused with a one-line reason and the alternative rather than run wrongly (each needs the
split sequence handled in its own code: MLA's attention, the MTP modules' shifted labels, the replica plan's
ranks).

`--cp-comm-type` (Megatron-Core's flag and names) picks the attention across the split: `all_gather` (the
default), `p2p` (ring; no attention dropout: its backward would redraw every block's mask) or `a2a` (Ulysses; this
rank's query and key/value heads, after tensor parallelism, divisible by the CP size).
"""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dims import ParallelDims

CP_FLAG = "--context-parallel-size"
COMM_TYPES = ("all_gather", "p2p", "a2a")


def context_parallel_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """Every problem the run has with its context-parallel size, each with its fix (at cp == 1 only a bad
    `--cp-comm-type`)."""
    cp, comm = dims.cp, cfg.parallel.cp_comm_type
    p = [] if comm in COMM_TYPES else [f"--cp-comm-type {comm!r} is not one of {', '.join(COMM_TYPES)}"]
    if cp <= 1:
        return p
    seq = cfg.model.seq_length
    p += _comm_type_problems(cfg, dims)
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
    if cfg.model.multi_latent_attention:  # MLA's attention has no context-parallel path: it would see its chunks only
        out.append(("--multi-latent-attention", "use grouped-query attention (--num-key-value-heads) for long "
                    "sequences, or keep MLA at --context-parallel-size 1"))  # fmt: skip
    if cfg.model.mtp_num_layers:  # the MTP modules' layers and shifted labels would see one rank's chunks only
        out.append((f"--mtp-num-layers {cfg.model.mtp_num_layers}", "drop --mtp-num-layers (MTP trains on whole "
                    "sequences), or keep MTP at --context-parallel-size 1"))  # fmt: skip
    if par.moe_expert_replicas:  # the replica plan is made over the expert ranks of dp only
        out.append((f"--moe-expert-replicas {par.moe_expert_replicas}", "drop --moe-expert-replicas, or keep "
                    "replicas at --context-parallel-size 1"))  # fmt: skip
    return out


def _comm_type_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """What the chosen `--cp-comm-type` needs beyond the split itself."""
    m, comm, cp = cfg.model, cfg.parallel.cp_comm_type, dims.cp
    if comm == "p2p" and m.attention_dropout > 0:
        return [
            f"--cp-comm-type p2p with --attention-dropout {m.attention_dropout} is not supported: ring attention "
            "has no attention dropout; use --attention-dropout 0 or --cp-comm-type all_gather or a2a"
        ]
    if comm != "a2a" or m.num_attention_heads % dims.tp or m.kv_heads % dims.tp:
        return []  # heads indivisible by TP are reported by tensor parallelism's checks
    heads, kv_heads = m.num_attention_heads // dims.tp, m.kv_heads // dims.tp
    if heads % cp == 0 and kv_heads % cp == 0:
        return []
    return [
        f"--cp-comm-type a2a needs the query heads ({_per_rank(m.num_attention_heads, dims.tp)}) and key/value heads "
        f"({_per_rank(m.kv_heads, dims.tp)}) of a rank divisible by {CP_FLAG} {cp}: each rank attends with 1/{cp} "
        "of them; use --cp-comm-type p2p or all_gather, or a CP size dividing both"
    ]


def _per_rank(heads: int, tp: int) -> str:
    """A head count and, under tensor parallelism, what one TP rank holds of it."""
    return f"{heads} / --tensor-model-parallel-size {tp} = {heads // tp}" if tp > 1 else str(heads)
