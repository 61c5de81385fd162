"""Peak bytes live in torch's CPU allocator while a function runs (shared by the benchmark scripts)."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of allocated-minus-freed bytes during `fn()`, relative to its start.

    Only the profiler's raw allocation events count ("[memory]": +bytes on alloc, -bytes on free); op events would
    double count.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
