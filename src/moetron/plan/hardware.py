"""Accelerators the planner knows: memory, peak TFLOP/s and what the memory model must assume about them.

Peak TFLOP/s come from `moetron.model.flops.PEAK_TFLOPS`, the one table MFU also uses; this module adds
only the memory sizes. Memory is in GiB, as `nvidia-smi` reports it (a "24 GB" RTX 4090 has 24 GiB).
`--gpu-memory` overrides the size of any entry; unknown names need `--gpu-memory` (and `--peak-tflops`).
With only `--gpu-memory`, the device is "a GPU of that size" with the default device's peak, and says so.
"""

from __future__ import annotations

import math
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
    assumed: str = ""  # what was not given and had to be assumed, said in the report so nobody is misled


def with_article(label: str) -> str:
    """'a 24 GiB GPU', 'an A100-80GB', 'an 80 GiB GPU', 'an H100': by the sound of the first letter or number."""
    vowel_sound = label[:1].upper() in set("AEFHILMNORSX8") or label.startswith(("11 ", "18 "))
    return f"{'an' if vowel_sound else 'a'} {label}"


# name → (memory GiB, peak TFLOP/s); the keys are what `--gpu-type` accepts (case-insensitive)
_TABLE = {
    "5090": (32, PEAK_TFLOPS["RTX 5090"]),
    "4090": (24, PEAK_TFLOPS["RTX 4090"]),
    "3090": (24, PEAK_TFLOPS["RTX 3090"]),
    "V100-16GB": (16, PEAK_TFLOPS["V100"]),
    "V100-32GB": (32, PEAK_TFLOPS["V100"]),
    "A100-40GB": (40, PEAK_TFLOPS["A100"]),
    "A100-80GB": (80, PEAK_TFLOPS["A100"]),
    "A6000": (48, PEAK_TFLOPS["A6000"]),
    "L40S": (48, PEAK_TFLOPS["L40S"]),
    "H100": (80, PEAK_TFLOPS["H100"]),
    "H200": (141, PEAK_TFLOPS["H200"]),
}
DEFAULT_GPU = "A100-80GB"  # planned for when neither --gpu-type nor --gpu-memory is given
ALIASES = {
    "rtx5090": "5090",
    "rtx4090": "4090",
    "rtx3090": "3090",
    "a100": "A100-80GB",
    "v100": "V100-32GB",
    "h100-80gb": "H100",
}
KNOWN = [*_TABLE, "cpu"]


def parse_memory(text: str) -> int:
    """'24GB', '24GiB', '80G', '16384MB' → bytes (GB and GiB both mean 2^30 bytes, as nvidia-smi shows)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([GgMmTt])?(i?[Bb])?\s*", text)
    if not match:
        raise UserError(f"--gpu-memory {text!r} is not a size; write it like 24GB, 80GiB or 16384MB")
    number, unit = float(match.group(1)), (match.group(2) or "G").upper()
    size = int(number * {"M": 1024**2, "G": GIB, "T": 1024**4}[unit])
    if size <= 0:  # the pattern admits no sign, inf or nan: only zero is left to refuse
        raise UserError(f"--gpu-memory {text!r} is 0 bytes; give the memory per GPU, e.g. 24GB, 80GiB or 16384MB")
    return size


def check_peak(peak: float | None) -> None:
    """`--peak-tflops` (a flag of `moetron train` too) sizes the step time: a positive, finite number, or unset."""
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        raise UserError(
            f"--peak-tflops {peak:g} must be a positive number of TFLOP/s per GPU (e.g. 312 for an A100's bf16 "
            "peak), or left out to use the --gpu-type's"
        )


def sized_gpu(gpu_memory: str, peak: float | None) -> Accelerator:
    """Only `--gpu-memory`: "a 24 GiB GPU" — not an A100 that happens to have 24 GiB; the peak is assumed."""
    memory = parse_memory(gpu_memory)
    label = f"{memory / GIB:g} GiB GPU"
    if peak:
        return Accelerator(label, memory, float(peak))
    default_peak = _TABLE[DEFAULT_GPU][1]
    note = f"no --gpu-type: step time assumes {default_peak:g} peak TFLOP/s (an {DEFAULT_GPU}'s); set --peak-tflops"
    return Accelerator(label, memory, default_peak, assumed=note)


def accelerator(gpu_type: str | None, gpu_memory: str | None = None, peak: float | None = None) -> Accelerator:
    """The device to plan for: a table entry, adjusted by `--gpu-memory` / `--peak-tflops`."""
    check_peak(peak)
    if gpu_type is None and gpu_memory is not None:
        return sized_gpu(gpu_memory, peak)
    name = gpu_type or DEFAULT_GPU
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
    note = "" if gpu_type else f"no --gpu-type or --gpu-memory: planned for the default, {with_article(match)}"
    return Accelerator(match, memory, float(peak) if peak else table_peak, assumed=note)
