"""The model's two seams (`model/backends.py`): a device type gets the backends registered for it, ATen's ops
otherwise; `use_device_backends` registers the CPU package's for a CPU device and nothing for a GPU or meta one
(that a GPU run never imports the CPU package: tests/integration/test_gpu_path_loads_no_cpu_package.py)."""

from __future__ import annotations

import torch

from moetron.cpu import CPU_EXPERTS, CPU_HEAD_LOSS
from moetron.model import backends
from moetron.model.backends import ATEN_EXPERTS, ATEN_HEAD_LOSS, experts_backend, head_loss_backend
from moetron.parallel.device_backends import use_device_backends


def test_each_device_type_gets_its_registered_backends_else_atens(monkeypatch):
    monkeypatch.setattr(backends, "_REGISTERED", {})
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")
    assert (experts_backend(cpu), head_loss_backend(cpu)) == (ATEN_EXPERTS, ATEN_HEAD_LOSS)
    for device in ("cuda", "meta", cpu):
        use_device_backends(device)
    assert (experts_backend(cpu), head_loss_backend(cpu)) == (CPU_EXPERTS, CPU_HEAD_LOSS)
    for device in (cuda, meta):
        assert (experts_backend(device), head_loss_backend(device)) == (ATEN_EXPERTS, ATEN_HEAD_LOSS)


def test_atens_backends_compute_with_atens_ops():
    out_TD, index_R, src_RD = torch.zeros(3, 2), torch.tensor([2, 0, 2]), torch.arange(6.0).reshape(3, 2)
    expected = torch.zeros(3, 2).index_add_(0, index_R, src_RD)
    assert torch.equal(ATEN_EXPERTS.index_add_rows(out_TD, index_R, src_RD), expected)
    assert ATEN_EXPERTS.first_max_column(torch.zeros(4, 16)) is None  # the caller's own max then
    assert not ATEN_EXPERTS.runs_swiglu(torch.zeros(2, 8))
    weight_VC, tokens_BT = torch.randn(10, 4), torch.tensor([[1, 9, 1]])
    assert torch.equal(ATEN_HEAD_LOSS.lookup(tokens_BT, weight_VC), weight_VC[tokens_BT])
