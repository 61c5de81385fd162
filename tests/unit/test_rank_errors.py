"""Who says an error of a multi-process run, without processes (a fake process group and store): before the group
exists rank 0 alone (every rank hits the same config problem); after, each rank its own error, each distinct
message once, and the ranks a recorded failure left waiting say nothing (`train/failures.py`)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moetron.cli import report_user_error
from moetron.errors import UserError
from moetron.parallel.dims import Coordinates
from moetron.train import failures
from moetron.train.failures import OwnError, PeerFailed, one_failure_line, own_errors

GLOO_CLOSED = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27274. This is typically …"
COORDS = Coordinates(pp=0, dp=0, tp=0, edp=0, ep=0, etp=0)


class FakeStore:
    """The parts of a c10d store that `failures` uses, shared by the 'ranks' of one test."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if self.values.get(key, b"") == expected.encode():
            self.values[key] = desired.encode()
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


@pytest.fixture
def group(monkeypatch):
    """A 2-rank process group; `group.rank = r` makes the code under test run as global rank r."""

    class Group:
        rank = 0
        store = FakeStore()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: Group.rank)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: Group.store)
    return Group


def said(err: UserError, rank: int, monkeypatch, capsys) -> tuple[int, str]:
    """(exit status, stderr) of the CLI reporting `err` on global rank `rank` under torchrun."""
    monkeypatch.setenv("RANK", str(rank))
    status = report_user_error(err)
    return status, capsys.readouterr().err


def raised_in(block_error: BaseException) -> BaseException:
    with pytest.raises(BaseException) as caught, own_errors():
        raise block_error
    return caught.value


def test_an_error_of_rank_1_alone_is_said_by_rank_1(group, monkeypatch, capsys):
    group.rank = 1
    message = "checkpoint c/rng is corrupt (rank_00001.safetensors: header too large)"
    err = raised_in(UserError(message))
    assert isinstance(err, OwnError)
    assert said(err, 1, monkeypatch, capsys) == (2, f"error: rank 1: {message}\n")
    assert failures.recorded()  # the rank it leaves waiting in a collective stays quiet:
    with pytest.raises(PeerFailed), one_failure_line(0, None, COORDS):
        raise RuntimeError(GLOO_CLOSED)


def test_the_same_error_on_every_rank_is_said_once_and_different_ones_each(group, monkeypatch, capsys):
    same = "--load runs/x: no checkpoint there"
    group.rank = 0
    first = raised_in(UserError(same))
    group.rank = 1
    second = raised_in(UserError(same))
    other = raised_in(UserError("checkpoint c: model.layers.1.w has shape (2,), the model expects (4,)"))
    assert said(first, 0, monkeypatch, capsys) == (2, f"error: {same}\n")  # rank 0's own: no prefix
    assert said(second, 1, monkeypatch, capsys) == (2, "")
    assert said(other, 1, monkeypatch, capsys)[1].startswith("error: rank 1: checkpoint c: model.layers.1.w")


def test_an_internal_error_keeps_its_traceback_and_is_recorded(group):
    group.rank = 1
    bug = RuntimeError("shape mismatch")
    assert raised_in(bug) is bug
    assert group.store.values[failures.KEY] == b"rank 1 failed: RuntimeError: shape mismatch"


def test_before_the_process_group_exists_rank_0_alone_says_it(monkeypatch, capsys):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    err = UserError("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2")
    assert raised_in(err) is err
    assert said(err, 1, monkeypatch, capsys) == (2, "")
    assert said(err, 0, monkeypatch, capsys) == (2, f"error: {err}\n")
