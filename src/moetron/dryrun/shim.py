"""Build and load the fake-CUDA shim (`fake_cuda.cpp`).

    path = built_shim()        # in the parent: compiled once per torch version into the cache (None: not needed)
    load_shim(path)            # in the child, BEFORE `import torch`: its registrations must precede torch's

The shim is compiled with the system C++ compiler against the installed torch's headers and linked to its
libraries (no pybind, no ninja: one g++ call, ~3 s). Cache: `$MOETRON_KERNEL_CACHE/dryrun`, else
`~/.cache/moetron/dryrun`, one file per (torch version, source): a new torch builds a new shim. The build writes
into a private temporary directory and is published with `os.replace`, so concurrent runs never see half a file.
A torch built with CUDA registers the real device guard and hooks itself: there the shim is not built (`None`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from moetron.errors import UserError

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
SHIM_ENV = "MOETRON_FAKE_CUDA_SHIM"  # the parent hands the built library's path to its children
COMPILER_ENV = "CXX"


def cache_dir() -> Path:
    root = os.environ.get("MOETRON_KERNEL_CACHE")
    return Path(root) / "dryrun" if root else Path.home() / ".cache" / "moetron" / "dryrun"


def compiler() -> str | None:
    """The C++ compiler to build with ($CXX, else c++ / g++ on PATH), or None."""
    for name in (os.environ.get(COMPILER_ENV), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _torch_paths() -> tuple[str, Path, bool, int]:
    """(torch version, torch's package directory, whether it is a CUDA build, its C++ ABI flag)."""
    import torch

    return (
        torch.__version__,
        Path(torch.__file__).parent,
        torch.version.cuda is not None,
        int(torch._C._GLIBCXX_USE_CXX11_ABI),
    )


def needs_shim() -> bool:
    return not _torch_paths()[2]


def library_name(version: str, abi: int) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + f"{version}|{abi}|{sys.platform}".encode()).hexdigest()[:16]
    return f"fake_cuda_{version.replace('+', '_')}_{digest}.so"


def built_shim() -> Path | None:
    """The shim for the installed torch, built on first use; None where torch is a CUDA build (not needed).
    A `UserError` (one line) when it cannot be built."""
    version, torch_dir, cuda_build, abi = _torch_paths()
    if cuda_build:
        return None
    target = cache_dir() / library_name(version, abi)
    if target.is_file():
        return target
    cxx = compiler()
    if cxx is None:
        raise UserError("dry-run builds a small C++ shim and needs a C++ compiler: install g++ (or set $CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out = Path(tmp) / target.name
        lib = torch_dir / "lib"
        command = [
            cxx, "-shared", "-fPIC", "-O1", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(torch_dir / "include"), str(SOURCE), "-o", str(out),
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu",
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.splitlines()
            raise UserError(f"dry-run could not build its fake-CUDA shim with {cxx}: {(errors or ['?'])[0].strip()}")
        os.replace(out, target)  # atomic: a concurrent build of the same file publishes the same bytes
    return target


def load_shim(path: str | os.PathLike | None) -> None:
    """Load the shim into this process (before `import torch`; asserted, since after it the registration is lost)."""
    if path is None:
        return
    assert "torch" not in sys.modules, "the fake-CUDA shim must be loaded before torch is imported"
    library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    assert library.moetron_fake_cuda_shim_version() == 1
