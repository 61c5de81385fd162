"""Routing-health alarms, each triggered by a real short training run (one process, tiny thresholds via flags).

A collapsed router is made by initialisation: the MoE layers' input norm gets a large constant bias v, so every
token's router input is ≈ v, and the router's row of expert 0 is v: every token prefers expert 0 with a
probability near 1. Experts 1–3 then get no token (dead), the mean routing distribution is nearly one-hot
(collapse), and the aux loss (coefficient 0.5) falls as the router flattens its probabilities while expert 0 keeps
every token (hacking; the mean distribution's entropy recovers meanwhile: the collapse alarm clears). A balanced
run (same model, default init) raises none of them.
"""

from __future__ import annotations

import json

import pytest
import torch
from host_read_counter import HostReadCounter
from trainer_support import build_trainer, tiny_config

from moetron.train.routing_health import RoutingHealth, mean_distribution_entropy, routing_health_problems

STEPS = 6


def health_config(tmp_path, **flags):
    cfg = tiny_config(train_iters=STEPS, log_interval=1, output_dir=str(tmp_path), topk=1, hidden_dropout=0.0)
    cfg.model.attention_dropout = 0.0
    cfg.model.moe_loss_coeff = 0.5
    t = cfg.train
    t.moe_dead_expert_steps, t.moe_collapse_entropy, t.moe_aux_hacking_window = 2, 0.5, 2
    for key, value in flags.items():
        setattr(t, key, value)
    return cfg


@torch.no_grad()
def collapse_router(trainer) -> None:
    g = torch.Generator().manual_seed(0)
    for _, layer in trainer.model.layer_items():
        if layer.is_moe:
            v = torch.randn(layer.post_attention_layernorm.weight.shape, generator=g)
            layer.post_attention_layernorm.bias.copy_(4 * v)
            layer.mlp.router.weight.zero_()
            layer.mlp.router.weight[0] = 3 * v / (4 * v.norm() ** 2)  # expert 0's logit ≈ 3, the others' 0


def train_and_read(cfg, capsys, collapsed: bool) -> tuple[list[dict], list[str]]:
    trainer = build_trainer(cfg)
    if collapsed:
        collapse_router(trainer)
    assert trainer.train() == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (trainer.run_dir and open(f"{trainer.run_dir}/metrics.jsonl"))]
    return records, [line for line in out.splitlines() if line.startswith("warning: routing health")]


def test_each_alarm_fires_once_from_a_collapsed_run_and_none_from_a_healthy_one(tmp_path, capsys):
    records, alarms = train_and_read(health_config(tmp_path / "collapsed"), capsys, collapsed=True)
    assert len(records) == STEPS
    # dead experts: reported once, from the step the counter reaches --moe-dead-expert-steps 2
    dead = [line for line in alarms if "received no token" in line]
    assert len(dead) == 1 and "at iteration 2:" in dead[0] and "expert(s) 1 2 3 " in dead[0], alarms
    assert records[0]["moe_dead_experts"] == [0] and all(r["moe_dead_experts"] == [3] for r in records[1:])
    # collapse: one line, and the field on every record while it holds
    collapse = [line for line in alarms if "routing collapsed" in line]
    assert len(collapse) == 1 and "at iteration 1:" in collapse[0], alarms
    assert records[0]["moe_routing_entropy"][0] < 0.5 and records[0]["routing_alarms"] == ["routing_collapse"]
    assert records[-1]["moe_routing_entropy"][0] > 0.9  # the aux loss flattens the router's probabilities...
    # hacking: the aux loss falls (the router flattens) while expert 0 keeps every token
    hacking = [line for line in alarms if "aux loss fell" in line]
    assert len(hacking) == 1 and "at iteration 3:" in hacking[0] and "--moe-aux-hacking-window 2" in hacking[0]
    assert all("aux_loss_hacking" in r["routing_alarms"] for r in records[2:])
    assert all(r["expert_load_max_over_mean"] == [4.0] for r in records)  # ...but expert 0 keeps every token
    assert all(r["moe_ep_load_routed"] == 1.0 == r["moe_ep_load_computed"] for r in records)  # one process: no EP

    healthy, quiet = train_and_read(health_config(tmp_path / "healthy"), capsys, collapsed=False)
    assert quiet == [] and all(r["routing_alarms"] == [] for r in healthy)
    assert all(r["moe_routing_entropy"][0] > 0.9 for r in healthy)


def test_alarms_turn_off_with_zero_flags(tmp_path, capsys):
    flags = dict(moe_dead_expert_steps=0, moe_collapse_entropy=0.0, moe_aux_hacking_window=0)
    records, alarms = train_and_read(health_config(tmp_path, **flags), capsys, collapsed=True)
    assert alarms == [] and len(records) == STEPS
    # nothing was tracked, so nothing is reported: no dead-expert count, no entropy (a dense model's empty fields)
    assert all(r["routing_alarms"] == r["moe_dead_experts"] == r["moe_routing_entropy"] == [] for r in records)


@pytest.mark.parametrize("on", [True, False])
def test_observe_step_does_nothing_with_every_alarm_off(tmp_path, on):
    off = dict(moe_dead_expert_steps=0, moe_collapse_entropy=0.0, moe_aux_hacking_window=0)
    trainer = build_trainer(health_config(tmp_path, **({} if on else off)))
    trainer.model.train()
    trainer.model(trainer.next_micro_batch().tokens_BT, return_logits=False)  # the MoE layers sum their routing
    with HostReadCounter() as reads:
        trainer.health.observe_step(trainer.executor.moe_record)
    assert reads.total == 0, reads.by_kind  # on or off, the step's observation stays on the device
    assert len(trainer.executor.moe_record.routing_2E) == len(trainer.model.moe_layers())  # the forward reported
    assert (trainer.health.pack() is None) == (not on)  # off: nothing rides on the interval's all-reduce


def test_dead_expert_needs_every_data_parallel_rank_idle():
    health = RoutingHealth([(1, 4)], dead_steps=3, collapse_entropy=0.0, window=0, device="cpu")
    # ranks' flags averaged over 2 ranks: expert 2 idle on both, expert 3 on one only; then the mean probabilities
    # and the routes per expert (saved for plan --routing-from)
    reduced = torch.tensor([0.0, 0.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 5.0, 3.0, 0.0, 0.5], dtype=torch.float64)
    fields, lines = health.check(reduced, {}, iteration=10)
    assert fields["moe_dead_experts"] == [1] and "expert(s) 2 received no token for 3 steps" in lines[0]
    assert health.interval_routes == [[5.0, 3.0, 0.0, 0.5]]


def test_entropy_and_flag_problems():
    assert mean_distribution_entropy(torch.ones(8)) == pytest.approx(torch.log(torch.tensor(8.0)).item())
    assert mean_distribution_entropy(torch.tensor([1.0, 0.0, 0.0])) == pytest.approx(0.0)
    assert routing_health_problems(100, 0.5, 100) == []
    problems = routing_health_problems(-1, 1.5, -2)
    assert [p.split(" ")[0] for p in problems] == [
        "--moe-dead-expert-steps",
        "--moe-collapse-entropy",
        "--moe-aux-hacking-window",
    ]
