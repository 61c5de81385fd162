"""The problems of --moe-ep-dispatch, --moe-ep-buffer-factor and --moe-ep-overlap-chunks, all at once, before launch."""

from __future__ import annotations

from moetron.config import ParallelConfig
from moetron.parallel.dims import ParallelDims
from moetron.parallel.ep.dispatch_spec import EPDispatchSpec, ep_dispatch_problems


def problems(dims: ParallelDims, experts=(8, 8), compile_blocks=False, **flags) -> list[str]:
    parallel = ParallelConfig(**flags)
    return ep_dispatch_problems(EPDispatchSpec.from_config(parallel), list(experts), dims, parallel, compile_blocks)


def test_defaults_and_supported_layouts_have_no_problem():
    assert problems(ParallelDims(world_size=2, dp=2)) == []
    assert problems(ParallelDims(world_size=4, dp=4, ep=2), moe_ep_dispatch="static", zero_stage=1) == []
    assert problems(ParallelDims(world_size=4, dp=4, ep=2), moe_ep_overlap_chunks=4) == []


def test_every_problem_is_reported_at_once():
    dims = ParallelDims(world_size=4, dp=2, pp=2, ep=2)
    got = problems(dims, experts=(1, 8, 4), compile_blocks=True, moe_ep_dispatch="static", moe_ep_overlap_chunks=3)
    text = "\n".join(got)
    assert "--moe-ep-dispatch static and --moe-ep-overlap-chunks 3 do not work together yet" in text
    assert "--moe-ep-dispatch static is not supported with --pipeline-model-parallel-size 2 yet" in text
    assert "--moe-ep-overlap-chunks 3 is not supported with --compile yet" in text
    # each refusal says what runs instead: the default dispatcher (and, for ZeRO 2–3, stage 1)
    assert (
        "drop --moe-ep-dispatch static (the default uneven dispatcher runs with --pipeline-model-parallel-size 2)"
        in text
    )
    zero = problems(ParallelDims(world_size=4, dp=4, ep=2), moe_ep_dispatch="static", zero_stage=3)
    assert zero == [
        "--moe-ep-dispatch static is not supported with --zero-stage 3 yet; drop --moe-ep-dispatch static (the "
        "default uneven dispatcher runs with --zero-stage 3), or use --zero-stage 1"
    ]
    assert "--moe-ep-overlap-chunks 3 must be at most the experts each EP rank holds (2 = " in text
    assert len(got) == 6  # the pair; PP and --compile for each of the two flags; the chunks over 2 local experts


def test_bad_values_and_a_factor_without_static_are_named():
    dims = ParallelDims(world_size=2, dp=2, ep=2)
    assert problems(dims, moe_ep_dispatch="fixed") == ["--moe-ep-dispatch 'fixed' is not one of uneven, static"]
    assert problems(dims, moe_ep_buffer_factor=2.0)[0].startswith("--moe-ep-buffer-factor 2 sizes the blocks of")
    assert problems(dims, moe_ep_dispatch="static", moe_ep_buffer_factor=float("nan"))[0].startswith(
        "--moe-ep-buffer-factor nan must be >= 1"
    )
    assert problems(dims, moe_ep_overlap_chunks=0) == ["--moe-ep-overlap-chunks 0 must be >= 1 (1: no overlap)"]
    assert problems(ParallelDims(world_size=2, dp=2), moe_ep_overlap_chunks=2)[0].startswith(
        "--moe-ep-overlap-chunks 2 needs --moe-expert-parallel-size > 1"
    )
