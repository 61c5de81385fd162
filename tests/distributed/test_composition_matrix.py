"""The composition matrix: every pair of eight layout options, and three triples, against the one-process curve.

The options are ZeRO-1, ZeRO-3, TP 2 + SP, PP 2 with 1F1B, PP 2 with zero bubble, EP 2, expert TP (ETP 2) and
`--compile`. A pair is proven by a run that has both options, trains from the weights one process draws, and
follows that process's curve: the loss and the clipped global gradient norm at every step, 1e-4 relative.
  PROVEN     the pairs another test already runs so (its test and layout); no layout here is added for them.
  LAYOUTS    the runs of this file, for every other pair and the triples ZeRO × TP × PP, ZeRO × PP × EP and
             TP × PP × EP. A layout holds several options, so it proves every pair and triple inside it.
  EXCLUSIVE  the pairs that are two values of one flag (ZeRO-1 / ZeRO-3, 1F1B / zero bubble).
The other two schedules run with ZeRO too (ZeRO-3 × PP 2 interleaved, ZeRO-1 × PP 2 GPipe: `OTHER_SCHEDULES`).
`test_every_pair_and_triple_is_proven` fails when a pair or triple has none of the three, or when `PROVEN` names a
test or layout that its file does not have.

The model and batch are those of `test_zero_compose.py`: 4 layers, layer 0 dense and layers 1–3 MoE (4 experts,
top-2, random token selection, hidden dropout on, attention dropout off), global batch 8 in micro-batches of 2.
Every layout runs STEPS steps; the ZeRO ones must hold the optimizer on ZeRO shards, the compiled ones compiled
blocks. Two spawned groups run the layouts: 4 processes for every layout whose product is 4, and 8 processes for
ZeRO × TP 2 × PP 2 (dp 2: at dp 1 ZeRO would shard nothing). docs/guide.md's "What composes" table is `readme_table()`,
and a test keeps the two equal.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from launch import run_distributed
from test_pipeline_parallel_train import curve, pp_config, pp_trainer
from test_zero_compose import assert_curve, optimizer_state_bytes

from moetron.validate import validate

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

OPTIONS = {  # option → (its README column name, the config fields it sets)
    "zero1": ("ZeRO-1", {"zero_stage": 1}),
    "zero3": ("ZeRO-3", {"zero_stage": 3}),
    "tp": ("TP 2 + SP", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp": ("PP 2 1F1B", {"pipeline_model_parallel_size": 2}),
    "zb": ("PP 2 zero bubble", {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zero-bubble"}),
    "ep": ("EP 2", {"moe_expert_parallel_size": 2}),
    "etp": ("ETP 2", {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2}),
    "compile": ("`--compile`", {"compile": True}),
}
TRIPLES = ({"zero", "tp", "pp"}, {"zero", "pp", "ep"}, {"tp", "pp", "ep"})  # "zero": either stage, "pp": either

EXCLUSIVE = {  # two values of one flag: no layout has both
    frozenset({"zero1", "zero3"}): "one --zero-stage",
    frozenset({"pp", "zb"}): "one --pipeline-schedule",
}

ZERO_COMPOSE = "test_zero_compose.py::test_zero_composes_with_tensor_and_pipeline_parallelism"
TP_TRAIN = "test_tensor_parallel_train.py::test_tensor_parallel_training_and_checkpoints"
PP_TRAIN = "test_pipeline_parallel_train.py::test_pipeline_parallel_training_and_checkpoints"
ZERO_NORM = "test_zero_grad_norm.py::test_every_zero_stage_and_expert_layout_has_the_single_process_gradient_norm"
PROVEN = {  # pair → the test (in tests/distributed/) that runs a layout with both, and that layout's name there
    frozenset({"zero1", "tp"}): (ZERO_COMPOSE, "zero1-tp2"),
    frozenset({"zero1", "zb"}): (ZERO_COMPOSE, "zero1-pp2-zb-compile"),
    frozenset({"zero1", "compile"}): (ZERO_COMPOSE, "zero1-pp2-zb-compile"),
    frozenset({"zb", "compile"}): (ZERO_COMPOSE, "zero1-pp2-zb-compile"),
    frozenset({"zero3", "pp"}): (ZERO_COMPOSE, "zero3-pp2"),
    frozenset({"zero3", "zb"}): (ZERO_COMPOSE, "zero3-pp2-zb"),
    frozenset({"zero1", "ep"}): (ZERO_NORM, "EXPERT_PARALLEL = (4, 2, 1)"),  # × every stage, dp 4
    frozenset({"zero3", "ep"}): (ZERO_NORM, "EXPERT_PARALLEL = (4, 2, 1)"),
    frozenset({"tp", "ep"}): (TP_TRAIN, "dp2-tp2-ep2"),  # experts folded over the TP ranks
    frozenset({"tp", "etp"}): (TP_TRAIN, "dp2-tp2-ep2-etp2-sp-ac"),
    frozenset({"ep", "etp"}): (TP_TRAIN, "dp2-tp2-ep2-etp2-sp-ac"),
    frozenset({"tp", "compile"}): (TP_TRAIN, "compiled_losses"),  # TP 2 + SP × EP 2, 3 steps
    frozenset({"ep", "compile"}): (TP_TRAIN, "compiled_losses"),
    frozenset({"tp", "pp"}): (PP_TRAIN, "pp2tp2"),  # with SP
    frozenset({"pp", "ep"}): (PP_TRAIN, "pp2ep2"),
}

# the layouts this file runs: name → (options, processes). Every TP layout has SP: compiling after both a non-SP and
# an SP TP model ran in one process trips torch 2.13's partitioner (test_tensor_parallel_train.py).
LAYOUTS = {
    "zero3-tp2-etp2-compile": ({"zero3", "tp", "etp", "compile"}, 4),
    "zero1-pp2-ep2": ({"zero1", "pp", "ep"}, 4),
    "zero1-tp2-etp2-ep2": ({"zero1", "tp", "etp", "ep"}, 4),
    "tp2-etp2-pp2-compile": ({"tp", "etp", "pp", "compile"}, 4),
    "tp2-pp2zb-ep2": ({"tp", "zb", "ep"}, 4),
    "tp2-etp2-pp2zb": ({"tp", "etp", "zb"}, 4),
    "zero3-tp2-pp2": ({"zero3", "tp", "pp"}, 8),
    "zero1-tp2-pp2zb-ep2": ({"zero1", "tp", "zb", "ep"}, 8),  # experts folded over TP, edp 2
    # the other two schedules with ZeRO (no matrix column: "pp" stands for 1F1B), PP 2 at dp 2
    "zero3-pp2-interleaved": ({"zero3"}, 4),
    "zero1-pp2-gpipe": ({"zero1"}, 4),
}
OTHER_SCHEDULES = {"zero3-pp2-interleaved": "interleaved-1f1b", "zero1-pp2-gpipe": "gpipe"}


def fields(options: set[str]) -> dict:
    out: dict = {}
    for option in sorted(options, key=list(OPTIONS).index):
        out |= OPTIONS[option][1]
    return out


def config(layout: str | None = None):
    dims = fields(LAYOUTS[layout][0]) if layout else {}
    if layout in OTHER_SCHEDULES:
        dims |= {"pipeline_model_parallel_size": 2, "pipeline_schedule": OTHER_SCHEDULES[layout]}
    pp = dims.pop("pipeline_model_parallel_size", 1)
    schedule = dims.pop("pipeline_schedule", None)
    virtual = 1 if schedule in ("zero-bubble", "interleaved-1f1b") else None  # two stages per rank
    return pp_config(pp, schedule, virtual, train_iters=STEPS, attention_dropout=0.0, **dims)


# ---------------------------------------------------------------- the table (no processes)
def generalised(options: set[str]) -> set[str]:
    """An option set with "zero" for either ZeRO stage and "pp" for either schedule (how TRIPLES are written)."""
    return {"zero" if o.startswith("zero") else "pp" if o == "zb" else o for o in options}


def proof(pair: frozenset) -> str:
    """Where `pair` is proven: a layout of this file, another test's, or why no layout can have both."""
    if pair in EXCLUSIVE:
        return f"— ({EXCLUSIVE[pair]})"
    if pair in PROVEN:
        test, layout = PROVEN[pair]
        return f"{test} ({layout})"
    here = [name for name, (options, _) in LAYOUTS.items() if pair <= options]
    return f"{Path(__file__).name} ({here[0]})" if here else ""


