"""`moetron plan --routing-from RUN_DIR`: a real short training run with a collapsed router (every token on
expert 0, see test_routing_health.py) saves its routes per expert; the plan of that model on EP 2 then sizes the
hottest rank (holding experts 0–1: every row) larger than balanced routing does, and with `--moe-expert-replicas 1`
(one slot per rank takes half of expert 0's rows) back to balanced. A run directory without the counts is one line.
"""

from __future__ import annotations

import json

import pytest
from test_routing_health import collapse_router, health_config
from trainer_support import build_trainer

from moetron.cli import main
from moetron.config_cli import to_yaml
from moetron.plan.routing_from import rank_load_factors, read_routing
from moetron.train.routing_health import ROUTING_COUNTS_FILE


@pytest.fixture(scope="module")
def collapsed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    cfg = health_config(tmp)
    cfg.model.moe_loss_coeff = 0.0  # nothing pulls the router back to balance
    cfg.model.moe_token_dropping = False  # dropless: the hot rank computes every row routed to it
    trainer = build_trainer(cfg)
    collapse_router(trainer)
    assert trainer.train() == 0
    config = tmp / "plan.yaml"
    config.write_text(to_yaml(cfg))
    return trainer.run_dir, str(config)


def plan_json(capsys, config: str, *flags: str) -> dict:
    argv = ["plan", "--config", config, "--gpus", "2", "--gpu-type", "cpu", "--gpu-memory", "8GB"]
    argv += ["--moe-expert-parallel-size", "2", "--json", *flags]
    assert main(argv) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_plan_sizes_the_hottest_rank_from_a_runs_routing_and_replicas_even_it(collapsed_run, capsys):
    run_dir, config = collapsed_run
    routing = read_routing(run_dir)
    assert routing.iteration == 6 and routing.run_ep == 1 and len(routing.routes_per_layer) == 1
    assert all(r[0] > 0 and r[1:] == [0.0, 0.0, 0.0] for r in routing.routes_per_layer)  # all on expert 0
    assert rank_load_factors(routing.routes_per_layer[0], 2, 0) == (2.0, 2.0)
    assert rank_load_factors(routing.routes_per_layer[0], 2, 1) == (2.0, 1.0)

    balanced = plan_json(capsys, config)
    hot = plan_json(capsys, config, "--routing-from", run_dir)
    replicated = plan_json(capsys, config, "--routing-from", run_dir, "--moe-expert-replicas", "1")
    b, h, r = (p["memory"] for p in (balanced, hot, replicated))
    assert h["activations"] > b["activations"] and h["all_to_all"] > b["all_to_all"] and h["peak"] > b["peak"]
    assert r["activations"] == b["activations"] and r["peak"] < h["peak"]  # one slot per rank: back to even
    assert hot["step_time_s"] > balanced["step_time_s"] >= replicated["step_time_s"] * (1 - 1e-9)
    used = hot["routing_from"]
    assert used["run_dir"] == run_dir and used["routed"] == [2.0] and used["replicas"] == 0
    assert replicated["routing_from"]["computed"] == [1.0]

    main(["plan", "--config", config, "--gpus", "2", "--gpu-memory", "8GB", "--moe-expert-parallel-size", "2",
          "--routing-from", run_dir])  # fmt: skip
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"routing from {run_dir} (iteration 6): hottest EP rank of 2 computes 2.000×"), first


def test_a_run_dir_without_counts_is_one_line(tmp_path, collapsed_run, capsys):
    _, config = collapsed_run
    argv = ["plan", "--config", config, "--gpus", "2", "--moe-expert-parallel-size", "2", "--routing-from"]
    assert main([*argv, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"has no {ROUTING_COUNTS_FILE}" in err, err
