"""tests/support/launch.py on a rank that dies of a signal: the report names the rank and its signal and quotes its
threads' Python stacks (faulthandler), whether its peer then fails in a collective or finishes without it.

Why it matters: a heap corruption once killed a rank of the pipeline tests with SIGSEGV in a gloo thread, and
the only error reported was its peer's "Connection reset by peer"; the dump says which Python line each thread
of the dead rank was running.
"""

from __future__ import annotations

import ctypes

import pytest
import torch.distributed as dist
from launch import run_distributed


def _crash_with_sigsegv() -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def peer_waits_in_a_collective(rank: int, world_size: int) -> int:
    if rank == 1:
        _crash_with_sigsegv()
    dist.barrier()  # rank 0: gloo notices the closed connection and raises
    return rank


def peer_finishes(rank: int, world_size: int) -> int:
    if rank == 1:
        _crash_with_sigsegv()
    return rank


@pytest.mark.distributed
def test_a_segfaulted_rank_is_named_with_its_python_stacks():
    with pytest.raises(AssertionError) as failure:
        run_distributed(peer_waits_in_a_collective, world_size=2, timeout=120)
    report = str(failure.value)
    assert "rank 0 failed" in report  # the peer's own error comes first
    assert "rank 1 exited with code -11" in report
    assert "Segmentation fault" in report and "_crash_with_sigsegv" in report  # where rank 1 was


@pytest.mark.distributed
def test_a_segfaulted_rank_is_reported_when_its_peer_finishes():
    # before: no result from rank 1, so the parent waited out `timeout` and said only "no result from every rank"
    with pytest.raises(AssertionError) as failure:
        run_distributed(peer_finishes, world_size=2, timeout=60)
    report = str(failure.value)
    assert "rank 1 exited with code -11" in report and "_crash_with_sigsegv" in report
