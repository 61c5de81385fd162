"""The startup banner's layout line names sequence parallelism (where it acts) and the ZeRO stage that will run."""

from __future__ import annotations

from moetron.config_cli import load_config
from moetron.train.startup import startup_banner


def layout_line(overrides: dict, world_size: int) -> str:
    cfg, explicit = load_config("quickstart", {"train_iters": 10} | overrides)
    return next(line for line in startup_banner(cfg, world_size, "cuda", explicit).splitlines() if "layout" in line)


def test_sequence_parallel_and_the_zero_stage_are_shown():
    line = layout_line({"tensor_model_parallel_size": 2, "sequence_parallel": True, "moe_expert_parallel_size": 1}, 2)
    assert "tensor parallel 2 + sequence parallel, pipeline parallel 1" in line and line.endswith("ZeRO stage 0")
    line = layout_line({"zero_stage": 2}, 2)
    assert line.endswith("ZeRO stage 2") and "sequence" not in line and "None" not in line
    assert layout_line({"use_distributed_optimizer": True}, 2).endswith("ZeRO stage 1")  # Megatron's flag: stage 1
    assert "sequence" not in layout_line({"sequence_parallel": True}, 2)  # ignored at TP 1


def test_the_banner_names_the_peak_mfu_is_measured_against():
    cfg, explicit = load_config("quickstart", {"train_iters": 10})
    mfu = next(line for line in startup_banner(cfg, 1, "cpu", explicit).splitlines() if line.startswith("MFU"))
    assert "a nominal fp32 peak of a 2-core CPU (not this machine's: --peak-tflops sets it)" in mfu
    cfg, explicit = load_config("quickstart", {"train_iters": 10, "peak_tflops": 12.5})
    assert "MFU        against 12.5 TFLOP/s per device (--peak-tflops)" in startup_banner(cfg, 1, "cpu", explicit)
