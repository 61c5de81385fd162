"""moetron/cpu/threads.py, step_threads.py: a small model's CPU step runs the ops outside moetron's kernels on
one thread, the fused head, the expert kernel and the layers with large GEMMs on every thread the step started with,
and gives them back."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trainer_support import build_trainer, tiny_config

from moetron.cpu import experts as cpu_kernels
from moetron.cpu import step_threads as step_threads_module
from moetron.cpu import threads as cpu_threads
from moetron.cpu.compiled_kernels import fused_head_kernels
from moetron.cpu.head_loss import CPU_HEAD_LOSS
from moetron.cpu.step_threads import MIN_THREADED_BODY_ELEMENTS, step_threads, threaded_gemm_layers
from moetron.cpu.threads import all_kernel_threads, body_threads, fence_on_all_kernel_threads, kernel_threads
from moetron.model.moe.experts.grouped import GroupedExperts


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_body_threads_sets_the_ops_aside_and_the_kernels_get_them_back(two_threads):
    with body_threads(1):
        assert (torch.get_num_threads(), kernel_threads()) == (1, 2)
        with all_kernel_threads():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with body_threads(1):  # nested: the kernels keep the outer count
            assert kernel_threads() == 2
    assert (torch.get_num_threads(), kernel_threads(), cpu_threads._kernel_threads) == (2, 2, None)
    with pytest.raises(RuntimeError, match="inside"):
        with body_threads(1):
            raise RuntimeError("inside")
    assert (torch.get_num_threads(), cpu_threads._kernel_threads) == (2, None)
    with body_threads(4):  # never more threads than the step has
        assert torch.get_num_threads() == 2
    with all_kernel_threads():  # outside body_threads: nothing to give back
        assert torch.get_num_threads() == 2


class ThreadsSpy(nn.Module):
    """Identity whose autograd forward and backward record the intra-op threads they ran at."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, list[int]] = {"forward": [], "backward": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Spy.apply(x, self.seen)


class _Spy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):
        seen["forward"].append(torch.get_num_threads())
        ctx.seen = seen
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.seen["backward"].append(torch.get_num_threads())
        return grad * 2, None


def test_a_fenced_layer_runs_forward_and_backward_on_every_thread(two_threads):
    before, fenced, after = ThreadsSpy(), ThreadsSpy(), ThreadsSpy()
    handles = fence_on_all_kernel_threads(fenced)
    x = torch.ones(3, requires_grad=True)
    with body_threads(1):
        y = after(fenced(before(x)))
        assert torch.get_num_threads() == 1  # given back after the forward
        y.sum().backward()
        assert torch.get_num_threads() == 1  # and after the backward
        with torch.no_grad():
            fenced(x)
        assert torch.get_num_threads() == 1
        fenced(torch.ones(3)).sum()  # an input without a gradient: the forward only
    assert fenced.seen == {"forward": [2, 2, 2], "backward": [2]}
    assert before.seen == after.seen == {"forward": [1], "backward": [1]}
    assert x.grad.tolist() == [8.0, 8.0, 8.0]
    fenced(x)  # outside body_threads: no fence
    assert fenced.seen["forward"][-1] == 2 and torch.get_num_threads() == 2
    for handle in handles:
        handle.remove()


def test_threaded_gemm_layers_leave_out_the_output_layer_and_the_expert_kernel():
    untied_moe = {"untie_embeddings_and_output_weights": True, "expert_interval": 1}  # every layer MoE
    gelu = tiny_config(swiglu=False, **untied_moe)
    swiglu = tiny_config(swiglu=True, add_bias_linear=False, **untied_moe)
    every = 10**9  # rows: every GEMM is large
    for name, cfg in (("gelu", gelu), ("swiglu", swiglu)):
        model = build_trainer(cfg).model
        linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("output_layer")]
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert model.output_layer is not None and linears and experts
        layers = threaded_gemm_layers(model, every)
        # GELU experts run through ATen (a GEMM per expert); plain SwiGLU experts run in the expert kernel
        assert {id(m) for m in layers} == {id(m) for m in linears + (experts if name == "gelu" else [])}
        assert threaded_gemm_layers(model, 1) == []
    hidden = gelu.model.hidden_size
    qkv = 3 * hidden  # no grouped KV heads in the tiny config
    rows = int(step_threads_module.MIN_THREADED_GEMM_FLOPS / (2.0 * hidden * qkv)) + 1  # the QKV GEMM just large
    model = build_trainer(gelu).model
    qkv_linears = [m for n, m in model.named_modules() if n.endswith("query_key_value")]
    assert qkv_linears and {id(m) for m in threaded_gemm_layers(model, rows)} == {id(m) for m in qkv_linears}


