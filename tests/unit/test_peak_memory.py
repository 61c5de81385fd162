"""Peak memory in the log: measured per log interval beside the plan's prediction; allocator snapshots on CUDA only."""

import json

import pytest
import torch
from trainer_support import build_trainer, tiny_config

from moetron.plan.memory import estimate_memory, planned_peak_bytes
from moetron.process_memory import peak_rss_bytes
from moetron.train.metrics import METRIC_KEYS, console_line
from moetron.train.peak_memory import GIB, MemorySnapshots, peak_memory, planned_line
from moetron.validate import validate


def test_metrics_carry_the_peak_and_the_plans_prediction(tmp_path, capsys):
    cfg = tiny_config(train_iters=4, log_interval=2, output_dir=str(tmp_path), memory_snapshot_steps=[2])
    trainer = build_trainer(cfg)
    trainer.planned_memory_bytes = 3 * GIB
    assert trainer.train() == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(tuple(m) == METRIC_KEYS for m in metrics)
    rss_now = peak_rss_bytes() / GIB
    for m in metrics:  # CPU: the process's peak RSS so far (it never falls), no reserved figure
        assert 0 < m["peak_memory_gib"] <= rss_now and m["reserved_memory_gib"] is None
        assert m["planned_memory_gib"] == 3.0
    assert metrics[0]["peak_memory_gib"] <= metrics[1]["peak_memory_gib"]
    out = capsys.readouterr().out
    assert f"mem {metrics[1]['peak_memory_gib']:.2f} GiB RSS (plan 3.00)" in out
    assert "--memory-snapshot-steps skipped on cpu" in out and not (tmp_path / "memory_snapshots").exists()


def test_cpu_line_shows_the_startup_baseline_beside_the_plan():
    m = {"peak_memory_gib": 0.52, "reserved_memory_gib": None, "planned_memory_gib": 0.16, "baseline_memory_gib": 0.36}
    record = {"iteration": 1, "consumed_tokens": 8, "lm_loss": 1.0, "moe_loss": 0.0, "lr": 1e-3, "grad_norm": 1.0}
    record |= {"tokens_per_sec": 1.0, "tflops": 0.0, "mfu": None, "expert_load_max_over_mean": [], "skipped_steps": 0}
    assert "| mem 0.52 GiB RSS (plan 0.16 + 0.36 at start) |" in console_line({**record, **m}, 10, 0.0)
    assert "includes the 0.36 GiB the process held before the model, which the plan" in planned_line(
        GIB, "cpu", 0.36 * GIB
    )


def test_cuda_line_shows_allocated_reserved_and_plan():
    m = {"peak_memory_gib": 1.234, "reserved_memory_gib": 1.5, "planned_memory_gib": 1.1}
    record = {"iteration": 1, "consumed_tokens": 8, "lm_loss": 1.0, "moe_loss": 0.0, "lr": 1e-3, "grad_norm": 1.0}
    record |= {"tokens_per_sec": 1.0, "tflops": 0.0, "mfu": None, "expert_load_max_over_mean": [], "skipped_steps": 0}
    assert "| mem 1.23 GiB (reserved 1.50, plan 1.10) |" in console_line({**record, **m}, 10, 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator counters and snapshots are CUDA's")
def test_cuda_peak_and_snapshot(tmp_path):
    device = torch.device("cuda")
    snapshots = MemorySnapshots([1], device, str(tmp_path), rank=0)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    assert peak_memory(device)["peak_memory_gib"] >= 64 / 1024
    path = snapshots.after_step(1)
    assert path.stat().st_size > 0 and snapshots.after_step(2) is None
    del x


def test_the_banner_gives_the_plans_estimate_for_this_layout():
    cfg = tiny_config()
    planned = planned_peak_bytes(cfg, 1, "cpu")
    assert planned == estimate_memory(cfg, cfg.dims(1), "cpu").peak
    assert f"plan predicts {planned / GIB:.2f} GiB peak per device" in planned_line(planned, "cpu")
    assert "no plan estimate" in planned_line(None, "cuda")


def test_snapshot_steps_need_a_run_directory_and_positive_steps():
    problems = "\n".join(validate(tiny_config(memory_snapshot_steps=[0, 5]), 1))
    assert "--memory-snapshot-steps 0 is not a positive iteration" in problems
    assert "add --save DIR or --output-dir DIR" in problems
