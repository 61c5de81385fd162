"""Accelerators the planner knows: memory, peak TFLOP/s and what the memory model must assume about them.

Peak TFLOP/s are dense fp16/bf16 tensor-core numbers (no sparsity), the same table `moetron.model.flops`
uses for MFU. Memory is in GiB, as `nvidia-smi` reports it (a "24 GB" RTX 4090 has 24 GiB).
`--gpu-memory` overrides the size of any entry; unknown names need `--gpu-memory` (and `--peak-tflops`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moetron.errors import UserError
from moetron.model.flops import CPU_PEAK_TFLOPS, PEAK_TFLOPS

GIB = 1024**3


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    peak_tflops: float
    kind: str = "cuda"  # cuda: flash attention and bool dropout masks; cpu: the CPU kernels (see memory.py)
    context_bytes: int = GIB  # CUDA context, cuBLAS/NCCL workspaces: memory no tensor accounts for


# name → (memory GiB, peak TFLOP/s); the keys are what `--gpu-type` accepts (case-insensitive)
_TABLE = {
    "4090": (24, PEAK_TFLOPS["RTX 4090"]),
    "3090": (24, 71.0),
    "V100-16GB": (16, PEAK_TFLOPS["V100"]),
    "V100-32GB": (32, PEAK_TFLOPS["V100"]),
    "A100-40GB": (40, PEAK_TFLOPS["A100"]),
    "A100-80GB": (80, PEAK_TFLOPS["A100"]),
    "A6000": (48, 155.0),
    "L40S": (48, 362.0),
    "H100": (80, PEAK_TFLOPS["H100"]),
    "H200": (141, PEAK_TFLOPS["H200"]),
}
ALIASES = {"rtx4090": "4090", "rtx3090": "3090", "a100": "A100-80GB", "v100": "V100-32GB", "h100-80gb": "H100"}
KNOWN = [*_TABLE, "cpu"]


def parse_memory(text: str) -> int:
    """'24GB', '24GiB', '80G', '16384MB' → bytes (GB and GiB both mean 2^30 bytes, as nvidia-smi shows)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([GgMmTt])?(i?[Bb])?\s*", text)
    if not match:
        raise UserError(f"--gpu-memory {text!r} is not a size; write it like 24GB, 80GiB or 16384MB")
    number, unit = float(match.group(1)), (match.group(2) or "G").upper()
    return int(number * {"M": 1024**2, "G": GIB, "T": 1024**4}[unit])


def accelerator(gpu_type: str | None, gpu_memory: str | None = None, peak: float | None = None) -> Accelerator:
    """The device to plan for: a table entry, adjusted by `--gpu-memory` / `--peak-tflops`."""
    name = gpu_type or "A100-80GB"
    key = ALIASES.get(name.lower(), name)
    match = next((k for k in _TABLE if k.lower() == key.lower()), None)
    if name.lower() == "cpu":
        if gpu_memory is None:
            raise UserError("--gpu-type cpu needs --gpu-memory (the RAM you give the run, e.g. 16GB)")
        return Accelerator("cpu", parse_memory(gpu_memory), peak or CPU_PEAK_TFLOPS, kind="cpu", context_bytes=0)
    if match is None:
        if gpu_memory is None or peak is None:
            raise UserError(
                f"--gpu-type {name!r} is not in the table ({', '.join(KNOWN)}); pick one, or describe it "
                f"with --gpu-memory SIZE and --peak-tflops N"
            )
        return Accelerator(name, parse_memory(gpu_memory), float(peak))
    memory_gib, table_peak = _TABLE[match]
    memory = parse_memory(gpu_memory) if gpu_memory else memory_gib * GIB
    return Accelerator(match, memory, float(peak) if peak else table_peak)
