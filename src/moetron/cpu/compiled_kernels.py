"""moetron's CPU kernels in C++ (`csrc/`), compiled on first use and cached: one extension module with

    kernels = compiled_cpu_kernels()  # the loaded module, or None: its callers then run their Python code
    kernels.swiglu_forward / swiglu_backward   # the expert-by-expert SwiGLU (`experts.ExpertByExpertSwiGLU`)
    kernels.first_max_column                   # the router's top-1 pick (`first_max_column` below)
    kernels.softmax_gradient_rows              # the fused LM head's softmax (`softmax_gradient_rows` below)
    kernels.fused_head_forward / transpose_scaled       # the fused LM head's fp32 chunks, a thread per chunk
                                               # (`fused_head_kernels` below, `fused_cross_entropy`)
    kernels.add_rows                           # index_add_ of rows on one thread (`index_add_rows` below)

Why C++: at E = 64 small experts the Python loop makes ~17 ATen calls per expert, and the interpreter and ATen's
dispatch around them cost more than the element-wise work; the kernel makes the same BLAS calls directly and fuses
the element-wise passes (see the source). It computes the same bits as the Python loop: every process checks that
on a small problem before using it (`experts.compiled_engine`) and refuses it if any output or gradient
differs, so the two are interchangeable.

Built with torch's JIT extension builder (it needs a C++ compiler and ninja; none is needed to install moetron) for
the CPU capability ATen dispatches to here (`torch.backends.cpu.get_cpu_capability()`), so that ATen's vector
code is the same. The build goes to a private temporary directory and is then moved into the cache under a key
hashed from the sources' content (not their path), the flags (the ISA level among them), the torch and Python
versions: an unchanged source is never built again, in a new process, session or clone. Concurrent processes never
wait on a lock (a killed build leaves no stale lock behind, as torch's shared build directory would). Cache:
`$MOETRON_KERNEL_CACHE`, else `~/.cache/moetron/kernels`. `MOETRON_CPU_KERNELS=0` turns them off (the Python code runs).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "module.cpp",
        "expert_by_expert_swiglu.cpp",
        "first_max_column.cpp",
        "softmax_gradient_rows.cpp",
        "fused_head.cpp",
        "add_rows.cpp",
    )
]
# The ISA flags ATen's own kernels of each capability are compiled with (cmake/Codegen.cmake), and the macros
# that select that capability's Vectorized<float> in the ATen headers.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


# torch's release builds (torch.__config__.show()): the same code generation for the scalar tails.
_TORCH_BUILD_FLAGS = ["-O2", "-fno-math-errno", "-fno-trapping-math"]


def _capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _CAPABILITY_FLAGS else "DEFAULT"


def build_flags(capability: str) -> list[str]:
    """torch's own optimisation flags, the capability's ISA flags and macros, and -fopenmp where ATen runs on
    OpenMP: `at::parallel_for` is inline OpenMP code in the ATen headers, and without the pragma compiled in it runs
    one chunk, whose vector-loop tail falls elsewhere than in ATen's kernels at two threads and more. Compiled only,
    not linked: the GOMP calls resolve to the OpenMP runtime torch has loaded, so the team sizes are torch's."""
    defines = [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return [*_TORCH_BUILD_FLAGS, *_CAPABILITY_FLAGS[capability], *defines, *openmp]


def cache_dir() -> Path:
    return Path(os.environ.get("MOETRON_KERNEL_CACHE") or Path.home() / ".cache" / "moetron" / "kernels")


def _module_name(flags: list[str]) -> str:
    texts = [path.read_text() for path in sorted(CSRC.iterdir()) if path.suffix in (".cpp", ".h")]
    key = "\n".join([*texts, *flags, torch.__version__, sys.version, platform.machine()])
    return "moetron_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built here (None: it can be tried)."""
    if os.environ.get("MOETRON_CPU_KERNELS", "1") == "0":
        return "MOETRON_CPU_KERNELS=0"
    if not all(path.is_file() for path in SOURCES):  # e.g. an install without the package data
        return f"the kernel sources are not in {CSRC}"
    if not sys.platform.startswith("linux"):
        return f"built on Linux only (this is {sys.platform})"
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _load_cached(name: str) -> ModuleType | None:
    path = cache_dir() / f"{name}.so"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, flags: list[str]) -> ModuleType:
    from torch.utils.cpp_extension import load

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    print(f"moetron: compiling the CPU kernels once (~1 min; cached in {cache})", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}-") as build_dir:
        sources = [str(path) for path in SOURCES]
        module = load(name, sources, extra_cflags=flags, build_directory=build_dir, verbose=False)
        os.replace(module.__file__, cache / f"{name}.so")  # atomic: another process sees all of it or none
    return module


