"""Unit tests run tiny shapes: every one with one intra-op thread (`one_thread`, tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def unit_tests_on_one_thread(one_thread):
    yield


@pytest.fixture
def swiglu_cpp_engine():
    """The C++ engine of `ExpertByExpertSwiGLU` (skipped, with the reason, where it does not build or load)."""
    from moetron.cpu import compiled_kernels
    from moetron.cpu import experts as cpu_kernels

    reason = compiled_kernels.unavailable_reason()
    engine = None if reason else cpu_kernels.compiled_engine()
    if engine is None:
        pytest.skip(f"the CPU expert kernel is not available here: {reason or 'it did not build'}")
    return engine


@pytest.fixture(params=["compiled", "python"])
def each_swiglu_engine(request, monkeypatch):
    """Run the test once with each engine of `ExpertByExpertSwiGLU`: the C++ kernel (skipped where it does not
    build, with the reason) and the Python loop (forced)."""
    from moetron.cpu import experts as cpu_kernels

    if request.param == "compiled":
        request.getfixturevalue("swiglu_cpp_engine")
    else:
        monkeypatch.setattr(cpu_kernels, "swiglu_engine", lambda *tensors: cpu_kernels.PYTHON_LOOP)
    return request.param


@pytest.fixture(params=[False, True], ids=["dw_CV", "dw_VC"])
def dw_layout(request, monkeypatch):
    """Both layouts of the CPU head's dW accumulation, whichever this CPU would pick (`weight_grad_as_rows`)."""
    from moetron.cpu.head_loss import CPU_HEAD_LOSS

    monkeypatch.setattr(CPU_HEAD_LOSS, "weight_grad_as_rows", lambda device: request.param)
    return request.param
