"""The [V, C] weight gradients on reused CPU memory (`moetron/cpu/gradient_memory.py`): memory is handed out again
only once nobody holds it, and a model trains bit for bit as with fresh memory — tied (the embedding's rows added into
the fused head's gradient) or untied, with `.grad` dropped every step or accumulated over micro-batches."""

from __future__ import annotations

import pytest
import torch

from moetron.cpu.gradient_memory import ReusedGradientMemory, embedding_lookup
from moetron.cpu.head_loss import CPU_HEAD_LOSS
from moetron.model.backends import ATEN_HEAD_LOSS
from moetron.model.config import ModelConfig
from moetron.model.gpt import create_model
from moetron.model.loss import FusedHeadLoss, LogitsHeadLoss

CPU = torch.device("cpu")


def test_memory_is_handed_out_again_only_when_nobody_holds_it():
    pool = ReusedGradientMemory(keep=3)
    a = pool.take((4, 3), torch.float32, CPU)
    pointer = a.data_ptr()
    b = pool.take((4, 3), torch.float32, CPU)
    assert b.data_ptr() != pointer  # a is alive
    view = a[1:]
    del a
    assert pool.take((4, 3), torch.float32, CPU).data_ptr() not in (pointer, b.data_ptr())  # a view holds it
    del view
    c = pool.take((4, 3), torch.float32, CPU)
    assert c.data_ptr() == pointer and c.shape == (4, 3)
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    weight.grad = c
    del c
    assert pool.take((4, 3), torch.float32, CPU).data_ptr() != pointer  # .grad holds it
    weight.grad = None  # zero_grad(set_to_none=True)
    assert pool.take((4, 3), torch.float32, CPU).data_ptr() == pointer
    assert pool.take((3, 4), torch.float32, CPU).data_ptr() != pointer  # another shape is other memory


def _model(tied: bool):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, vocab_size=90)
    cfg.untie_embeddings_and_output_weights = not tied
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    return create_model(cfg, "cpu", seed=3)


def _train(model, head, micro_batches: int, steps: int = 3):
    """Steps of `micro_batches` accumulated backwards each, `.grad` dropped between steps (as the trainer does);
    the gradients of every step and the memory the word embeddings' `.grad` was on."""
    g = torch.Generator().manual_seed(0)
    grads, pointers = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            tokens, labels = torch.randint(0, 90, (2, 2, 12), generator=g)
            head(model, model(tokens, return_logits=False).hidden, labels).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        pointers.append(model.word_embeddings.weight.grad.data_ptr())
    return grads, pointers


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("head", [FusedHeadLoss(), LogitsHeadLoss()], ids=["fused", "logits"])
def test_a_model_trains_bit_for_bit_as_with_fresh_gradient_memory(monkeypatch, tied, micro_batches, head):
    reused, pointers = _train(_model(tied), head, micro_batches)
    monkeypatch.setattr(CPU_HEAD_LOSS, "lookup", ATEN_HEAD_LOSS.lookup)  # fresh memory: ATen's lookup and gradient
    monkeypatch.setattr(CPU_HEAD_LOSS, "take_gradient", ATEN_HEAD_LOSS.take_gradient)
    fresh, _ = _train(_model(tied), head, micro_batches)
    for step_reused, step_fresh in zip(reused, fresh, strict=True):
        for name, grad in step_fresh.items():
            assert torch.equal(step_reused[name], grad), name
    if not (tied and isinstance(head, LogitsHeadLoss)):  # there autograd's fresh dW absorbs the embeddings' rows
        assert len(set(pointers)) == 1  # the embeddings' (or the tied head's) memory came back every step


def test_a_head_whose_graph_was_released_does_not_swallow_the_embeddings_rows():
    """The embedding lookup and a fused head on the same weight in two separate backwards with `.grad` dropped in
    between: the head's gradient memory is no longer on its way to `.grad`, so the rows are a gradient of their own."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(50, 8))
    tokens = torch.randint(0, 50, (6,))
    hidden = embedding_lookup(tokens, weight)
    head_loss = FusedHeadLoss()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.final_layernorm = torch.nn.Identity()

        def head_weight(self):
            return weight

    labels = torch.randint(0, 50, (1, 6))
    head_loss(Model(), torch.randn(1, 6, 8, requires_grad=True), labels).backward()  # another graph's head
    weight.grad = None
    probe = torch.randn(6, 8)
    (hidden * probe).sum().backward()
    assert torch.equal(weight.grad, torch.zeros(50, 8).index_add_(0, tokens, probe))
