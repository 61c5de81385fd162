"""Unit tests run tiny shapes: every one with one intra-op thread (`one_thread`, tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def unit_tests_on_one_thread(one_thread):
    yield
