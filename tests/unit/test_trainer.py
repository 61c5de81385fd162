"""One optimizer step done right: accumulation, parameter groups, clipping, fp16 skips, NaN stop, metrics."""

import argparse
import json
import math
import os
import re
import signal
import sys
import types

import pytest
import torch
from trainer_support import SEQ, build_trainer, run_losses, tiny_config

from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.errors import UserError
from moetron.model.gpt import create_model
from moetron.model.loss import FusedHeadLoss, LogitsHeadLoss
from moetron.train.metrics import EVAL_KEYS, METRIC_KEYS, RunLogger, open_tensorboard
from moetron.train.optim import clip_gradients, param_groups


def grads_of_one_step(micro, global_batch):
    """The clipped gradients the optimizer sees in the first step (captured just before `optimizer.step`)."""
    cfg = tiny_config(moe=False, micro_batch_size=micro, global_batch_size=global_batch, hidden_dropout=0.0)
    cfg.model.attention_dropout = 0.0
    trainer = build_trainer(cfg)
    grads, step = {}, trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    result = trainer.train_step()
    assert result.ok and trainer.num_micro == global_batch // micro
    return grads, result


def test_accumulation_matches_one_big_micro_batch():
    accumulated, r1 = grads_of_one_step(micro=2, global_batch=4)
    single, r2 = grads_of_one_step(micro=4, global_batch=4)
    assert r1.grad_norm == pytest.approx(r2.grad_norm, rel=1e-5)
    assert float(r1.sums.losses[0]) == pytest.approx(float(r2.sums.losses[0]), rel=1e-6)
    for name, value in accumulated.items():
        torch.testing.assert_close(value, single[name], rtol=1e-5, atol=1e-6, msg=name)


def test_weight_decay_groups():
    cfg = tiny_config(moe=True)
    model = create_model(cfg.model, "cpu", 0)
    groups = {g["name"]: g for g in param_groups(model, weight_decay=0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert decay | no_decay == set(names.values()) and not decay & no_decay
    assert all(model.get_parameter(n).ndim >= 2 for n in decay)
    assert "word_embeddings.weight" in decay
    assert any(n.endswith("experts.w1_EDF") for n in decay)
    assert any(n.endswith("experts.b1_EF") for n in no_decay)  # stacked expert biases are 2-D but biases
    assert any(n.endswith(".bias") for n in no_decay) and any("layernorm" in n for n in no_decay)


def test_clipping_by_global_norm():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_gradients([a, b], max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.0, 0.8]), atol=1e-5, rtol=0)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert float(clip_gradients([a, b], max_norm=0.0)) == pytest.approx(5.0)  # 0: measure only
    assert b.grad.item() == 4.0
    b.grad = torch.tensor([float("nan")])
    assert not torch.isfinite(clip_gradients([a, b], max_norm=1.0))
    assert a.grad.tolist() == [3.0, 0.0]  # a non-finite norm leaves gradients for the skip logic


def test_fp16_overflow_skips_and_backs_off():
    cfg = tiny_config(fp16=True, initial_loss_scale=2.0**80, hysteresis=2, train_iters=40)
    trainer = build_trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    first = trainer.train_step()
    trainer._account(first)
    assert not first.ok and trainer.scaler.scale == 2.0**80  # hysteresis absorbs the first overflow
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    second = trainer.train_step()
    trainer._account(second)
    assert not second.ok and trainer.scaler.scale == 2.0**79
    while not trainer.train_step().ok:
        pass
    assert trainer.scaler.scale < 2.0**79
    assert trainer.progress.consecutive_skips == 0  # the scaler was still adjusting: not counted as NaN skips
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_nan_stops_after_max_skipped_steps_with_last_checkpoint_intact(tmp_path):
    cfg = tiny_config(train_iters=50, save=str(tmp_path), save_interval=2, max_skipped_steps=3)
    trainer = build_trainer(cfg)

    def nan_from_iteration_3(module, inputs, output):  # the weights stay finite; losses go NaN
        return output * float("nan") if trainer.progress.iteration >= 3 else output

    trainer.model.final_layernorm.register_forward_hook(nan_from_iteration_3)
    with pytest.raises(UserError, match="3 consecutive steps had NaN/Inf") as err:
        trainer.train()
    assert "iteration 2" in str(err.value) and "\n" not in str(err.value)
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    fresh = build_trainer(cfg)
    fresh.load(tmp_path / "iter_0000002")
    assert fresh.progress.iteration == 2
    assert all(torch.isfinite(p).all() for p in fresh.model.parameters())