def test_every_pair_and_triple_is_proven():
    for pair in map(frozenset, itertools.combinations(OPTIONS, 2)):
        assert proof(pair), f"no test proves {sorted(pair)}: add a layout to LAYOUTS or the proving test to PROVEN"
    for triple in TRIPLES:
        assert any(triple <= generalised(o) for o, _ in LAYOUTS.values()), f"no layout has {sorted(triple)}"
    for test, layout in PROVEN.values():
        path, name = test.split("::")
        source = (REPO / "tests" / "distributed" / path).read_text()
        assert f"def {name}(" in source and layout in source, f"PROVEN names {test} ({layout}), not in that file"


def test_every_layout_is_accepted_before_launch():
    for layout, (_, world) in LAYOUTS.items():
        cfg = config(layout)  # the runs read in-memory samples: the data flags' problems are not the layout's
        assert [p for p in validate(cfg, world) if p not in cfg.data.problems()] == [], layout


def readme_table() -> str:
    """The README's table: one row and column per option; a cell says where the pair is proven."""
    names = [OPTIONS[o][0] for o in OPTIONS]
    rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in OPTIONS:
        cells = []
        for b in OPTIONS:
            where = proof(frozenset({a, b})) if a != b else ""
            cells.append("" if a == b else "—" if where.startswith("—") else "✓")
        rows.append(f"| {OPTIONS[a][0]} | " + " | ".join(cells) + " |")
    names = {"zero": "ZeRO", "tp": "TP", "pp": "PP", "ep": "EP"}
    triples = []
    for triple in TRIPLES:
        runs = [f"`{name}`" for name, (options, _) in LAYOUTS.items() if triple <= generalised(options)]
        triples.append(" × ".join(names[o] for o in sorted(triple, key=list(names).index)) + ": " + ", ".join(runs))
    return "\n".join(rows) + "\n\nTriples and more, each one run: " + "; ".join(triples) + ".\n"


