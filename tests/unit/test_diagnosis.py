"""The failure diagnosis without processes: which errors are collective failures, which site they left, the line,
the flag's validation, and how `train/failures.py` turns them into one error per rank."""

from __future__ import annotations

import pytest

from moetron.config import RunConfig
from moetron.parallel import diagnosis
from moetron.parallel.diagnosis import Site, failure_kind, failure_line
from moetron.parallel.dims import Coordinates
from moetron.train.failures import CollectiveFailed, PeerFailed, one_failure_line
from moetron.validate import validate

GLOO_TIMEOUT = "[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 6000ms for send operation to complete"
GLOO_CLOSED = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27274. This is typically …"
GLOO_RESET = "[../pair.cc:537] Read error [127.0.0.1]:9348: Connection reset by peer. This is typically caused by …"
COORDS = Coordinates(pp=0, dp=1, tp=0, edp=0, ep=1, etp=0)


@pytest.fixture(autouse=True)
def fresh_record():
    diagnosis.reset()
    yield
    diagnosis.reset()


def test_collective_failures_are_told_apart_from_other_errors():
    assert failure_kind(RuntimeError(GLOO_TIMEOUT)) == "timeout"
    assert failure_kind(RuntimeError(GLOO_CLOSED)) == "peer"
    assert failure_kind(RuntimeError(GLOO_RESET)) == "peer"
    assert failure_kind(ValueError("Timed out")) is None  # only torch's RuntimeErrors (DistBackendError is one)
    assert failure_kind(RuntimeError("shape mismatch")) is None
    try:  # torch's pipelining wraps a stage's error in a RuntimeError of its own
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError as inner:
            raise RuntimeError("stage 0 failed") from inner
    except RuntimeError as outer:
        assert failure_kind(outer) == "timeout"


def test_the_innermost_site_an_error_left_is_named_with_its_peers_and_the_timeout(monkeypatch):
    outer = Site("the pipeline send/recv of stage 0")
    inner = Site("the all-to-all of MoE layer 3 (forward)", None, "ep")
    monkeypatch.setattr(Site, "peer_ranks", lambda self: [0, 1])  # no process group here
    err = RuntimeError(GLOO_TIMEOUT)
    with pytest.raises(RuntimeError), outer, inner:
        raise err
    assert diagnosis.RECORD.current is None  # left both
    line = failure_line(err, 1, COORDS, minutes=0.05)
    assert line.startswith(
        "rank 1 (pp 0, dp 1, tp 0, ep 1): the all-to-all of MoE layer 3 (forward) timed out after 0.05 min waiting "
        "for its ep peers [0, 1]"
    )
    assert failure_line(RuntimeError(GLOO_CLOSED), 1, COORDS).startswith(
        "rank 1 (pp 0, dp 1, tp 0, ep 1): a collective lost its peers: a peer process died"
    )  # an error that left no site is still one line
    assert failure_line(ValueError("x"), 1, COORDS) is None


def test_a_site_left_normally_records_nothing():
    site = Site("the gradient-norm all-reduce")
    with site:
        pass
    assert diagnosis.RECORD.failed is None and diagnosis.RECORD.current is None


def test_one_failure_line_turns_a_timeout_into_one_error_per_rank_and_lets_other_errors_through():
    with pytest.raises(CollectiveFailed) as caught, one_failure_line(0, None, COORDS):
        with Site("the checkpoint barrier of the save of iteration 2"):
            raise RuntimeError(GLOO_TIMEOUT)
    assert str(caught.value).startswith("rank 0 (pp 0, dp 1, tp 0, ep 1): the checkpoint barrier of the save of")
    assert caught.value.every_rank and caught.value.exit_code == 1
    with pytest.raises(ValueError), one_failure_line(0, None, COORDS):  # not pipelined: a bug keeps its traceback
        raise ValueError("a bug")


def test_a_pipeline_stage_whose_peer_recorded_the_failure_stays_quiet(monkeypatch):
    import moetron.train.failures as failures

    monkeypatch.setattr(failures, "recorded", lambda: True)
    with pytest.raises(PeerFailed) as caught, one_failure_line(0, "pipeline stage 0 of 2", COORDS):
        raise RuntimeError(GLOO_CLOSED)
    assert caught.value.quiet


@pytest.mark.parametrize("minutes", [0.0, -1.0, float("nan"), float("inf")])
def test_the_timeout_flag_must_be_a_positive_number_of_minutes(minutes):
    cfg = RunConfig()
    cfg.parallel.distributed_timeout_minutes = minutes
    problems = [p for p in validate(cfg, 1) if "--distributed-timeout-minutes" in p]
    assert len(problems) == 1 and "must be a positive number of minutes" in problems[0]


def test_fractional_minutes_are_accepted():
    cfg = RunConfig()
    cfg.parallel.distributed_timeout_minutes = 0.05
    assert not [p for p in validate(cfg, 1) if "--distributed-timeout-minutes" in p]
