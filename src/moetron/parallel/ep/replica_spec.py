"""What `--moe-expert-replicas K` needs of the rest of the configuration: its problems, before launch.

Pure arithmetic (no torch), read by `validate.py`. K replica slots per EP rank copy hot experts from other EP
ranks, so it needs expert parallelism (EP > 1) and fewer slots than a rank's own experts (a rank holding K or more
copies would hold more weights than its own share: more EP is the better fix there).

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
    moe_experts = [e for e in experts_per_layer if e > 1]
    fewest_local = min(moe_experts) // dims.ep if moe_experts else 0
    if replicas >= fewest_local:
        return [
            f"{flag} must be below the experts each EP rank holds ({fewest_local} = --num-experts / "
            f"--moe-expert-parallel-size {dims.ep}); use at most {max(fewest_local - 1, 0)} or more experts per rank"
        ]
    return []
