"""Pipeline layouts written out by hand, and every pipeline flag problem reported before anything starts."""

from __future__ import annotations

import argparse

import pytest
import torch

from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.model.config import ModelConfig
from moetron.parallel.dims import ParallelDims
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.pp.split import StageModule, split_for_pipeline
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.validate import validate


def test_even_interleaved_and_uneven_layouts():
    even = PipelineLayout.build(8, pp=2)
    assert even.stage_layers == ((0, 1, 2, 3), (4, 5, 6, 7)) and even.schedule == "1f1b"
    assert even.stages_of(1) == (1,) and even.holds_first(0) and even.holds_last(1)

    # Megatron's interleaving: v = 8 / (2 · 2) = 2 virtual stages per rank; stage s on rank s mod pp
    inter = PipelineLayout.build(8, pp=2, virtual_layers=2)
    assert inter.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7)) and inter.schedule == "interleaved-1f1b"
    assert inter.stages_of(0) == (0, 2) and inter.layers_of(1) == (2, 3, 6, 7) and inter.holds_last(1)

    # uneven: the ends hold the embedding and the head, so they get fewer layers; the middle shares the rest
    uneven = PipelineLayout.build(10, pp=4, first_layers=1, last_layers=3)
    assert [len(s) for s in uneven.stage_layers] == [1, 3, 3, 3]
    assert [len(s) for s in PipelineLayout.build(7, pp=3, first_layers=1).stage_layers] == [1, 3, 3]
    assert [len(s) for s in PipelineLayout.build(4, pp=2, first_layers=0, last_layers=4).stage_layers] == [0, 4]
    zb = PipelineLayout.build(4, pp=2, schedule="zero-bubble", virtual_layers=1)
    assert zb.num_stages == 4 and zb.stages_of(1) == (1, 3)


def problems(*flags: str, world: int = 2) -> str:
    """validate()'s problems for these flags (all but the missing data, which these tests do not give)."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg, _ = load_config(None, cli_overrides(parser.parse_args(["--train-iters", "1", *flags])))
    return "\n".join(p for p in validate(cfg, world) if "no data given" not in p)


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--num-layers", "3"], "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
        (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "3"], "is not divisible by"),
        (["--num-layers", "8", "--pipeline-schedule", "1f1b", "--num-layers-per-virtual-pipeline-stage", "2"],
         "runs one stage per rank"),
        (["--num-layers", "8", "--pipeline-schedule", "pipedream"], "--pipeline-schedule 'pipedream' is not one of"),
        (["--num-layers", "8", "--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers", "2"],
         "leave 1 of --num-layers 8 for no other stage"),
        (["--num-layers", "8", "--global-batch-size", "4", "--micro-batch-size", "4"],
         "--pipeline-schedule 1f1b needs at least 2 micro-batches"),
        (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2", "--decoder-first-pipeline-num-layers",
          "2"], "cannot be combined"),
    ],
)  # fmt: skip
def test_pipeline_flag_problems(flags, fragment):
    assert fragment in problems("--pipeline-model-parallel-size", "2", "--global-batch-size", "8", *flags)


def test_good_pipeline_flags_and_pp1():
    assert problems("--pipeline-model-parallel-size", "2", "--num-layers", "8", "--global-batch-size", "8") == ""
    zero_bubble = ["--pipeline-schedule", "zero-bubble", "--compile"]  # every schedule composes with --compile
    assert (
        problems("--pipeline-model-parallel-size", "2", "--num-layers", "8", "--global-batch-size", "8", *zero_bubble)
        == ""
    )
    flags = ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"]
    assert (
        "--num-layers-per-virtual-pipeline-stage 2 split pipeline stages, but --pipeline-model-parallel-size is 1;"
        in (problems(*flags, world=1))
    )
    assert problems("--num-layers", "8", world=1) == ""


def test_split_keeps_global_names_and_the_ends():
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=96, seq_length=8)
    layout = PipelineLayout.build(4, pp=2, virtual_layers=1)
    names = {}
    for pp_rank in (0, 1):
        with torch.device("meta"):
            from moetron.model.gpt import GPTModel

            model = GPTModel(cfg)
        dims = ParallelDims(world_size=2, dp=1, pp=2)
        split_for_pipeline(model, ParallelMesh(dims, dims.coordinates(pp_rank)), layout)
        names[pp_rank] = {n for n, _ in model.named_parameters()}
        stages = [StageModule(model, layout.stage_layers[s], s == 0, s == 3) for s in layout.stages_of(pp_rank)]
        assert {n for s in stages for n, _ in s.named_parameters()} <= names[pp_rank]  # the model's own names
    assert {n.split(".")[1] for n in names[0] if n.startswith("layers.")} == {"0", "2"}
    assert {n.split(".")[1] for n in names[1] if n.startswith("layers.")} == {"1", "3"}
    assert "position_embeddings.weight" in names[0] and "position_embeddings.weight" not in names[1]
    assert "word_embeddings.weight" in names[0] and "word_embeddings.weight" in names[1]  # tied: both ends
    assert "final_layernorm.weight" in names[1] and "final_layernorm.weight" not in names[0]


def test_megatron_pipeline_flags_reach_the_layout():
    """Megatron's flag names parse into the config, and the layout is built from them."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = ["--num-layers", "6", "--pipeline-model-parallel-size", "3", "--pipeline-schedule", "gpipe"]
    flags += ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2"]
    cfg, _ = load_config(None, cli_overrides(parser.parse_args(flags)))
    p = cfg.parallel
    assert (p.pipeline_model_parallel_size, p.pipeline_schedule) == (3, "gpipe")
    assert (p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers) == (1, 2)
    layout = PipelineLayout.from_config(cfg.model.num_layers, p)
    assert layout.stage_layers == ((0,), (1, 2, 3), (4, 5)) and layout.schedule == "gpipe"
    cfg, _ = load_config(None, cli_overrides(parser.parse_args(["--num-layers-per-virtual-pipeline-stage", "1"])))
    assert cfg.parallel.num_layers_per_virtual_pipeline_stage == 1