@functools.cache
def compiled_cpu_kernels() -> ModuleType | None:
    """The kernel module, built or loaded once per process; None where it is unavailable (`unavailable_reason`:
    then the Python code is simply what runs) or fails to build (with one warning). `experts.compiled_engine`
    also checks the SwiGLU kernel against the Python loop before using it."""
    if unavailable_reason() is not None:
        return None
    flags = build_flags(_capability())
    name = _module_name(flags)
    try:
        return _load_cached(name) or _build(name, flags)
    except Exception as error:  # a compiler error, a full disk, an incompatible cached build …
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(f"moetron: the CPU kernels did not build ({first_line}); using the Python code", stacklevel=2)
        return None


def _plain(*tensors: torch.Tensor) -> bool:
    """Plain tensors (or parameters): a subclass (DTensor, FakeTensor, …) has no data of its own for a kernel."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def first_max_column(x_TE: torch.Tensor) -> torch.Tensor | None:
    """int64 [T]: `x_TE.max(dim=1).indices` (the first maximal column; a NaN counts as the largest, its first one)
    for a CPU float32 [T, E]: 0.50 against max's 0.80 ms at T = 8192, E = 64, 0.78 against 1.22 at E = 128 (slower
    below 16 columns, a vector's width: its callers use it from 16). None where the kernels are not available, for
    another kind of tensor (a subclass, another dtype or device) and under torch.compile (Dynamo cannot trace an
    extension call: it would break the router's graph): the caller runs its own code then."""
    if torch.compiler.is_compiling():
        return None
    if not _plain(x_TE) or x_TE.device.type != "cpu" or x_TE.dtype != torch.float32:
        return None
    if x_TE.dim() != 2 or not x_TE.shape[1]:
        return None
    kernels = compiled_cpu_kernels()
    return kernels.first_max_column(x_TE) if kernels is not None else None


def softmax_gradient_rows(logits_MV: torch.Tensor, labels_M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(label_logp_M, sum_M) of a CPU float32 chunk of logits [M, V], which it overwrites with
    exp(x − max) − sum·one-hot(label) = sum · (softmax − one-hot): one exp per logit and two passes per row, against
    log_softmax + exp_'s two exps and four passes (see `csrc/softmax_gradient_rows.cpp`). label_logp_M is the label's
    log-probability (log_softmax's value up to the order of its sum), sum_M = Σ exp(x − max) per row. None where the
    kernels are not available, for another kind of tensor (a subclass, another dtype or device, a non-contiguous
    one) and under torch.compile: the caller runs its own code then."""
    if torch.compiler.is_compiling():
        return None
    if not _plain(logits_MV, labels_M) or logits_MV.device.type != "cpu" or logits_MV.dtype != torch.float32:
        return None
    if logits_MV.dim() != 2:
        return None
    if not logits_MV.is_contiguous() or labels_M.dtype != torch.int64:
        return None
    kernels = compiled_cpu_kernels()
    return kernels.softmax_gradient_rows(logits_MV, labels_M.contiguous()) if kernels is not None else None


def fused_head_kernels(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernel module, for the fused LM head's fp32 CPU forward over these tensors (`csrc/fused_head.cpp`:
    `fused_head_forward`, `transpose_scaled`); None where the kernels are not available, for another kind of
    tensor (a subclass, another dtype or device) and under torch.compile: the caller runs its Python loop then."""
    if torch.compiler.is_compiling():
        return None
    if not _plain(*tensors) or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return compiled_cpu_kernels()


def index_add_rows(out_TD: torch.Tensor, index_R: torch.Tensor, src_RD: torch.Tensor) -> torch.Tensor:
    """`out_TD.index_add_(0, index_R, src_RD)`, on one thread through `csrc/add_rows.cpp` for contiguous CPU float32
    rows where the kernels load (the same adds in the same order: the same bits; ATen's scatter-add wakes every
    thread for a few microseconds of work), else ATen's."""
    if (
        _plain(out_TD, src_RD, index_R)
        and not torch.compiler.is_compiling()
        and out_TD.device.type == src_RD.device.type == "cpu"
        and out_TD.dtype == src_RD.dtype == torch.float32
        and index_R.dtype == torch.int64
        and out_TD.dim() == src_RD.dim() == 2
        and out_TD.is_contiguous()
        and not (out_TD.requires_grad and torch.is_grad_enabled())
    ):
        kernels = compiled_cpu_kernels()
        if kernels is not None:
            kernels.add_rows(out_TD, index_R.contiguous(), src_RD.contiguous())
            return out_TD
    return out_TD.index_add_(0, index_R, src_RD)