def test_metrics_and_eval_files(tmp_path):
    cfg = tiny_config(train_iters=4, log_interval=2, eval_interval=3, eval_iters=1, output_dir=str(tmp_path))
    trainer = build_trainer(cfg)
    assert trainer.train() == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [2, 4]
    assert all(tuple(m) == METRIC_KEYS for m in metrics)
    n_moe = len(cfg.model.moe_layer_indices())
    assert all(len(m["expert_load_max_over_mean"]) == n_moe == len(m["dropped_fraction"]) for m in metrics)
    assert all(m["expert_load_max_over_mean"][0] >= 1.0 for m in metrics)
    assert metrics[1]["consumed_tokens"] == 4 * 4 * cfg.model.seq_length
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in evals] == [3, 4]  # interval + final evaluation
    assert all(tuple(e) == EVAL_KEYS for e in evals)
    assert evals[0]["valid_ppl"] == pytest.approx(2.718281828 ** evals[0]["valid_loss"], rel=1e-6)
    assert (tmp_path / "config.yaml").exists()


def test_exact_resume_single_process(tmp_path):
    n = 3
    cfg = tiny_config(train_iters=2 * n, save=str(tmp_path), lr_warmup_iters=2, lr_decay_style="cosine")
    straight = run_losses(build_trainer(cfg), 2 * n)
    first = build_trainer(cfg)
    head = run_losses(first, n)
    first.save()
    resumed = build_trainer(cfg)
    resumed.load(tmp_path / "iter_0000003")
    tail = run_losses(resumed, n)
    assert head + tail == straight  # bit-identical, dropout and random token selection included


def test_sigterm_finishes_the_step_saves_and_returns_zero(tmp_path):
    cfg = tiny_config(train_iters=50, save=str(tmp_path), save_interval=100)
    trainer = build_trainer(cfg)
    step = trainer.train_step

    def step_then_signal():
        result = step()
        if trainer.progress.iteration == 2:  # the signal arrives while iteration 3 runs
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    trainer.train_step = step_then_signal
    assert trainer.train() == 0
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_tensorboard_missing_is_a_note_not_a_crash(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    assert open_tensorboard("tb-dir") is None
    assert "tensorboard is not installed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "limits, stops_at",
    [
        ({"train_iters": 3, "train_samples": 100, "train_tokens": 10**6}, 3),  # iterations first
        ({"train_iters": 50, "train_samples": 10, "train_tokens": 10**6}, 3),  # 10 samples: 3 batches of 4
        ({"train_iters": 50, "train_samples": 100, "train_tokens": 2 * 4 * SEQ}, 2),  # tokens first, exactly 2
        ({"train_iters": None, "train_samples": None, "train_tokens": 4 * SEQ + 1}, 2),  # tokens alone, rounded up
    ],
)
def test_stops_at_the_first_of_iters_samples_tokens(limits, stops_at):
    cfg = tiny_config(log_interval=100, **limits)
    trainer = build_trainer(cfg)
    assert trainer.train() == 0
    assert trainer.progress.iteration == stops_at
    assert trainer.progress.consumed_samples == 4 * stops_at and trainer.progress.consumed_tokens == 4 * SEQ * stops_at


