"""`moetron plan --search`: every proposed layout is one `moetron train` accepts; the cost model's terms; the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from moetron.cli import main
from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.parallel.terms.rank import ring_share
from moetron.plan import cost_model
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.measure import random_corpus
from moetron.plan.search import search
from moetron.validate import output_problems, validate

REPO = Path(__file__).resolve().parents[2]
TINY_MOE = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "vocab_size": 512,
    "num_experts": 4,
    "expert_interval": 2,
    "topk": 2,
    "micro_batch_size": 2,
    "global_batch_size": 16,
    "train_iters": 10,
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """A tiny MoE on a real (random-token) corpus, so `validate` has nothing to say about its data."""
    directory = tmp_path_factory.mktemp("search")
    config = directory / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY_MOE, "data_path": [random_corpus(directory, 512, 1 << 14)]}))
    return config


def flag_overrides(flags: list[str]) -> dict:
    """Flags parsed exactly as `moetron train` parses them."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return cli_overrides(parser.parse_args(flags))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("gpus", [1, 4])
def test_every_layout_the_search_proposes_validates(tiny_config, gpus):
    cfg, _ = load_config(str(tiny_config), {})
    device = accelerator("cpu", "4GB")
    # checkpointing fixed (off) to keep the row-by-row validation short: the schedules multiply the rows
    result = search(cfg, gpus, device, cost_model.network(gpus, None, "cpu"), fixed={"ckpt": False})
    assert result.rows, result.refusals
    kinds = set()
    for row in result.rows:
        applied, _ = load_config(str(tiny_config), flag_overrides(row.flags))
        assert validate(applied, gpus) == [], row.flags  # the config file + the row's flags, as `moetron train` sees
        d = row.plan.dims
        kinds |= {k for k, on in (("tp", d.tp > 1), ("pp", d.pp > 1), ("ep", d.ep > 1), ("zero", row.layout.zero))
                  if on}  # fmt: skip
    if gpus >= 4:
        assert kinds == {"tp", "pp", "ep", "zero"}  # the search reaches every dimension


def test_recipe_layouts_validate_apart_from_the_example_data_paths():
    config = str(REPO / "configs" / "seed-2x4090-moe128.yaml")
    cfg, _ = load_config(config, {})
    result = search(cfg, 2, accelerator("4090"), cost_model.network(2, None, "4090"))
    ignored = set(cfg.data.problems()) | set(output_problems(cfg))  # the recipe's example corpus and run paths
    for row in result.rows:
        applied, _ = load_config(config, flag_overrides(row.flags))
        assert [p for p in validate(applied, 2) if p not in ignored] == [], row.flags
    assert all(r.plan.fits for r in result.rows)
    assert [r.cost.total for r in result.rows] == sorted(r.cost.total for r in result.rows)


def test_ring_and_bubble_terms():
    assert ring_share(1) == 0 and ring_share(4) == 0.75  # (n-1)/n
    cfg, _ = load_config(str(REPO / "configs" / "seed-2x4090-moe128.yaml"), {"moe_expert_parallel_size": 1})
    device = accelerator("4090")
    net = cost_model.network(2, None, "4090")
    base = cost_model.step_cost(make_plan(cfg, 2, device), net)
    assert base.part("ep") == 0 and base.part("tp") == 0 and base.part("pp") == 0 and base.bubble == 0
    cfg.parallel.moe_expert_parallel_size = 2
    assert cost_model.step_cost(make_plan(cfg, 2, device), net).part("ep") > 0
    cfg.parallel.moe_expert_parallel_size, cfg.parallel.pipeline_model_parallel_size = 1, 2
    piped = make_plan(cfg, 2, device)  # 1F1B, p = 2 stages, m = 16 / 4 = 4 micro-batches → (p-1)/(m+p-1) = 1/5
    cost = cost_model.step_cost(piped, net)
    assert piped.bubble == pytest.approx(1 / 5) and cost.bubble == pytest.approx(cost.compute / 4)


def test_the_gradient_reduction_of_a_pipelined_rank_is_its_tensor_parallel_share():
    cfg, _ = load_config("gpt-6.7B", {"pipeline_model_parallel_size": 8, "tensor_model_parallel_size": 2})
    plan = make_plan(cfg, 64, accelerator("A100-80GB"))
    reduced = cost_model._rank_parameters(plan)  # what the dp term reduces: the heaviest stage GPU's parameters
    assert 4 * reduced.total == pytest.approx(max(s.memory.weights for s in plan.stages), rel=1e-6)


