"""`moetron plan`: the memory model's parts, the advice, the report and the command line.

The activation counts are checked against what autograd really saves: `saved_tensors_hooks` see every
tensor kept for backward; parameters are left out (they are counted as weights), and layers are isolated
by the difference between a 4-layer and a 2-layer model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from data_helpers import make_tiny_tokenizer, tiny_tokenizer_flags
from saved_tensors import saved_tensor_bytes

from moetron.cli import main
from moetron.config import RunConfig
from moetron.config_cli import load_config
from moetron.errors import UserError
from moetron.model.flops import PEAK_TFLOPS, flops_per_token
from moetron.model.gpt import create_model
from moetron.plan.advice import largest_micro_batch, suggestions
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import GIB, accelerator, parse_memory
from moetron.plan.memory import estimate_memory, layer_bytes, local_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SEED = str(CONFIGS / "seed-2x4090-moe128.yaml")


def small(**model) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, 64
    m.vocab_size, m.make_vocab_size_divisible_by = 256, 128
    for key, value in model.items():
        setattr(m, key, value)
    cfg.train.micro_batch_size, cfg.train.train_iters = 2, 10
    return cfg


def saved_bytes(cfg: RunConfig, dtype: torch.dtype | None) -> int:
    """Bytes of the non-parameter tensors autograd saves in one training forward (each storage once)."""
    torch.manual_seed(0)
    model = create_model(cfg.model)
    model.train()
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length))
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return saved_tensor_bytes(model, lambda: model(tokens, labels_BT=tokens))


@pytest.mark.parametrize(
    "model, bf16",
    [
        ({}, False),
        ({"attention_dropout": 0.0}, False),
        ({"num_experts": [8], "expert_interval": 1}, False),
        ({"num_experts": [8], "expert_interval": 1, "topk": 2}, False),
        ({"num_experts": [8], "expert_interval": 1, "mlp_type": "residual"}, False),
        ({"attention_dropout": 0.0}, True),
    ],
)
def test_layer_activations_match_what_autograd_saves(model, bf16):
    configs = [small(**model, num_layers=n) for n in (2, 4)]
    for cfg in configs:
        cfg.train.bf16 = bf16
    dtype = torch.bfloat16 if bf16 else None
    measured = (saved_bytes(configs[1], dtype) - saved_bytes(configs[0], dtype)) / 2
    cfg = configs[0]
    m, c = cfg.model, 2 if bf16 else 4
    tokens = cfg.train.micro_batch_size * m.seq_length
    planned = layer_bytes(m, m.experts_per_layer()[-1], tokens, m.seq_length, c, "cpu", ep=1)
    if bf16:  # autocast's bf16 weight copies are saved too; the plan counts them as weight casts
        planned += 2 * 12 * m.hidden_size**2
    assert planned == pytest.approx(measured, rel=0.15)


def test_expert_parallel_splits_only_the_experts():
    cfg = small(num_experts=[8], expert_interval=1)
    one, four = (local_parameters(cfg.model, dataclasses.replace(cfg.dims(4), ep=ep)) for ep in (1, 4))
    assert four.experts * 4 == one.experts
    assert one.total - one.experts == four.total - four.experts  # dense parts are replicated
    assert four.replicated == four.total - four.experts and one.replicated == one.total


def test_memory_parts_follow_the_config():
    cfg = small(num_experts=[8], expert_interval=1, num_layers=6)
    cfg.train.fused_cross_entropy = False  # the materialised [T, V] logits (the fused path: test_plan_lm_head.py)
    base = estimate_memory(cfg, cfg.dims(1))
    params = local_parameters(cfg.model, cfg.dims(1)).total
    assert (base.weights, base.gradients, base.optimizer) == (4 * params, 4 * params, 8 * params)
    assert base.weight_casts == 0 and base.ddp_buckets == 0 and base.all_to_all == 0
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    assert base.logits == 16 * tokens * cfg.model.padded_vocab_size()  # the [T, V] loss buffers, not forgotten

    def variant(**changes):
        c = RunConfig(**{s: dataclasses.replace(getattr(cfg, s)) for s in RunConfig.SECTIONS})
        for key, value in changes.items():
            setattr(c.model if hasattr(c.model, key) else c.train, key, value)
        return estimate_memory(c, c.dims(1))

    assert variant(checkpoint_activations=True).activations < base.activations / 2
    half = variant(micro_batch_size=1)
    assert (half.logits, half.activations) == pytest.approx((base.logits / 2, base.activations / 2), rel=0.01)
    bf16 = variant(bf16=True)
    assert bf16.weight_casts > 0 and bf16.activations < base.activations
    acc = variant(global_batch_size=4)  # 2 micro-batches: the first one's gradients are alive in the second's backward
    assert acc.peak == acc.weights + acc.optimizer + acc.gradients + acc.activations + acc.logits
    assert acc.logits > base.logits  # ... and the trainer still holds the first one's logits


def test_data_and_expert_parallel_buffers():
    cfg = small(num_experts=[8], expert_interval=1)
    cfg.parallel.moe_expert_parallel_size = 2
    mem = estimate_memory(cfg, cfg.dims(2))
    local = local_parameters(cfg.model, cfg.dims(2))
    assert mem.ddp_buckets == 4 * local.replicated  # DDP reduces the dense parameters only
    assert mem.all_to_all > 0


def test_step_time_is_flops_over_assumed_throughput():
    cfg, _ = load_config(SEED, {})
    device = accelerator("4090")
    plan = make_plan(cfg, 2, device, mfu=0.5)
    tokens_per_gpu = 16 * 2048 / 2
    expected = tokens_per_gpu * flops_per_token(cfg.model) * 4 / 3 / (PEAK_TFLOPS["RTX 4090"] * 1e12 * 0.5)
    assert plan.step_time_s == pytest.approx(expected)
    assert make_plan(cfg, 2, device, mfu=0.25).step_time_s == pytest.approx(2 * expected)


def test_seed_2x4090_fits_two_4090s_and_advice_makes_a_small_gpu_fit():
    cfg, _ = load_config(SEED, {})
    assert make_plan(cfg, 2, accelerator("4090")).fits
    tight = make_plan(cfg, 2, accelerator("4090", "2.8GB"))
    assert not tight.fits
    fixes = suggestions(tight)
    assert fixes and all(s.plan.fits for s in fixes)
    # each suggestion, applied as the flags it prints, really fits
    for fix in fixes:
        flags = fix.flags.split()
        gpus = int(flags[flags.index("--gpus") + 1]) if "--gpus" in flags else 2
        overrides = _flags_to_overrides(
            [f for i, f in enumerate(flags) if "--gpus" not in flags[max(i - 1, 0) : i + 1]]
        )
        again, _ = load_config(SEED, overrides)
        assert make_plan(again, gpus, accelerator("4090", "2.8GB")).fits, fix.flags


def _flags_to_overrides(flags: list[str]) -> dict:
    out, i = {}, 0
    while i < len(flags):
        name = flags[i][2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[name] = int(flags[i + 1])
            i += 2
        else:
            out[name] = True
            i += 1
    return out


def test_headroom_is_the_largest_micro_batch_that_fits():
    cfg, _ = load_config(SEED, {"global_batch_size": 1024})
    device = accelerator("4090")
    larger = largest_micro_batch(make_plan(cfg, 2, device))
    mbs = larger.plan.cfg.train.micro_batch_size
    assert mbs > 4 and larger.plan.fits and larger.plan.cfg.global_batch(2) == 1024
    cfg.train.micro_batch_size = 2 * mbs
    assert not make_plan(cfg, 2, device).fits


def test_sharding_fixes_what_the_replicated_state_alone_cannot_fit():
    cfg, _ = load_config(str(CONFIGS / "gpt-6.7B.yaml"), {})
    plan = make_plan(cfg, 64, accelerator("A100-80GB"))
    flags = [s.flags for s in suggestions(plan)]
    assert not plan.fits and "--zero-stage 2" in flags and "--zero-stage 3" in flags
    one = make_plan(cfg, 1, accelerator("A100-80GB"))  # one GPU: nothing to shard over, no pipeline to split into
    fixes = [s.flags for s in suggestions(one)]
    assert not one.fits and len(fixes) == 1 and "--zero-stage 3" in fixes[0] and "--gpus 2" in fixes[0]


def test_tensor_parallelism_splits_the_dense_model_and_is_proposed():
    cfg, _ = load_config(str(CONFIGS / "gpt-6.7B.yaml"), {})
    cfg.train.fused_cross_entropy = False  # TP's vocab-parallel loss materialises [T, V / tp]: compare like with like
    plan = make_plan(cfg, 64, accelerator("A100-80GB"))
    assert not plan.fits
    fixes = [s for s in suggestions(plan) if "--tensor-model-parallel-size" in s.flags]  # next to ZeRO and PP
    assert fixes and all(s.plan.fits for s in fixes)
    tp8 = next(s.plan for s in fixes if "--tensor-model-parallel-size 8" in s.flags)
    assert tp8.dims.sp and tp8.cfg.global_batch(tp8.dims.dp) == plan.cfg.global_batch(plan.dims.dp)
    # the vocabulary, attention and MLP matrices are split; norms, biases of row-parallel layers, positions are not
    assert plan.local.total / 8 < tp8.local.total < plan.local.total / 8 * 1.01
    assert tp8.memory.logits == pytest.approx(plan.memory.logits / 8, rel=1e-6)
    # sequence parallelism divides what TP alone leaves whole (residual stream, norms, dropout masks)
    no_sp = copy.deepcopy(tp8.cfg)
    no_sp.parallel.sequence_parallel = False
    no_sp_plan = make_plan(no_sp, 64, accelerator("A100-80GB"))
    assert tp8.memory.activations < no_sp_plan.memory.activations < plan.memory.activations
    assert tp8.tp_comm_bytes > 0 and tp8.step_time_s == pytest.approx(plan.step_time_s)  # 64 GPUs either way


def test_memory_sizes_and_devices():
    assert parse_memory("24GB") == parse_memory("24GiB") == parse_memory("24") == 24 * GIB
    assert parse_memory("16384MB") == 16 * GIB
    assert accelerator("rtx4090").memory_bytes == 24 * GIB
    assert accelerator("H100").peak_tflops == PEAK_TFLOPS["H100"]
    assert accelerator("A100-80GB", "40GB").memory_bytes == 40 * GIB
    with pytest.raises(UserError, match="--gpu-memory 'lots'"):
        parse_memory("lots")
    with pytest.raises(UserError, match="--gpu-type 'TPU'.*--gpu-memory"):
        accelerator("TPU")
    assert accelerator("TPU", "32GB", 100.0).peak_tflops == 100.0
    for empty in ("0GB", "0", "0.0000000001GB"):  # no memory, however written (signs, inf and nan do not parse)
        with pytest.raises(UserError, match=f"--gpu-memory '{empty}' is 0 bytes"):
            parse_memory(empty)
    for peak in (-3.0, 0.0, float("nan"), float("inf")):  # on every path: a table entry, cpu, a sized or unknown GPU
        for gpu_type, memory in (("4090", None), ("cpu", "8GB"), (None, "24GB"), ("TPU", "32GB")):
            with pytest.raises(UserError, match=f"--peak-tflops {peak:g} must be a positive number"):
                accelerator(gpu_type, memory, peak)


def test_cli_table_and_json(capsys):
    assert main(["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "4090"]) == 0
    text = capsys.readouterr().out
    assert "fits" in text and "fused LM-head loss: [1024, 50304] chunk buffers" in text and "MFU" in text
    assert (
        main(["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "4090", "--micro-batch-size", "2", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["parallel"] == {"dp": 2, "ep": 2, "tp": 1, "pp": 1}
    assert data["micro_batch_size"] == 2 and data["accumulation_steps"] == 4
    assert data["largest_micro_batch"] == 8  # 16 would need a global batch of 32 on 2 GPUs
    assert data["memory"]["peak"] + data["device"]["context_bytes"] == data["needed_bytes"]


@pytest.mark.parametrize(
    "flags",
    [[], ["--micro-batch-size", "8"], ["--micro-batch-size", "8", "--zero-stage", "1"], ["--zero-stage", "3"],
     ["--micro-batch-size", "8", "--pipeline-model-parallel-size", "2", "--moe-expert-parallel-size", "1"]],
)  # fmt: skip
def test_the_memory_rows_add_up_to_the_peak_or_say_what_is_not_there(flags, capsys):
    """Each row is its term at its largest; the peak one moment. Without accumulation only the LM head's gradients
    exist at the start of backward: the rows then add up to more, and one line says by how much and why."""
    argv = ["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "4090", *flags]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    memory, held = data["memory"], data["memory_at_peak"]
    assert sum(held.values()) == memory["peak"] and all(0 <= held[k] <= memory[k] for k in held)
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    first = table.index(next(t for t in table if "memory per GPU" in t))
    peak = next(t for t in table if "needed at the peak" in t)
    rows = [float(t.split()[-1]) for t in table[first + 1 : table.index(peak)] if "pipeline rank" not in t]
    rows = rows[: len(rows) - len(data["pipeline"]["stages"])] if data["pipeline"] else rows  # PP: per-rank lines
    notes = [line for line in table if "(the rows add up to" in line]
    over = (sum(memory[k] for k in held) - memory["peak"]) / GIB
    assert len(notes) == (over >= 0.01)
    if notes:
        assert "gradients exist (the LM head's" in notes[0]
        stated = float(re.search(r"add up to (\d+\.\d\d) GiB", notes[0]).group(1))
        assert stated == pytest.approx(sum(rows), abs=0.006 * len(rows)) and stated > float(peak.split()[-1])
    else:  # the printed rows add up to the printed peak, within their rounding
        assert sum(rows) == pytest.approx(float(peak.split()[-1]), abs=0.006 * len(rows))
    if flags == ["--micro-batch-size", "8"]:
        assert notes and held["gradients"] < memory["gradients"]  # no accumulation: the case the note is for


def test_only_gpu_memory_describes_a_gpu_of_that_size(capsys):
    assert main(["plan", "--config", SEED, "--gpus", "2", "--gpu-memory", "24GB"]) == 0
    text = capsys.readouterr().out
    assert "on 2 × 24 GiB GPU" in text and "available on a 24 GiB GPU" in text
    assert "A100-80GB" not in text.split("device")[0]  # the title and header name no A100 ...
    assert "assumes 312 peak TFLOP/s (an A100-80GB's); set --peak-tflops" in text  # ... only the stated assumption
    assert main(["plan", "--config", SEED, "--gpus", "2", "--gpu-memory", "24GB", "--peak-tflops", "165"]) == 0
    text = capsys.readouterr().out
    assert "A100" not in text and "of 165 peak" in text


def test_default_device_is_stated(capsys):
    assert main(["plan", "--config", SEED, "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    assert "on 2 × A100-80GB" in text and "planned for the default, an A100-80GB" in text
    assert "available on an A100-80GB" in text
    assert main(["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "4090"]) == 0
    assert "device " not in capsys.readouterr().out  # nothing assumed, nothing to say


def test_quickstart_recipe_plans_its_own_vocabulary(capsys):
    assert main(["plan", "--config", "quickstart", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["logits"] > 0
    assert main(["plan", "--config", "quickstart", "--gpus", "2"]) == 0
    assert "fused LM-head loss: [512, 8192] chunk" in capsys.readouterr().out  # not GPT-2's 50304


def test_vocab_size_comes_from_the_tokenizer_files(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"  # no vocab_size: `moetron train` would take the tokenizer's
    config.write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 64\nmicro_batch_size: 2\ntrain_iters: 10\n"
    )
    flags = tiny_tokenizer_flags(make_tiny_tokenizer(tmp_path))  # 300 entries, padded to 384 (divisible by 128)
    assert main(["plan", "--config", str(config), "--gpus", "1", "--gpu-type", "4090", *flags]) == 0
    assert "[128, 384] chunk" in capsys.readouterr().out
    assert (
        main(["plan", "--config", str(config), "--gpus", "1", "--gpu-type", "4090", *flags, "--vocab-size", "1000"])
        == 0
    )
    assert "[128, 1024] chunk" in capsys.readouterr().out  # an explicit --vocab-size wins


def test_cli_shows_changes_that_fit(capsys):
    assert main(["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "4090", "--gpu-memory", "2.8GB"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "changes that fit" in text and "--micro-batch-size" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "3", "--moe-expert-parallel-size", "2"], "data-parallel size 3 is not divisible by --moe-e"),
        (["--gpu-type", "TPU"], "--gpu-type 'TPU' is not in the table"),
        (["--efficiency", "30"], "--efficiency is a fraction"),
    ],
)
def test_cli_errors_are_one_clear_message(argv, message, capsys):
    assert main(["plan", "--config", SEED, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_plan_dry_run_refuses_what_it_cannot_measure(capsys):
    """`--dry-run` runs one layout's CUDA step: with --search or a CPU --gpu-type it stops before any process."""
    assert main(["plan", "--config", SEED, "--gpus", "2", "--dry-run", "--search"]) == 2
    assert "--dry-run measures one layout; drop --search" in capsys.readouterr().err
    assert main(["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "cpu", "--gpu-memory", "8GB", "--dry-run"]) == 2
    assert "--dry-run runs the CUDA step; --gpu-type cpu plans a CPU" in capsys.readouterr().err


def test_plan_gives_the_step_time_the_search_gives_the_same_layout(capsys):
    """One step-time model: `plan` with the search's first row's flags prints that row's step time (the same
    parts: compute at --efficiency, communication, launches), in the same unit."""
    base = ["plan", "--config", SEED, "--gpus", "2", "--gpu-type", "4090"]
    assert main([*base, "--search", "--top", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert main([*base, *row["flags"], "--json"]) in (0, 1)
    planned = json.loads(capsys.readouterr().out)
    assert planned["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-9)
    assert main([*base, *row["flags"]]) in (0, 1)
    assert f"step time  ~{row['step_time_s'] * 1e3:.0f} ms for" in capsys.readouterr().out
