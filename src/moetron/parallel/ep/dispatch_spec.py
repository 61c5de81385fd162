"""Which expert-parallel dispatcher a run uses, and the problems of its flags before launch.

    --moe-ep-dispatch uneven      (default) uneven-split all-to-all: one host read per MoE layer (`all_to_all.py`)
    --moe-ep-dispatch static      B-row blocks per peer, no host read per layer; one overflow check per optimizer step
                                  that re-runs an overflowed step exactly (`static_all_to_all.py`, `static_buffers.py`)
    --moe-ep-buffer-factor F      static, dropless: the blocks start at F × T·K / EP rows (grown on overflow)
    --moe-ep-overlap-chunks N     N > 1: the all-to-alls overlapped with expert compute, N chunks of local experts,
                                  the shared expert computed while chunk 0 travels (`overlap.py`)

Pure arithmetic on the configuration (no torch), read by `validate.py`. The combinations not built or not tested
yet are refused by name rather than run untested: each new dispatcher with the other (one static-and-chunked
schedule is not written yet), with `--moe-expert-replicas` (its own dispatcher), and with pipeline, tensor,
context parallelism, ZeRO 2–3 and `--compile` (the static step check all-reduces one value per MoE layer of this
rank, and FSDP gathers expert weights inside the experts' own forward, which the chunked one bypasses).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetron.parallel.dims import ParallelDims

MODES = ("uneven", "static")
DEFAULT_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class EPDispatchSpec:
    mode: str = "uneven"
    buffer_factor: float = DEFAULT_BUFFER_FACTOR
    overlap_chunks: int = 1

    @classmethod
    def from_config(cls, parallel) -> EPDispatchSpec:
        return cls(parallel.moe_ep_dispatch, parallel.moe_ep_buffer_factor, parallel.moe_ep_overlap_chunks)


PLAIN = EPDispatchSpec()


def ep_dispatch_problems(
    spec: EPDispatchSpec, experts_per_layer: list[int], dims: ParallelDims, parallel, compile_blocks: bool
) -> list[str]:
    """One line per problem of `--moe-ep-dispatch`, `--moe-ep-buffer-factor` and `--moe-ep-overlap-chunks`."""
    problems = []
    static, chunked = spec.mode == "static", spec.overlap_chunks != 1
    if spec.mode not in MODES:
        problems.append(f"--moe-ep-dispatch {spec.mode!r} is not one of {', '.join(MODES)}")
    if not spec.buffer_factor >= 1:
        problems.append(
            f"--moe-ep-buffer-factor {spec.buffer_factor:g} must be >= 1 (rows per peer block as a multiple of the "
            f"mean T·K / EP); e.g. {DEFAULT_BUFFER_FACTOR:g}"
        )
    elif spec.buffer_factor != DEFAULT_BUFFER_FACTOR and not static:
        problems.append(
            f"--moe-ep-buffer-factor {spec.buffer_factor:g} sizes the blocks of --moe-ep-dispatch static; "
            f"add --moe-ep-dispatch static or drop it"
        )
    if spec.overlap_chunks < 1:
        problems.append(f"--moe-ep-overlap-chunks {spec.overlap_chunks} must be >= 1 (1: no overlap)")
    flags = ([f"--moe-ep-dispatch {spec.mode}"] if static else []) + (
        [f"--moe-ep-overlap-chunks {spec.overlap_chunks}"] if chunked else []
    )
    if static and chunked:
        problems.append(f"{' and '.join(flags)} do not work together yet; use one of the two")
    for flag in flags:
        problems += _layout_problems(flag, dims, parallel, compile_blocks)
    if chunked and dims.ep > 1 and spec.overlap_chunks > 1:
        moe_experts = [e for e in experts_per_layer if e > 1]
        fewest_local = min(moe_experts) // dims.ep if moe_experts else 0
        if spec.overlap_chunks > fewest_local:
            problems.append(
                f"--moe-ep-overlap-chunks {spec.overlap_chunks} must be at most the experts each EP rank holds "
                f"({fewest_local} = --num-experts / --moe-expert-parallel-size {dims.ep}): a chunk is a group of "
                f"local experts; use at most {fewest_local}"
            )
    return problems


def _layout_problems(flag: str, dims: ParallelDims, parallel, compile_blocks: bool) -> list[str]:
    if dims.ep <= 1:
        return [f"{flag} needs --moe-expert-parallel-size > 1 (it changes the expert-parallel all-to-all); drop it"]
    refused = {  # setting → whether the run has it, and what else the fix may be
        f"--moe-expert-replicas {parallel.moe_expert_replicas}": (parallel.moe_expert_replicas > 0, ""),
        f"--pipeline-model-parallel-size {dims.pp}": (dims.pp > 1, ""),
        f"--tensor-model-parallel-size {dims.tp}": (dims.tp > 1, ""),
        f"--context-parallel-size {parallel.context_parallel_size}": (parallel.context_parallel_size > 1, ""),
        f"--zero-stage {parallel.zero_stage}": (parallel.zero_stage >= 2, ", or use --zero-stage 1"),
        "--compile": (compile_blocks, ", or drop --compile"),
    }
    return [
        f"{flag} is not supported with {setting} yet; drop {flag} (the default uneven dispatcher runs with "
        f"{setting}){alternative}"
        for setting, (on, alternative) in refused.items()
        if on
    ]