@pytest.mark.parametrize(
    "recipe, fixed",
    [
        ("gpt-6.7B", ["--micro-batch-size", "1", "--checkpoint-activations", "--sequence-parallel"]),
        ("gpt-1.3B-moe128", ["--micro-batch-size", "1", "--checkpoint-activations", "--moe-expert-parallel-size", "8"]),
    ],
)
def test_the_seed_recipes_on_64_gpus_offer_zero_with_tensor_and_pipeline_parallelism(recipe, fixed, capsys):
    """Issue 22: `plan --search` on 64 × 80 GB lists ZeRO × TP × PP rows (micro batch, checkpointing and, for the MoE,
    EP fixed only to keep the test short), each one a command `moetron train` accepts, and the top row fits."""
    argv = ["plan", "--config", recipe, "--gpus", "64", "--gpu-type", "A100-80GB", "--search", "--json"]
    assert main([*argv, "--top", "400", *fixed]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    products = [r for r in rows if r["layout"]["zero"] >= 1 and r["layout"]["tp"] > 1 and r["layout"]["pp"] > 1]
    assert products, [r["words"] for r in rows]
    assert rows[0]["needed_bytes"] <= accelerator("A100-80GB").memory_bytes
    cfg, _ = load_config(recipe, {})
    ignored = set(cfg.data.problems()) | set(output_problems(cfg))  # the recipe's example corpus and run paths
    for row in (rows[0], products[0]):
        applied, _ = load_config(recipe, flag_overrides(row["flags"]))
        assert [p for p in validate(applied, 64) if p not in ignored] == [], row["flags"]


def test_data_parallel_groups_across_nodes_use_the_inter_node_link():
    net = cost_model.network(16, 2, "A100-80GB")
    assert net.gpus_per_node == 8
    assert net.link(8) is cost_model.INTERCONNECTS["nvlink3"] and net.link(16) is cost_model.INTERCONNECTS["ib-hdr"]
    custom = cost_model.network(16, 2, "A100-80GB", "nvlink4,ib-ndr", inter_gbps=10)
    assert custom.intra.gbps == 450 and custom.inter.gbps == 10


def test_cli_table_json_top_and_fixed_flags(tiny_config, capsys):
    common = ["--config", str(tiny_config), "--gpus", "4", "--gpu-type", "cpu", "--gpu-memory", "4GB", "--search"]
    code, out, _ = run_cli(capsys, *common, "--top", "2")
    assert code == 0
    assert "moetron plan --search" in out and out.count("torchrun --nproc-per-node 4 -m moetron train") == 2
    code, out, _ = run_cli(capsys, *common, "--top", "50", "--json", "--tensor-model-parallel-size", "1")
    report = json.loads(out)
    assert code == 0 and 0 < len(report["rows"]) <= 50
    assert all(row["layout"]["tp"] == 1 for row in report["rows"])  # a flag fixes its dimension
    parts = report["rows"][0]["step_parts_s"]
    assert report["rows"][0]["step_time_s"] == pytest.approx(sum(parts.values()))


def test_no_layout_for_seven_gpus_is_one_clear_line(tiny_config, capsys):
    code, _, err = run_cli(capsys, "--config", str(tiny_config), "--gpus", "7", "--gpu-type", "cpu",
                           "--gpu-memory", "4GB", "--search")  # fmt: skip
    assert code == 2  # an error of the flags, not "does not fit" (1)
    assert err.startswith("error: --gpus 7: none of the") and "accepts" in err and len(err.strip().splitlines()) == 1


def test_fixed_flags_that_cannot_combine_are_an_error(tiny_config, capsys):
    code, _, err = run_cli(capsys, "--config", str(tiny_config), "--gpus", "4", "--gpu-type", "cpu",
                           "--gpu-memory", "4GB", "--search", "--tensor-model-parallel-size", "3")  # fmt: skip
    assert code == 2 and err.startswith("error: --gpus 4: ") and len(err.strip().splitlines()) == 1


def test_nothing_fits_says_so(tiny_config, capsys):
    code, _, err = run_cli(capsys, "--config", str(tiny_config), "--gpus", "2", "--gpu-type", "cpu",
                           "--gpu-memory", "1MB", "--search")  # fmt: skip
    assert code == 1 and "valid layouts fits 0.000977 GiB per GPU" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--top", "0"], "--top 0"),
        (["--interconnect", "smoke-signals"], "--interconnect 'smoke-signals'"),
        (["--nodes", "3"], "--nodes 3"),
        (["--efficiency", "2"], "--efficiency"),
        (["--intra-node-bandwidth", "-1"], "--intra-node-bandwidth -1"),
    ],
)
def test_bad_search_flags_are_one_line(tiny_config, capsys, flags, named):
    code, _, err = run_cli(capsys, "--config", str(tiny_config), "--gpus", "4", "--gpu-type", "cpu",
                           "--gpu-memory", "4GB", "--search", *flags)  # fmt: skip
    assert code == 2 and err.startswith("error: ") and named in err and "Traceback" not in err


def test_a_failing_measured_run_is_reported_in_its_row(tiny_config, tmp_path):
    from moetron.plan.measure import measure_rows

    cfg, _ = load_config(str(tiny_config), {})
    rows = search(cfg, 1, accelerator("cpu", "4GB"), cost_model.network(1, None, "cpu")).rows[:1]
    measured = measure_rows(rows, str(tmp_path / "missing.yaml"), 1, steps=3, timeout=300)
    assert measured[0].measured.error.startswith("error: --config") and "no such file" in measured[0].measured.error


def test_measure_needs_one_node(tiny_config, capsys):
    code, _, err = run_cli(capsys, "--config", str(tiny_config), "--gpus", "16", "--gpu-type", "cpu",
                           "--gpu-memory", "4GB", "--search", "--measure")  # fmt: skip
    assert code == 2 and "--measure runs the layouts on this machine" in err


def test_the_table_shows_measurements_beside_the_predictions(tiny_config):
    from moetron.plan.measure import Measurement
    from moetron.plan.search_report import format_search

    cfg, _ = load_config(str(tiny_config), {})
    net = cost_model.network(2, None, "cpu")
    result = search(cfg, 2, accelerator("cpu", "4GB"), net)
    rows = result.rows[:2]
    rows[0].measured = Measurement(step_time_s=0.25, peak_bytes=3 * 2**20, rank=1)
    rows[1].measured = Measurement(error="error: --config x.yaml: no such file")
    text = format_search(result, rows, "tiny.yaml", 2, 1, net, 0.5)
    assert "meas GiB" in text and "# = predicted rank" in text
    assert "     250     n/a    1" in text.splitlines()[4]  # measured ms, CPU ms and rank of the first row
    assert "   2 measuring failed: error: --config x.yaml: no such file" in text