def test_evaluation_repeats_itself_and_leaves_the_training_rng_alone():
    cfg = tiny_config(eval_iters=2, moe_eval_capacity_factor=0.5)  # top-2 second-expert sampling: random in eval
    assert cfg.model.moe_top2_2nd_expert_sampling
    trainer = build_trainer(cfg)
    trainer.logger = RunLogger(None, None, True, cfg.train.train_iters)
    before = torch.get_rng_state()
    first = trainer.run_evaluation()
    assert torch.equal(torch.get_rng_state(), before)  # training's dropout/routing stream is untouched
    torch.rand(5)  # whatever the RNG state, the evaluation draws the same numbers
    assert trainer.run_evaluation()["valid_loss"] == first["valid_loss"]


def test_evaluation_runs_the_head_loss_the_flag_chose(monkeypatch):
    """`--no-fused-cross-entropy` reaches evaluation: validation runs the logits path then (it used to fuse always),
    and the default fuses; both give the same loss up to rounding."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flag_cfg, _ = load_config(None, cli_overrides(parser.parse_args(["--no-fused-cross-entropy"])))
    calls = []
    for cls, path in ((FusedHeadLoss, "fused"), (LogitsHeadLoss, "logits")):
        original = cls.__call__

        def spy(self, *args, _original=original, _path=path, **kwargs):
            calls.append(_path)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)
    losses = {}
    for fused in (True, flag_cfg.train.fused_cross_entropy):
        trainer = build_trainer(tiny_config(eval_iters=2, fused_cross_entropy=fused))
        trainer.logger = RunLogger(None, None, True, trainer.cfg.train.train_iters)
        calls.clear()
        losses[fused] = trainer.run_evaluation()["valid_loss"]
        assert calls == ["fused" if fused else "logits"] * 2 * trainer.num_micro
    assert set(losses) == {True, False}
    assert losses[False] == pytest.approx(losses[True], rel=1e-6)


class RecordingWriter:
    """Stands in for tensorboard's SummaryWriter: remembers every (tag, value, step)."""

    scalars: list[tuple[str, float, int]] = []

    def __init__(self, log_dir: str, max_queue: int = 10):
        self.log_dir = log_dir

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        RecordingWriter.scalars.append((tag, float(value), int(step)))

    def close(self) -> None:
        pass


def test_tensorboard_uses_megatrons_tag_names(monkeypatch, tmp_path, capsys):
    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = RecordingWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setattr(RecordingWriter, "scalars", [])
    cfg = tiny_config(train_iters=4, log_interval=2, eval_interval=2, eval_iters=1, tensorboard_dir=str(tmp_path))
    assert build_trainer(cfg).train() == 0
    steps: dict[str, list[int]] = {}
    for tag, _, step in RecordingWriter.scalars:
        steps.setdefault(tag, []).append(step)
    samples, tokens = [2 * 4, 4 * 4], [2 * 4 * SEQ, 4 * 4 * SEQ]
    for tag in ("lm-loss-training/lm loss", "lm-loss-training/moe loss", "learning-rate/learning-rate",
                "grad-norm/grad-norm", "loss-scale/loss-scale"):  # fmt: skip
        assert steps[tag] == [2, 4], tag
        assert steps[f"{tag} vs samples"] == samples and steps[f"{tag} vs tokens"] == tokens, tag
    for tag in ("lm-loss-validation/lm loss validation", "lm-loss-validation/lm loss validation ppl"):
        assert steps[tag] == [2, 4], tag  # at the eval interval and the final evaluation
        assert steps[f"{tag} vs samples"] == samples and steps[f"{tag} vs tokens"] == tokens, tag
    assert steps["steps-vs-samples/steps-vs-samples"] == samples
    assert steps["steps-vs-tokens/steps-vs-tokens"] == tokens
    assert "moe/load-max-over-mean layer 1" in steps and "iteration-time/tokens-per-sec" in steps  # layer 1 is MoE
    log = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    assert all(re.search(r"\| load max/mean 1:\d+\.\d\d \| dropped 1:\d\.\d{3} \|", line) for line in log), log
    values = {tag: value for tag, value, _ in RecordingWriter.scalars}
    ppl, loss = values["lm-loss-validation/lm loss validation ppl"], values["lm-loss-validation/lm loss validation"]
    assert ppl == pytest.approx(math.exp(loss), rel=1e-6)
