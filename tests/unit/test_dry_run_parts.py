"""The dry run's parts that need no fake device and start no process: rank choice, the report and verdict, the
attention kernel choice, which ops read values for their shape, stand-ins, error lines, the shim's cache key."""

from __future__ import annotations

import argparse

import pytest
import torch

from moetron.cli import main as moetron_main
from moetron.commands.dry_run import chosen_ranks, error_line
from moetron.config import RunConfig
from moetron.dryrun import attention_kernels, patches, report, shim, stand_ins
from moetron.dryrun.observe import reads_values_for_shape, where
from moetron.dryrun.worker import error_record, root_cause
from moetron.errors import UserError

MIB = 1024**2
# part of the README's quick subset (tests/conftest.py QUICK_FILES): seconds, no process


def layout(pp: int = 1, tp: int = 1) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.pipeline_model_parallel_size, cfg.parallel.tensor_model_parallel_size = pp, tp
    return cfg


def test_default_ranks_are_one_per_pipeline_stage():
    assert chosen_ranks("heaviest", layout(), 8) == [0]
    assert chosen_ranks("heaviest", layout(pp=2), 8) == [0, 4]  # stages are the outermost dimension
    assert chosen_ranks("all", layout(), 4) == [0, 1, 2, 3]
    assert chosen_ranks("5, 1,5", layout(), 8) == [1, 5]


@pytest.mark.parametrize("text", ["8", "x", "-1", ""])
def test_bad_ranks_are_one_line_errors(text):
    with pytest.raises(UserError, match="--ranks"):
        chosen_ranks(text, layout(), 8)


