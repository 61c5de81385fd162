"""Unit tests run tiny shapes: one intra-op thread is fastest and steadiest (a second thread only adds wake-up
latency, and on a busy 2-core machine OpenMP's spinning threads make small ops ~100x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
