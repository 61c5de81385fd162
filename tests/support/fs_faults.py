"""Filesystem faults for tests: a full disk, a read-only directory, injected write errors, tree snapshots.

A real full disk is a tiny tmpfs (needs root and `mount`; tests skip cleanly where that is impossible); a
read-only directory is a read-only tmpfs for root (root ignores permission bits) or chmod 0555 otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(path: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    except OSError:
        return False
    return proc.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


@contextlib.contextmanager
def full_disk(path: Path, size: str = "64k") -> Iterator[Path]:
    """A directory `path` on a tmpfs of `size` bytes: writing more fails with ENOSPC. Skips when not possible."""
    path.mkdir(parents=True, exist_ok=True)
    if not _mount(path, f"size={size},mode=0777"):
        pytest.skip("needs root and `mount -t tmpfs` for a real full disk")
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """An empty directory nobody can write into (a read-only tmpfs for root, mode 0555 otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        if not _mount(path, "ro,size=4k"):
            pytest.skip("root ignores permission bits and `mount -t tmpfs -o ro` is not available here")
        try:
            yield path
        finally:
            _umount(path)
        return
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


class FailingFile:
    """A file object whose writes fail like a full disk (after the first `allowed` bytes)."""

    def __init__(self, inner, allowed: int = 0):
        self.inner, self.allowed = inner, allowed

    def write(self, data) -> int:
        if len(data) > self.allowed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self.inner, "name", None))
        self.allowed -= len(data)
        return self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.inner.close()


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """{relative path: (kind, content hash or '')} of everything under `root`, to prove nothing changed."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_file() and not path.is_symlink():
            out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            out[rel] = ("dir" if path.is_dir() else "other", "")
    return out
