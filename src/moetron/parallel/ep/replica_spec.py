"""What `--moe-expert-replicas K` needs of the rest of the configuration: its problems, before launch.

Pure arithmetic (no torch), read by `validate.py`. K replica slots per EP rank copy hot experts from other EP
ranks, so it needs expert parallelism (EP > 1) and fewer slots than a rank's own experts (a rank holding K or more
copies would hold more weights than its own share: more EP is the better fix there). The combinations not built yet
are refused by name rather than run untested: tensor parallelism (not tested with replicas yet), expert tensor
parallelism (every replica would need its channel slice from the matching TP peer), ZeRO 2–3 (FSDP shards the
expert weights a replica is copied from, and gathers them only inside the experts' own forward), pipeline
parallelism and `--compile`.
"""

from __future__ import annotations

from moetron.parallel.dims import ParallelDims


def expert_replica_problems(
    replicas: int, experts_per_layer: list[int], dims: ParallelDims, zero_stage: int, compile_blocks: bool
) -> list[str]:
    """One line per problem of `--moe-expert-replicas` (none when it is 0, today's behaviour)."""
    if replicas == 0:
        return []
    flag = f"--moe-expert-replicas {replicas}"
    if replicas < 0:
        return [f"{flag} must be >= 0 (replica slots per expert-parallel rank; 0 turns replication off)"]
    if dims.ep <= 1:
        return [f"{flag} needs --moe-expert-parallel-size > 1 (replicas copy experts between EP ranks); drop it"]
    problems = []
    moe_experts = [e for e in experts_per_layer if e > 1]
    fewest_local = min(moe_experts) // dims.ep if moe_experts else 0
    if replicas >= fewest_local:
        problems.append(
            f"{flag} must be below the experts each EP rank holds ({fewest_local} = --num-experts / "
            f"--moe-expert-parallel-size {dims.ep}); use at most {max(fewest_local - 1, 0)} or more experts per rank"
        )
    refused = {
        f"--tensor-model-parallel-size {dims.tp}": dims.tp > 1,
        f"--expert-tensor-parallel-size {dims.etp}": dims.etp > 1,
        f"--zero-stage {zero_stage}": zero_stage >= 2,
        f"--pipeline-model-parallel-size {dims.pp}": dims.pp > 1,
        "--compile": compile_blocks,
    }
    for setting, present in refused.items():
        if present:
            problems.append(f"{flag} is not supported with {setting} yet; drop one of them")
    return problems