def test_readme_has_the_table():
    def words(text: str) -> str:  # the README wraps the triples' line
        return " ".join(text.split())

    text = (REPO / "docs" / "guide.md").read_text()
    assert words(readme_table()) in words(text), "docs/guide.md's 'What composes' differs from readme_table(); paste it"


# ---------------------------------------------------------------- the runs
def on(world_size: int) -> list[str]:
    return [layout for layout, (_, world) in LAYOUTS.items() if world == world_size]


def group_checks(rank: int, world_size: int) -> dict:
    from moetron.parallel.env import init_distributed

    env = init_distributed()
    return {layout: run_layout(layout, env) for layout in on(world_size)}


def run_layout(layout: str, env) -> dict:
    """The curve, and what really ran: the optimizer on ZeRO shards, blocks compiled."""
    trainer = pp_trainer(config(layout), env)
    out = curve(trainer, STEPS)
    compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in trainer.model.modules())
    return out | {"sharded": optimizer_state_bytes(trainer) is not None, "compiled": compiled}


def follow_one_process(world_size: int) -> None:
    """Every layout of `world_size` processes gives the one-process loss and gradient norm at every step."""
    per_rank = run_distributed(group_checks, world_size=world_size, timeout=900)
    torch.set_num_threads(1)
    want = curve(pp_trainer(config()), STEPS)
    assert on(world_size) and all(list(r) == on(world_size) for r in per_rank)
    for layout in on(world_size):
        assert_curve([r[layout] for r in per_rank], want, layout)
        options = LAYOUTS[layout][0]
        assert all(r[layout]["sharded"] for r in per_rank) or not options & {"zero1", "zero3"}, layout
        assert all(r[layout]["compiled"] == ("compile" in options) for r in per_rank), layout


@pytest.mark.distributed
@pytest.mark.slow
def test_four_process_layouts_follow_one_process():
    follow_one_process(4)


@pytest.mark.distributed
@pytest.mark.slow
def test_eight_process_layouts_follow_one_process():
    follow_one_process(8)


if __name__ == "__main__":  # the README table, to paste into "What composes"
    print(readme_table(), end="")