def record(rank: int, peak: int, reads: dict[str, int], moe_reads: int = 0) -> dict:
    return {
        "rank": rank, "pp_stage": rank // 4, "peak_bytes": peak,
        "peak_by_category": {"parameters": peak // 2, "activations": peak // 2},
        "peak_at": {"module": "GPTModel.layers.1.mlp", "phase": "backward", "step": 2, "where": "?"},
        "host_reads": reads, "host_reads_per_step": sum(reads.values()), "moe_layer_reads_per_step": moe_reads,
        "local_moe_layers": 2, "micro_batches": 2,
        "collectives": [["c10d.alltoall_base_.default", "bfloat16", 4096, 8, "moetron/parallel/ep/all_to_all.py:64"]],
        "fp32_gemms": [["aten.mm.default", "moetron/model/moe/routing/router.py:87", 2]], "cpu_ops": [],
        "attention_kernels": {"flash": 4, "efficient": 0, "cudnn": 0, "math": 0},
        "build_seconds": 0.5, "step_seconds": [1.0, 0.5],
    }  # fmt: skip


def test_the_report_takes_the_heaviest_rank_and_the_most_reads():
    records = [record(0, 10 * MIB, {"a.py:1": 4, "b.py:2": 1}, 4), record(4, 30 * MIB, {"a.py:1": 2}, 2)]
    merged = report.merge(records, 8, planned=28 * MIB, memory=None, context=1024 * MIB)
    assert merged["peak_bytes"] == 30 * MIB and merged["planned_peak_bytes"] == 28 * MIB
    assert merged["peak_at"]["rank"] == 4
    assert merged["host_reads"] == [{"where": "a.py:1", "count": 4}, {"where": "b.py:2", "count": 1}]
    assert merged["host_reads_per_step"] == 5 and merged["host_reads_per_moe_layer"] == 1.0
    assert merged["collectives"][0]["count"] == 8 and merged["fits"] is None
    assert report.exit_status(merged) == report.EXIT_FITS
    text = report.format_report(merged, 1024 * MIB)
    assert "peak memory 30.00 MiB, plan 28.00 MiB (measured / plan 1.07)" in text
    assert "backward of GPTModel.layers.1.mlp" in text and "no fit verdict" in text


@pytest.mark.parametrize(("memory_mib", "status"), [(2048, report.EXIT_FITS), (1040, report.EXIT_DOES_NOT_FIT)])
def test_the_verdict_adds_the_cuda_context(memory_mib, status):
    merged = report.merge([record(0, 30 * MIB, {})], 1, None, memory=memory_mib * MIB, context=1024 * MIB)
    assert report.exit_status(merged) == status
    assert ("does NOT fit" in report.verdict(merged, 1024 * MIB)) == (status == report.EXIT_DOES_NOT_FIT)


def test_plan_dry_run_puts_each_group_of_the_plan_beside_the_measured_one():
    merged = report.merge([record(0, 30 * MIB, {"a.py:1": 1})], 8, planned=28 * MIB, memory=None, context=0)
    held = {"weights": 8 * MIB, "weight_casts": 4 * MIB, "gradients": 2 * MIB, "optimizer": 0, "activations": 14 * MIB}
    lines = report.format_beside_plan(held, merged).splitlines()
    assert lines[0] == "plan vs dry run (the real step on fake CUDA devices: rank(s) [0] of 8)"
    rows = {line[:32].strip(): line[32:].split("   (")[0].split() for line in lines[2:7]}
    assert rows["parameters (and their copies)"] == ["12.00", "MiB", "15.00", "MiB"]  # weights + casts; parameters
    assert rows["gradients"] == ["2.00", "MiB", "0", "B"]
    assert rows["activations and temporaries"] == ["14.00", "MiB", "15.00", "MiB"]
    assert rows["peak"] == ["28.00", "MiB", "30.00", "MiB"] and "(dry run / plan 1.07)" in lines[6]
    assert "1 host read(s)" in lines[-1] and "attention kernels flash 4" in lines[-1]


def qkv(heads: int = 8, kv_heads: int = 8, head: int = 64, v_head: int = 64, dtype=torch.bfloat16, keys: int = 128):
    def make(h, d, t):
        return torch.empty(2, h, t, d, dtype=dtype, device="meta")

    return make(heads, head, 128), make(kv_heads, head, keys), make(kv_heads, v_head, keys)


def test_attention_takes_flash_where_pytorch_would():
    assert attention_kernels.choose(*qkv(), None, True) == "flash"
    assert attention_kernels.choose(*qkv(kv_heads=2), None, True) == "flash"  # grouped-query attention
    mask = torch.empty(128, 128, dtype=torch.bool, device="meta")
    assert attention_kernels.choose(*qkv(), mask, False) == "efficient"  # a mask: not flash
    assert attention_kernels.choose(*qkv(v_head=128), None, True) == "efficient"  # MLA: v head ≠ qk head
    assert attention_kernels.choose(*qkv(dtype=torch.float32), None, True) == "efficient"
    assert attention_kernels.choose(*qkv(head=60, v_head=60), None, True) == "math"  # not a multiple of 8
    assert attention_kernels.choose(*qkv(keys=64), None, True) == "efficient"  # causal, non-square


def test_which_ops_read_values_to_know_their_shape():
    x, ints, mask = torch.zeros(4, 3), torch.tensor([0, 2]), torch.tensor([True, False, True, False])
    aten = torch.ops.aten
    assert reads_values_for_shape(aten.nonzero.default, (x,), {})
    assert reads_values_for_shape(aten.index.Tensor, (x, [mask]), {})
    assert not reads_values_for_shape(aten.index.Tensor, (x, [ints]), {})
    assert not reads_values_for_shape(aten.index_put_.default, (x, [mask], torch.tensor(0.0)), {})  # masked_fill
    assert reads_values_for_shape(aten.index_put_.default, (x, [mask], torch.zeros(2, 3)), {})
    assert not reads_values_for_shape(aten.repeat_interleave.Tensor, (ints,), {"output_size": 2})
    assert reads_values_for_shape(aten.repeat_interleave.Tensor, (ints,), {})
    assert not reads_values_for_shape(aten.mm.default, (x, x.T), {})


def test_stand_ins_are_neutral_and_splits_are_balanced():
    import sys

    frame = sys._getframe()
    assert stand_ins.value_for(torch.tensor(True), frame) is False
    assert stand_ins.value_for(torch.tensor(3), frame) == 0
    assert stand_ins.value_for(torch.tensor(3.0), frame) == 0.0
    stand_ins.use_routing({})
    stand_ins.note_routes(routes=256, ep_size=4, ep_rank=1)
    assert [stand_ins.exchange_split(frame, element) for element in range(8)] == [64] * 8


def test_where_names_the_first_frame_outside_torch():
    import sys

    line = sys._getframe().f_lineno + 1
    assert where().endswith(f"test_dry_run_parts.py:{line}")


def test_an_op_error_is_one_line_naming_the_op_and_where():
    inner = RuntimeError("Expected mat_a to be bf16\nlong C++ context")
    inner.dryrun_op, inner.dryrun_where = "aten._grouped_mm.default", "moetron/model/moe/experts/backends.py:88"
    try:
        try:
            raise inner
        except RuntimeError as err:
            raise RuntimeError("[Stage 0] failed to run forward:") from err
    except RuntimeError as outer:
        assert root_cause(outer) is inner
        line = error_record(outer)
    assert line == {
        "error": "RuntimeError: Expected mat_a to be bf16",
        "op": "aten._grouped_mm.default",
        "where": "moetron/model/moe/experts/backends.py:88",
    }


def test_a_patch_fails_loudly_when_torch_moved_what_it_replaces():
    with pytest.raises(AssertionError, match="has no .*no_such_function") as raised:
        patches._require(torch.cuda, "no_such_function")
    line = error_line(3, error_record(raised.value))
    assert line.startswith("dry-run: rank 3: dry run: torch ") and "patches.py must be updated" in line


def test_a_defect_line_names_the_op_and_where():
    record = {
        "error": "GPUPathDefect: aten.add.Tensor mixes a CPU tensor [64]",
        "op": "aten.add.Tensor",
        "where": "a.py:3",
    }
    assert error_line(0, record) == (
        "dry-run: rank 0: GPU-path defect in aten.add.Tensor at a.py:3: GPUPathDefect: aten.add.Tensor mixes a CPU "
        "tensor [64]"
    )


def test_the_shim_is_cached_per_torch_version():
    assert shim.library_name("2.13.0+cpu", 1) != shim.library_name("2.14.0+cpu", 1)
    assert shim.library_name("2.13.0+cpu", 1).endswith(".so")


def test_config_errors_exit_2_before_any_process(capsys):
    status = moetron_main(["dry-run", "--config", "gpt-1.3B-moe128", "--gpus", "3", "--num-layers", "2"])
    assert status == 2
    assert "error:" in capsys.readouterr().err


def test_the_command_parses_train_flags():
    from moetron.commands import dry_run

    parser = argparse.ArgumentParser()
    dry_run.add_arguments(parser)
    args = parser.parse_args(["--config", "x.yaml", "--gpus", "8", "--num-layers", "4", "--ranks", "all"])
    assert (args.gpus, args.ranks, args.steps, args.num_layers) == (8, "all", 2, 4)


def test_to_empty_replaces_parameters_and_keeps_ties(monkeypatch):
    """The patch that stands in for `Module.to_empty` on fake tensors, checked on real ones: new Parameters on the
    device, shapes and requires_grad kept, a tied weight still one Parameter."""
    monkeypatch.setattr(torch.nn.Module, "to_empty", torch.nn.Module.to_empty)  # restored after the test
    patches.patch_to_empty()
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
        model.register_buffer("scale", torch.ones(3))
    model[1].weight = model[0].weight
    model.to_empty(device="cpu")
    assert model[0].weight is model[1].weight and model[0].weight.device.type == "cpu"
    assert model[0].weight.shape == (8, 4) and model[0].weight.requires_grad
    assert model.scale.device.type == "cpu" and model.scale.shape == (3,)


def test_measured_routing_sizes_the_splits_of_the_hottest_rank():
    routes_E = [40, 40, 10, 10, 10, 10, 5, 5]  # 8 experts over 4 EP ranks: rank 0 owns the hot pair
    assert stand_ins.rank_shares(routes_E, 4) == [80 / 130, 20 / 130, 20 / 130, 10 / 130]
    sent, received = stand_ins.split_sizes(130, 4, 0, routes_E)[:4], stand_ins.split_sizes(130, 4, 0, routes_E)[4:]
    assert sent == [80, 20, 20, 10] and received == [80, 80, 80, 80]  # every peer routes like this rank
    assert stand_ins.split_sizes(128, 4, 2, None) == [32] * 8  # balanced without a measurement


def test_the_hottest_ep_rank_is_chosen_by_default():
    from moetron.commands.dry_run import hottest_ep_rank

    cfg = layout()
    cfg.model.num_experts, cfg.parallel.moe_expert_parallel_size = [8], 4
    routing = {1: [5, 5, 10, 10, 40, 40, 10, 10], 3: [5, 5, 10, 10, 30, 30, 10, 10]}
    assert hottest_ep_rank(routing, cfg, 8) == 2
    assert chosen_ranks("heaviest", cfg, 8, hot_ep_rank=2) == [2]  # ep is the fastest-varying expert coordinate


def test_the_math_kernel_gets_torchs_keyword_only_arguments(monkeypatch):
    """Where a GPU would take the math kernel (fp32 with GQA: flash needs 16-bit, the efficient kernel no GQA) or the
    tensors are not cuda, torch's own SDPA runs, with `scale` and `enable_gqa` passed as the keywords they are."""
    import torch.nn.functional as F

    monkeypatch.setattr(attention_kernels, "MATH_FALLBACK", F.scaled_dot_product_attention)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    out = attention_kernels.scaled_dot_product_attention(q, k, v, None, 0.0, True, 0.5, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)
    assert torch.equal(out, want)
