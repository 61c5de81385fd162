"""Where reading a tensor's value on the host is free.

On a GPU, reading a device tensor's value on the host (`.item()`, `int(t)`, `.tolist()`, `if t:`, `.cpu()`,
…) waits until every queued kernel has run: the GPU then idles while Python launches the next kernels. The
MoE forward and backward avoid such reads on CUDA. CPU-only kernels that read the device on purpose decide by the
tensors' device where they are chosen (the router's sort-based RTS keep: `deepspeed_gating._keep_top1`); the last
one asking here is the experts' expert-by-expert SwiGLU (`experts/grouped.py`), and this module goes once the CPU
experts backend is picked per device.

The reads are counted on a CPU by the test instrument in tests/support/host_read_counter.py, whose
`cuda_code_path()` swaps this function for one that answers False, so the CPU runs the branch CUDA runs. The
function itself stays a plain device check: it is on the hot path, and consults no switch.
"""

from __future__ import annotations

import torch


def host_reads_are_free(device: torch.device) -> bool:
    """True where reading a tensor's value waits for nothing: a CPU tensor."""
    return device.type == "cpu"
