"""Host reads per MoE layer forward+backward on the code path CUDA runs — each one a host sync on a GPU.

    python benchmarks/host_syncs.py                      # the grouped_mm backend (auto's pick on sm90/sm100, bf16)
    python benchmarks/host_syncs.py --backend batched    # auto's pick on other GPUs

Runs on a CPU, counting instead of timing: one MoE layer (8 experts, GELU experts with biases, so the per-row bias
gather is exercised) runs forward and backward (output and aux/z losses) inside `HostReadCounter`
(tests/support/host_read_counter.py), which counts every Python-level read of a tensor's value (`.item()`,
`.tolist()`, `int()`, `bool()`, `float()`, `__index__`, `.cpu()`, `.numpy()`, `.to("cpu")`). How the CUDA path is
taken on a CPU: the expert backend is forced (never the CPU-only expert-by-expert SwiGLU kernel), and the whole step
runs inside `cuda_code_path()`, so every CPU-only branch takes its CUDA form — for top-1 RTS that is
`keep_top_keys_top1` (a topk, no read) instead of the CPU's sort-based keep, which reads the device once on purpose.
Syncs inside C++ kernels are not visible to the counter; the MoE code avoids the ones CUDA has (bincount, nonzero,
repeat_interleave without output_size) by construction.

Prints one line per mode, `host reads per MoE layer: <mode> <N>`. Expected with grouped_mm: 0 for the three
local modes, 1 for `EP=2 all-to-all` (two gloo processes; the split sizes' `.tolist()`), 0 for `EP=2 all-to-all
static` (`--moe-ep-dispatch static`: B-row blocks per peer; its overflow flag is read once per optimizer step by
`parallel/ep/static_buffers.py`, not per layer). With batched, the dropless modes read the max load once.
tests/unit/test_host_reads.py and tests/distributed/test_host_reads_ep.py assert these counts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the counter is a test instrument
from host_sync_steps import EP_MODES, LOCAL_MODES, ep_reads, local_reads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["grouped_mm", "batched"], default="grouped_mm")
    args = parser.parse_args()
    for mode in LOCAL_MODES:
        print(f"host reads per MoE layer: {mode} {local_reads(mode, args.backend).total}")
    per_rank = ep_reads(args.backend)
    for mode in EP_MODES:
        print(f"host reads per MoE layer: {mode} {max(sum(by_mode[mode].values()) for by_mode in per_rank)}")


if __name__ == "__main__":
    main()
