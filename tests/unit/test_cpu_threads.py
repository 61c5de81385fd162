"""model/cpu_threads.py, train/step_threads.py: a small model's CPU step runs the ops outside moetron's kernels on
one thread, the fused head and the expert kernel on every thread the step started with, and gives them back."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trainer_support import build_trainer, tiny_config

from moetron.model import cpu_threads
from moetron.model import fused_cross_entropy as fce
from moetron.model.cpu_threads import all_kernel_threads, body_threads, kernel_threads
from moetron.model.moe.experts import cpu_kernels
from moetron.train.step_threads import MIN_THREADED_GEMM_FLOPS, largest_body_gemm_flops, step_threads


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


def test_largest_body_gemm_leaves_out_the_output_layer_and_the_expert_kernel():
    untied_moe = {"untie_embeddings_and_output_weights": True, "expert_interval": 1}  # every layer MoE
    gelu = tiny_config(swiglu=False, **untied_moe)
    swiglu = tiny_config(swiglu=True, add_bias_linear=False, **untied_moe)
    rows = 1000
    models = {}
    for name, cfg in (("gelu", gelu), ("swiglu", swiglu)):
        models[name] = build_trainer(cfg).model
    hidden, ffn = gelu.model.hidden_size, gelu.model.expert_ffn_size
    qkv = 3 * hidden  # no grouped KV heads in the tiny config
    # GELU experts run through ATen: a GEMM per expert on its share of the top-2 rows (4 experts)
    assert largest_body_gemm_flops(models["gelu"], rows) == max(
        2.0 * rows * hidden * qkv, 2.0 * rows * 2 / 4 * hidden * ffn
    )
    # plain SwiGLU experts run in the expert kernel; the output layer is the fused head's: attention is the largest
    assert largest_body_gemm_flops(models["swiglu"], rows) == 2.0 * rows * hidden * qkv
    assert models["swiglu"].output_layer is not None


def test_step_threads_by_the_largest_gemm():
    small, large = nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(512, 512))
    assert step_threads(small, 768, 2) == 1
    assert 2.0 * 768 * 512 * 512 >= MIN_THREADED_GEMM_FLOPS
    assert step_threads(large, 768, 2) == 2
    assert step_threads(small, 768, 1) == 1


def test_a_trainer_step_runs_small_ops_on_one_thread_and_its_kernels_on_two(two_threads, monkeypatch):
    cfg = tiny_config(swiglu=True, add_bias_linear=False, train_iters=2)
    trainer = build_trainer(cfg)
    assert trainer.step_threads == 1
    seen: dict[str, set[int]] = {"linear": set(), "head": set(), "experts forward": set(), "experts backward": set()}
    for module in trainer.model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda *_: seen["linear"].add(torch.get_num_threads()))

    head_kernel = fce._forward_threads

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

    monkeypatch.setattr(fce, "_forward_threads", spy_head)
    monkeypatch.setattr(cpu_kernels, "swiglu_engine", lambda *a: SpyEngine(engine_of(*a)))
    result = trainer.train_step()
    assert result.ok
    expected = {"linear": {1}, "head": {2}, "experts forward": {2}, "experts backward": {2}}
    if fce.fused_head_kernels(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1)) is None:
        expected["head"] = set()  # the C++ kernels did not build here: the head ran its Python loop
    assert seen == expected
    assert torch.get_num_threads() == 2  # given back after the step


def test_a_gpu_or_compiled_step_keeps_every_thread(two_threads):
    cfg = tiny_config(swiglu=True, add_bias_linear=False, train_iters=2)
    cfg.train.compile = True
    assert build_trainer(cfg).step_threads == 2
