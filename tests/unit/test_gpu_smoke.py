"""benchmarks/gpu_smoke.py: without CUDA it skips with one line; its whole flow (bf16 run, timing, the loss check
against CPU fp32) runs on CPU with a tiny model of the same family."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_skips_cleanly_without_cuda(capsys, monkeypatch):
    monkeypatch.syspath_prepend(REPO / "benchmarks")  # the benchmark under test, not a helper
    import gpu_smoke

    monkeypatch.setattr(gpu_smoke.torch.cuda, "is_available", lambda: False)  # also on a machine with a GPU
    assert gpu_smoke.main([]) == 0
    out = capsys.readouterr().out
    assert out.strip().startswith("gpu_smoke: skipped — no CUDA device")
    assert len(out.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_flow_runs_on_cpu_with_a_tiny_model(capsys, monkeypatch):
    monkeypatch.syspath_prepend(REPO / "benchmarks")  # the benchmark under test, not a helper
    import gpu_smoke

    argv = ["--device", "cpu", "--tiny", "--no-compile", "--warmup", "1", "--steps", "1", "--check-steps", "2"]
    assert gpu_smoke.main(argv) == 0
    out = capsys.readouterr().out
    assert "bf16=True" in out and "tokens/s" in out
    assert re.search(r"peak memory \d+\.\d+ GiB \(peak RSS.*\); plan \d+\.\d+ GiB; measured / plan \d", out)
    worst = float(re.search(r"max relative difference (\S+)", out).group(1))
    assert worst < 1e-2  # bf16 against fp32, same weights and batches


def test_the_qwen3_slice_is_the_most_layers_the_plan_fits_at_the_real_shape(monkeypatch):
    """Planned at the real Qwen3-30B-A3B shape on a 139 GiB H200, nothing allocated: the slice keeps the recipe's
    widths and routing and is cut to the largest layer count within the headroom (one more would not fit)."""
    monkeypatch.syspath_prepend(REPO / "benchmarks")
    import gpu_smoke

    args = gpu_smoke.parse_args(["--dry-run"])  # --gpu-memory 139GiB: an H200's
    memory = 139 * 2**30
    lines, status = gpu_smoke.dry_run(args)
    assert status == 0
    layers = int(re.match(r"slice: (\d+) of 48 layers \(\1 MoE\)", lines[1]).group(1))
    cfg = gpu_smoke.slice_config(args, layers, "cuda", precise=False)
    full = gpu_smoke.load_config("qwen3-30B-A3B", {})[0].model
    assert 1 <= layers < full.num_layers and cfg.model.num_layers == layers
    shape = ("hidden_size", "num_attention_heads", "num_key_value_heads", "kv_channels", "num_experts", "topk")
    shape += ("moe_ffn_hidden_size", "vocab_size", "seq_length")
    assert {k: getattr(cfg.model, k) for k in shape} == {k: getattr(full, k) for k in shape}
    assert cfg.train.bf16 and cfg.model.moe_expert_backend == "grouped_mm"
    assert cfg.parallel.moe_expert_parallel_size == 1
    device = gpu_smoke.Accelerator("one GPU", memory, 1.0)
    assert gpu_smoke.planned_bytes(args, layers, device) <= gpu_smoke.HEADROOM * memory
    assert gpu_smoke.planned_bytes(args, layers + 1, device) > gpu_smoke.HEADROOM * memory
    assert 1 <= gpu_smoke.fitting_layers(args, 80 * 2**30)[0] < layers  # a smaller GPU holds fewer layers


def test_a_24_gb_gpu_gets_a_moe_slice_and_two_gpus_split_the_experts(monkeypatch):
    """A 4090 holds no Qwen3-30B-A3B layer: exit 1 naming what does fit; the seed recipe's slice fits with MoE
    layers; gpt-1.3B-moe128's slice (MoE every other layer) holds one; on 2 GPUs the experts are split over them."""
    monkeypatch.syspath_prepend(REPO / "benchmarks")
    import gpu_smoke

    lines, status = gpu_smoke.dry_run(gpu_smoke.parse_args(["--dry-run", "--gpu-memory", "24GB"]))
    assert status == 1 and "--recipe seed-2x4090-moe128" in lines[0] and "torchrun --nproc-per-node 2" in lines[0]
    for recipe, memory in (("seed-2x4090-moe128", "24GB"), ("gpt-1.3B-moe128", "139GiB")):
        args = gpu_smoke.parse_args(["--dry-run", "--gpu-memory", memory, "--recipe", recipe])
        lines, status = gpu_smoke.dry_run(args)
        moe = int(re.search(r"layers \((\d+) MoE\)", lines[1]).group(1))
        assert status == 0 and moe >= 1, lines
    args = gpu_smoke.parse_args(["--dry-run", "--gpu-memory", "24GB", "--recipe", "seed-2x4090-moe128", "--gpus", "2"])
    lines, status = gpu_smoke.dry_run(args)
    assert status == 0 and "experts split over 2 GPUs (torchrun --nproc-per-node 2)" in lines[1]
    cfg = gpu_smoke.slice_config(args, 2, "cuda", precise=False, gpus=2)
    assert cfg.parallel.moe_expert_parallel_size == 2 and cfg.train.global_batch_size == 2 * cfg.train.micro_batch_size