def test_step_threads_by_the_activations():
    assert step_threads(768, 128, 2) == 1  # the e2e benchmark's models
    assert 768 * 512 >= MIN_THREADED_BODY_ELEMENTS
    assert step_threads(768, 512, 2) == 2
    assert step_threads(768, 128, 1) == 1


def test_a_trainer_step_runs_small_ops_on_one_thread_and_its_kernels_on_two(two_threads, monkeypatch):
    cfg = tiny_config(swiglu=True, add_bias_linear=False, train_iters=2)
    trainer = build_trainer(cfg)
    assert trainer.step_threads == 1
    seen: dict[str, set[int]] = {"linear": set(), "head": set(), "experts forward": set(), "experts backward": set()}
    for module in trainer.model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda *_: seen["linear"].add(torch.get_num_threads()))

    head_kernel = CPU_HEAD_LOSS._forward_threads

    def spy_head(*args, **kwargs):
        seen["head"].add(torch.get_num_threads())
        return head_kernel(*args, **kwargs)

    engine_of = cpu_kernels.swiglu_engine

    class SpyEngine:
        def __init__(self, engine):
            self.engine = engine

        def forward(self, *args):
            seen["experts forward"].add(torch.get_num_threads())
            return self.engine.forward(*args)

        def backward(self, *args):
            seen["experts backward"].add(torch.get_num_threads())
            return self.engine.backward(*args)

    monkeypatch.setattr(CPU_HEAD_LOSS, "_forward_threads", spy_head)
    monkeypatch.setattr(cpu_kernels, "swiglu_engine", lambda *a: SpyEngine(engine_of(*a)))
    result = trainer.train_step()
    assert result.ok
    expected = {"linear": {1}, "head": {2}, "experts forward": {2}, "experts backward": {2}}
    if fused_head_kernels(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1)) is None:
        expected["head"] = set()  # the C++ kernels did not build here: the head ran its Python loop
    assert seen == expected
    assert torch.get_num_threads() == 2  # given back after the step


def test_a_trainer_step_runs_its_large_gemms_on_two_threads_and_the_same_losses(two_threads, monkeypatch):
    cfg = tiny_config(swiglu=True, add_bias_linear=False, train_iters=3)
    plain = build_trainer(cfg)
    monkeypatch.setattr(step_threads_module, "MIN_THREADED_GEMM_FLOPS", 0.0)  # every linear but the head's
    fenced = build_trainer(cfg)
    assert (plain.step_threads, fenced.step_threads) == (1, 1)
    seen: dict[str, set[int]] = {"linear": set(), "norm": set()}
    for name, module in fenced.model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("output_layer"):
            # after the fence's own pre-hook, which the trainer registered first
            module.register_forward_pre_hook(lambda *_: seen["linear"].add(torch.get_num_threads()))
        elif "norm" in type(module).__name__.lower():
            module.register_forward_hook(lambda *_: seen["norm"].add(torch.get_num_threads()))
    for _ in range(3):
        a, b = plain.train_step(), fenced.train_step()
        assert a.ok and b.ok
        torch.testing.assert_close(b.sums.losses, a.sums.losses, rtol=1e-6, atol=0)
    assert seen == {"linear": {2}, "norm": {1}}
    assert torch.get_num_threads() == 2


def test_a_gpu_or_compiled_step_keeps_every_thread(two_threads):
    cfg = tiny_config(swiglu=True, add_bias_linear=False, train_iters=2)
    cfg.train.compile = True
    assert build_trainer(cfg).step_threads == 2
