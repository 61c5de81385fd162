"""What `--moe-expert-replicas K` needs of the rest of the configuration: its problems, before launch.

Pure arithmetic (no torch), read by `validate.py`. K replica slots per EP rank copy hot experts from other EP
ranks, so it needs expert parallelism (EP > 1). K may reach or exceed a rank's own experts — one expert per rank
(Mixtral's 8 on EP 8, DeepSeek-V3's 256 on EP 256) is where one hot expert hurts most, and a slot there halves it;
the slots' weights are memory on top of the rank's share, which `moetron plan` counts (`replica_slot_bytes`).

Every other layout composes (tested against the same run without replicas, `tests/distributed/test_expert_replicas.py`):
ZeRO 1–3 (the replica weights are read inside the experts' forward, after FSDP2 has gathered them, and their
gradients reach the owner before FSDP2 reduce-scatters it, `replicas.py`), tensor parallelism + SP (folding: each
TP rank's token share is replicated over its own EP group), expert TP (the EP group holds one channel slice: every
replica is copied from the owner with the same slice), `--compile`, and pipelines (each stage's MoE layers
replicate within that stage's EP group) on every schedule. Zero bubble needs its parameter groups merged exactly
(`parallel/pp/weight_groups.py`: torch's grouping left an expert weight in two groups, whose weight passes both walked
the replica all-to-all's backward). Context parallelism refuses replicas itself
(`cp/sizes.py`), as do the static and overlapped dispatchers (`dispatch_spec.py`).
"""

from __future__ import annotations

from moetron.parallel.dims import ParallelDims


def expert_replica_problems(replicas: int, experts_per_layer: list[int], dims: ParallelDims) -> list[str]:
    """One line per problem of `--moe-expert-replicas` (none when it is 0, today's behaviour)."""
    if replicas == 0:
        return []
    flag = f"--moe-expert-replicas {replicas}"
    if replicas < 0:
        return [f"{flag} must be >= 0 (replica slots per expert-parallel rank; 0 turns replication off)"]
    if dims.ep <= 1:
        return [f"{flag} needs --moe-expert-parallel-size > 1 (replicas copy experts between EP ranks); drop it"]
    return []
