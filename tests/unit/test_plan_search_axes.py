"""`plan --search` over pipeline schedules, uneven first/last stages and context parallelism (issues 22, 23): every
proposed row is a config `moetron train` accepts, and the cost model prices ZeRO × PP, zero bubble and CP as the
code runs them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.parallel.dp.cost import dp_seconds
from moetron.parallel.pp import cost as pipe
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.plan import cost_model
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.measure import random_corpus
from moetron.plan.search import balanced_ends, prune_dominated, search
from moetron.validate import validate


def flag_overrides(flags: list[str]) -> dict:
    """Flags parsed exactly as `moetron train` parses them."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return cli_overrides(parser.parse_args(flags))


# a dense model with a large vocabulary (the ends outweigh a layer: uneven stages pay) and sequences long enough
# for context parallelism (seq / cp >= MIN_CP_TOKENS)
LONG_DENSE = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 2048,
    "vocab_size": 8192,
    "attention_dropout": 0.0,  # the ring (p2p) has none
    "micro_batch_size": 1,
    "global_batch_size": 4,
    "train_iters": 10,
}


@pytest.fixture(scope="module")
def long_config(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("axes")
    config = directory / "long.yaml"
    config.write_text(yaml.safe_dump({**LONG_DENSE, "data_path": [random_corpus(directory, 8192, 1 << 15)]}))
    return config


def test_every_schedule_split_and_cp_row_validates(long_config):
    """Unpruned, the search offers every schedule, an uneven split and CP with each attention; `moetron train`
    accepts every row (the config file + the row's flags); pruning keeps the fastest row and only drops rows
    another variant of their layout beats in time and memory."""
    cfg, _ = load_config(str(long_config), {})
    device, net = accelerator("cpu", "8GB"), cost_model.network(4, None, "cpu")
    result = search(cfg, 4, device, net, fixed={"mbs": 1, "ckpt": False}, prune=False)  # fixed: a short test
    seen = set()
    for row in result.rows:
        applied, _ = load_config(str(long_config), flag_overrides(row.flags))
        assert validate(applied, 4) == [], row.flags
        lay = row.layout
        seen |= {lay.schedule_name} if lay.pp > 1 else set()
        seen |= {"uneven"} if lay.first_layers is not None else set()
        seen |= {f"cp:{lay.cp_comm}"} if lay.cp > 1 else set()
    assert seen >= {"1f1b", "gpipe", "zero-bubble", "interleaved-1f1b", "uneven", "cp:all_gather", "cp:p2p", "cp:a2a"}
    kept = prune_dominated(result.rows)
    assert min(r.cost.total for r in kept) == min(r.cost.total for r in result.rows) and len(kept) < len(result.rows)
    for row in set(map(id, result.rows)) - set(map(id, kept)):
        loser = next(r for r in result.rows if id(r) == row)
        same = [r for r in kept if r.layout.tp == loser.layout.tp and r.layout.pp == loser.layout.pp
                and r.layout.cp == loser.layout.cp and r.layout.zero == loser.layout.zero
                and r.layout.mbs == loser.layout.mbs and r.layout.ckpt == loser.layout.ckpt
                and r.layout.sp == loser.layout.sp]  # fmt: skip
        assert any(r.cost.total <= loser.cost.total and r.plan.needed_bytes <= loser.plan.needed_bytes for r in same)


def test_a_fixed_schedule_and_cp_size_stay_fixed(long_config):
    cfg, _ = load_config(str(long_config), {"pipeline_schedule": "zero-bubble", "context_parallel_size": 2})
    fixed = {"schedule": "zero-bubble", "cp": 2}
    result = search(cfg, 4, accelerator("cpu", "8GB"), cost_model.network(4, None, "cpu"), fixed=fixed)
    assert result.rows and all(r.layout.cp == 2 for r in result.rows)
    assert all(r.layout.schedule == "zero-bubble" for r in result.rows if r.layout.pp > 1)


def test_balanced_ends_shift_layers_off_heavy_ends():
    cfg, _ = load_config("gpt-6.7B", {})
    assert balanced_ends(cfg, 4) == (7, 7)  # embedding and head ≈ one 4096-wide layer each: 7+1, 9, 9, 7+1
    assert balanced_ends(cfg, 2) is None  # two stages: both ends equally heavy already
    small, _ = load_config("gpt-1.3B", {})  # 2048 wide, a 50k vocabulary: each end ≈ two layers
    first, last = balanced_ends(small, 8)
    assert first < small.model.num_layers // 8 and last < small.model.num_layers // 8


def _plan(overrides: dict, gpus: int = 8):
    cfg, _ = load_config("gpt-1.3B", {"micro_batch_size": 1, "global_batch_size": 64, **overrides})
    return make_plan(cfg, gpus, accelerator("A100-80GB"))


def test_zero3_under_pipelining_gathers_and_reduces_once_per_step():
    """FSDP2 per pipeline stage (torch's stage: no gradient sync and no reshard until the last backward): the DP
    term does not grow with the micro-batches, unlike ZeRO-3 without pipelining (per micro-batch)."""
    net = cost_model.network(8, None, "A100-80GB")
    piped = {"pipeline_model_parallel_size": 2, "zero_stage": 3}
    few, many = _plan({**piped, "global_batch_size": 16}), _plan({**piped, "global_batch_size": 64})
    assert many.accumulation_steps == 4 * few.accumulation_steps

    def dp(plan) -> float:
        return dp_seconds(cost_model.step_context(plan, net, 0.0))

    assert dp(many) == pytest.approx(dp(few))
    flat_few, flat_many = _plan({"zero_stage": 3, "global_batch_size": 16}), _plan({"zero_stage": 3})
    assert dp(flat_many) > 3 * dp(flat_few)


def test_fsdp_gathers_follow_torchs_unshard_window():
    from collections import Counter

    from torch.distributed.pipelining import schedules

    layout = PipelineLayout.build(16, 4, "interleaved-1f1b", virtual_layers=2)
    assert pipe.fsdp_gathers_per_step(layout, 8) == 1  # 2 stage modules per rank: both stay unsharded
    four = PipelineLayout.build(16, 4, "interleaved-1f1b", virtual_layers=1)  # 4 per rank > torch's 3
    gathers = pipe.fsdp_gathers_per_step(four, 8)
    actions = pipe._runtime_gathers.__wrapped__  # the uncached count, against torch's own lowering below
    assert gathers == actions("interleaved-1f1b", 4, 4, 8) > 1
    stages = [0, 4, 8, 12, 0, 4, 8, 12, 12, 8, 4, 0]
    ops = [schedules._Action(s, schedules.FORWARD, i) for i, s in enumerate(stages)]
    torch_counts = Counter(a.stage_index for a in schedules._add_unshard_reshard(ops)
                           if a.computation_type == schedules.UNSHARD)  # fmt: skip
    assert pipe.unshard_counts(stages) == torch_counts


def test_zero_bubble_bubble_and_deferred_weight_gradients():
    one, zb = _plan({"pipeline_model_parallel_size": 4}), _plan({"pipeline_model_parallel_size": 4,
                                                                 "pipeline_schedule": "zero-bubble"})  # fmt: skip
    m = one.accumulation_steps
    assert one.bubble == pytest.approx(3 / (m + 3)) and zb.bubble == pytest.approx(3 / (3 * m + 3))
    # ZB1P keeps p micro-batches between F and W on every rank, and the last rank defers p weight gradients
    assert [s.in_flight for s in zb.stages] == [4, 4, 4, 4] and [s.in_flight for s in one.stages] == [4, 3, 2, 1]
    assert zb.stages[-1].memory.activations > one.stages[-1].memory.activations


def test_context_parallel_costs_by_comm_type():
    net = cost_model.network(8, None, "A100-80GB")
    base = {"seq_length": 8192, "max_position_embeddings": 8192, "attention_dropout": 0.0}
    none = cost_model.step_cost(_plan(base), net)
    costs = {comm: cost_model.step_cost(_plan({**base, "context_parallel_size": 2, "cp_comm_type": comm}), net)
             for comm in ("all_gather", "p2p", "a2a")}  # fmt: skip
    assert none.part("cp") == 0
    assert costs["all_gather"].part("cp") > 0 and costs["a2a"].part("cp") > 0
    assert costs["p2p"].part("cp") < costs["all_gather"].part("cp")  # the ring's passes hide behind the block compute
    # each rank computes half the tokens of its (half as many) data-parallel peers' share: the same compute
    assert costs["all_gather"].compute == pytest.approx(none.compute)
    gathered = _plan({**base, "context_parallel_size": 2}).memory.activations
    ring = _plan({**base, "context_parallel_size": 2, "cp_comm_type": "p2p"}).memory.activations
    assert gathered > ring  # all_gather saves every layer's whole-sequence K/V
