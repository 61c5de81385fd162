"""GPU smoke test: bf16 training of a Qwen3-30B-A3B-shaped slice on one GPU, in one command, in under 10 minutes.

    python benchmarks/gpu_smoke.py                        # on a CUDA machine; skips without CUDA
    python benchmarks/gpu_smoke.py --dry-run              # the slice it would train on a 139 GiB H200 (no GPU needed)
    python benchmarks/gpu_smoke.py --recipe gpt-1.3B-moe128 --layers 4   # the older 1.3B-MoE128 slice
    python benchmarks/gpu_smoke.py --recipe seed-2x4090-moe128         # a MoE model that fits a 24 GB RTX 4090
    torchrun --nproc-per-node 2 benchmarks/gpu_smoke.py --recipe seed-2x4090-moe128   # two GPUs, experts split
    python benchmarks/gpu_smoke.py --dry-run --gpu-memory 24GB --recipe seed-2x4090-moe128 --gpus 2
    python benchmarks/gpu_smoke.py --device cpu --tiny    # the same code path on CPU with a tiny model (tests)

The model is a recipe's (default `qwen3-30B-A3B`: hidden 2048, 32 query heads of 128 over 4 KV heads, QK norm, 128
SwiGLU experts of 768 in every layer, dropless top-8, vocab 151936, seq 4096) cut to the most layers that fit the
GPU, counted from the recipe's first MoE layer (a slice without one checks no MoE): the largest count whose
`moetron plan` estimate on one GPU (bf16 compute, fp32 master weights, gradients and
AdamW state: 16 bytes per parameter, plus activations and the CUDA context) stays within 90% of the device's memory
(`--layers` sets it instead; `--dry-run` prints the choice for `--gpu-memory`, default an H200's 139 GiB, and
exits). It trains with `--bf16 --compile`, `torch._grouped_mm` experts (`--moe-expert-backend grouped_mm`: the
grouped kernel on sm90/sm100) and SDPA restricted to the flash backend (an error if flash cannot run), and prints:
  - tokens/s over the timed steps after warm-up (compilation included in the warm-up), the achieved TFLOP/s and MFU
    against the device's bf16 peak (moetron.model.flops: 989 TFLOP/s for H200) with moetron's FLOPs/token formula,
    beside a published reference where there is one (Qwen3-30B-A3B: NeMo AutoModel's 28% MFU on 8 × H100, BF16);
  - peak GPU memory (`torch.cuda.max_memory_allocated`) beside `moetron plan`'s prediction and beside
    `moetron dry-run`'s measurement of the same slice on fake CUDA devices (`--no-dry-run-check` skips it);
  - host syncs per step, counted with `torch.cuda.set_sync_debug_mode("warn")` over one timed step, with where they
    come from (the trainer's design: exactly one, the gradient-norm read);
  - the first `--check-steps` losses against the same run in fp32 on the CPU (same seed, hence the same weights —
    moetron's init is layout- and device-free — and the same batches), with their relative differences.
Under torchrun each process drives one GPU and the experts are split over them (expert parallel = the processes,
one micro-batch per GPU); rank 0 prints the report (no CPU loss check: one GPU only). `--dry-run` exits 1, naming a
slice that would fit, when not even one MoE layer fits `--gpu-memory` on `--gpus` GPUs.
Without CUDA (and without `--device cpu` or `--dry-run`) it prints one `gpu_smoke: skipped — …` line and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch

from moetron.config_cli import config_from_flags, load_config
from moetron.model.flops import count_parameters, flops_per_token, peak_tflops
from moetron.parallel.env import DistEnv, init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import GIB, Accelerator, parse_memory
from moetron.plan.memory import planned_peak_bytes
from moetron.train.peak_memory import peak_memory
from moetron.train.trainer import Trainer

# one GPU, one micro-batch per step, no data files, nothing saved: what the slice changes in the recipe
SLICE_FLAGS = "--config {recipe} --micro-batch-size {mbs} --global-batch-size {gbs} --num-layers {layers}"
SLICE_FLAGS += " --train-iters 1000 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --log-interval 1000000"
SLICE_FLAGS += " --lr-warmup-iters 0 --lr-decay-style constant --no-fp16 --moe-expert-parallel-size {ep} --zero-stage 0"
SLICE_FLAGS += " --no-checkpoint-activations"
HEADROOM = 0.9  # of the device's memory the plan may fill: the allocator's fragmentation and compile's workspaces


@dataclass(frozen=True)
class Recipe:
    tiny_flags: str  # the same family at a size a CPU test runs in seconds
    micro_batch_size: int  # sequences per step on one GPU (enough rows per expert for the grouped GEMM)
    reference: str = ""  # a published MFU of the full model, printed beside ours


RECIPES = {
    "qwen3-30B-A3B": Recipe(
        " --hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 --kv-channels 16 --seq-length 64"
        " --max-position-embeddings 64 --num-experts 8 --topk 2 --moe-ffn-hidden-size 32 --vocab-size 512",
        micro_batch_size=2,
        reference="NeMo AutoModel's published MFU for Qwen3-30B-A3B on 8 × H100, BF16: 28%",
    ),
    "seed-2x4090-moe128": Recipe(
        " --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --num-experts 8"
        " --vocab-size 512",
        micro_batch_size=8,
    ),
    "gpt-1.3B-moe128": Recipe(
        " --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --num-experts 8"
        " --vocab-size 512",
        micro_batch_size=8,
    ),
}


class RandomLoader:
    """Seeded random token batches `[mbs, seq + 1]`: the same sequence on every device."""

    def __init__(self, mbs: int, seq: int, vocab: int, seed: int = 0):
        self.mbs, self.seq, self.vocab, self.i = mbs, seq, vocab, 0
        self.seed = seed

    @property
    def next_first_sample(self) -> int:
        return self.i * self.mbs

    def next_micro_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + self.i)
        self.i += 1
        return torch.randint(0, self.vocab, (self.mbs, self.seq + 1), generator=g)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.i * self.mbs}


def world_size() -> int:
    """torchrun's processes (one per GPU): the experts are split over them (expert parallel = world size)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def slice_config(args: argparse.Namespace, layers: int, device_type: str, precise: bool, gpus: int = 1):
    """The slice's RunConfig on `gpus` GPUs (experts split over them, one micro-batch per GPU): bf16 + compile +
    grouped_mm on the accelerator, fp32 eager for the CPU reference."""
    mbs = micro_batch_size(args)
    flags = SLICE_FLAGS.format(recipe=args.recipe, mbs=mbs, gbs=mbs * gpus, ep=gpus, layers=layers)
    flags += RECIPES[args.recipe].tiny_flags if args.tiny else ""
    if not precise:
        flags += " --bf16" + (" --compile" if args.compile else "")
        flags += " --moe-expert-backend grouped_mm" if device_type == "cuda" else ""
    return config_from_flags(flags.split())[0]


def micro_batch_size(args: argparse.Namespace) -> int:
    return args.micro_batch_size or RECIPES[args.recipe].micro_batch_size


def planned_bytes(args: argparse.Namespace, layers: int, device: Accelerator, gpus: int = 1) -> int:
    """What `moetron plan` says each GPU needs for the bf16 slice of `layers` layers (peak + CUDA context)."""
    return make_plan(with_layers(bf16_slice(args, gpus), layers), gpus, device).needed_bytes


@functools.cache
def _bf16_slice(recipe: str, mbs: int, tiny: bool, compile_: bool, gpus: int):
    args = argparse.Namespace(recipe=recipe, micro_batch_size=mbs, tiny=tiny, compile=compile_)
    return slice_config(args, 1, "cuda", precise=False, gpus=gpus)


def bf16_slice(args: argparse.Namespace, gpus: int = 1):
    """The GPU run's config (1 layer; `with_layers` sets the count), parsed once: planning many counts stays cheap."""
    return _bf16_slice(args.recipe, micro_batch_size(args), args.tiny, args.compile, gpus)


def with_layers(cfg, layers: int):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))


def fitting_layers(args: argparse.Namespace, memory_bytes: int, gpus: int = 1) -> tuple[int, int]:
    """(the most layers of the recipe whose planned memory per GPU fits HEADROOM of `memory_bytes`, that plan's
    bytes), counted from the first MoE layer (a slice without one checks no MoE); 0 layers when not even that many
    fit. Planning only: nothing is allocated."""
    device = Accelerator("one GPU", memory_bytes, peak_tflops("H200") or 1.0)
    best, best_bytes = 0, 0
    first_moe = min(load_config(args.recipe, {})[0].model.moe_layer_indices(), default=0) + 1
    for layers in range(first_moe, recipe_layers(args.recipe) + 1):  # memory grows with every layer
        needed = planned_bytes(args, layers, device, gpus)
        if needed > HEADROOM * memory_bytes:
            break
        best, best_bytes = layers, needed
    return best, best_bytes


def recipe_layers(recipe: str) -> int:
    return load_config(recipe, {})[0].model.num_layers


def build_trainer(cfg, device: torch.device, env: DistEnv | None = None) -> Trainer:
    env = env or DistEnv(device=device)
    mesh = ParallelMesh.build(cfg.dims(env.world_size), env)
    parallel = build(cfg, mesh, device)  # compiled per --compile, experts in the autocast dtype
    mbs = cfg.train.micro_batch_size  # each rank its own random batches
    loader = RandomLoader(mbs, cfg.model.seq_length, cfg.model.vocab_size, seed=env.rank * 1_000_003)
    trainer = Trainer(cfg, env, parallel, loader)
    trainer.model.train()
    return trainer


def attention_backend(device: torch.device):
    """SDPA restricted to flash attention on CUDA (so a silent fallback to the math kernel is an error)."""
    if device.type != "cuda":
        import contextlib

        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_host_syncs(trainer: Trainer, device: torch.device) -> tuple[int, Counter]:
    """Host syncs of one optimizer step (CUDA's sync debug mode warns at each), and where they come from."""
    if device.type != "cuda":
        return -1, Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), Counter(f"{w.filename}:{w.lineno}" for w in syncs)


def losses(trainer: Trainer, steps: int) -> list[float]:
    return [float(trainer.train_step().sums.losses[0]) for _ in range(steps)]


def describe(cfg, recipe: str, device: str) -> str:
    counts = count_parameters(cfg.model)
    return (
        f"model: {cfg.model.num_layers} layers of {recipe} ({counts.total / 1e6:,.1f}M parameters, "
        f"{counts.active / 1e6:,.1f}M active), micro-batch {cfg.train.micro_batch_size} × {cfg.model.seq_length} "
        f"tokens, bf16={cfg.train.bf16}, compile={cfg.train.compile}, experts={cfg.model.moe_expert_backend}, "
        f"device {device}"
    )


def speed_lines(args: argparse.Namespace, cfg, tokens_per_s: float, device: torch.device) -> list[str]:
    """tokens/s, achieved TFLOP/s and MFU (moetron's FLOPs/token formula) with the recipe's published reference."""
    achieved = flops_per_token(cfg.model) * tokens_per_s / 1e12
    peak = peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    mfu = f"{achieved / peak:.1%} of {peak:g}" if peak else "n/a (unknown peak)"
    lines = [f"tokens/s {tokens_per_s:.0f}, {achieved:.1f} TFLOP/s, MFU {mfu} TFLOP/s bf16"]
    reference = RECIPES[args.recipe].reference
    if reference:
        lines.append(f"  beside: {reference} (the full model over 8 GPUs; this is a slice of its layers on one)")
    return lines


def slice_layers(args: argparse.Namespace, device: torch.device, gpus: int) -> int:
    """`--layers`, or the most that fit this GPU (the CPU test path: 2)."""
    if args.layers:
        return args.layers
    if device.type != "cuda":
        return 2
    layers, _ = fitting_layers(args, torch.cuda.get_device_properties(device).total_memory, gpus)
    return max(layers, 1)


def speed_run(args: argparse.Namespace, device: torch.device, env: DistEnv | None = None) -> list[str]:
    """The timed bf16 run on this process's device (under torchrun: each rank one GPU, the experts split over the
    ranks); every rank runs it, rank 0's lines are printed."""
    gpus = env.world_size if env else 1
    cfg = slice_config(args, slice_layers(args, device, gpus), device.type, precise=False, gpus=gpus)
    lines = [describe(cfg, args.recipe, str(device)) + (f", expert parallel {gpus} over {gpus} GPUs" if gpus > 1
                                                         else "")]  # fmt: skip
    started = time.perf_counter()
    trainer = build_trainer(cfg, device, env)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with attention_backend(device):
        checked = losses(trainer, args.check_steps)
        for _ in range(args.warmup):
            trainer.train_step()
        synchronize(device)
        lines.append(f"build + {args.check_steps + args.warmup} warm-up steps: {time.perf_counter() - started:.0f} s")
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        syncs, where = count_host_syncs(trainer, device)
    lines += speed_lines(args, cfg, args.steps * cfg.train.micro_batch_size * cfg.model.seq_length / elapsed, device)
    lines.append(memory_line(cfg, device, gpus))
    if device.type == "cuda" and args.dry_run_check and gpus == 1:  # the dry run of several ranks: `moetron dry-run`
        lines.append(dry_run_line(cfg, peak_memory(device)["peak_memory_gib"] * GIB))
    if device.type == "cuda":
        lines.append(f"host syncs per step: {syncs} ({', '.join(f'{k} ×{v}' for k, v in where.items()) or 'none'})")
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if gpus > 1:  # the one-process CPU reference would see another batch per step than the ranks together
        return [*lines, "loss check against CPU fp32: one GPU only (run without torchrun)"]
    return lines + check_against_cpu(args, cfg.model.num_layers, checked)


def memory_line(cfg, device: torch.device, gpus: int = 1) -> str:
    """The run's peak memory (the trainer's own figure: CUDA max allocated, CPU peak RSS) beside `moetron plan`'s
    prediction for this layout, as the training log prints them."""
    measured = peak_memory(device)["peak_memory_gib"] * GIB
    planned = planned_peak_bytes(cfg, gpus, device.type)
    what = "max_memory_allocated" if device.type == "cuda" else "peak RSS, the process's own baseline included"
    if planned is None:
        return f"peak memory {measured / GIB:.2f} GiB ({what}); no plan estimate for this layout"
    return (
        f"peak memory {measured / GIB:.2f} GiB ({what}); plan {planned / GIB:.2f} GiB; measured / plan "
        f"{measured / planned:.2f}"
    )


def dry_run_line(cfg, measured: float) -> str:
    """`moetron dry-run` of the same slice (fake CUDA devices on this host's CPU) beside the real peak: the check
    of the dry run itself, which measures every other layout without a GPU. The dry run runs eager (it does not
    cover --compile), so a compiled run's peak may be lower by the temporaries its fused kernels never make."""
    from moetron.commands.dry_run import measured_report
    from moetron.dryrun.report import gib

    eager = copy.deepcopy(cfg)
    eager.train.compile = False
    dry = measured_report(eager, 1)["peak_bytes"]
    note = " (the real run compiled; the dry run is eager)" if cfg.train.compile else ""
    return f"dry run peak {gib(dry)} (fake cuda, same slice); real / dry run {measured / dry:.2f}{note}"


def check_against_cpu(args: argparse.Namespace, layers: int, accelerated: list[float]) -> list[str]:
    if args.skip_cpu_check or not accelerated:
        return ["loss check against CPU fp32: skipped"]
    cpu_device = torch.device("cpu")
    cpu = losses(build_trainer(slice_config(args, layers, "cpu", precise=True), cpu_device), len(accelerated))
    worst = max(abs(a - c) / abs(c) for a, c in zip(accelerated, cpu, strict=True))
    pairs = ", ".join(f"{a:.4f}/{c:.4f}" for a, c in zip(accelerated, cpu, strict=True))
    return [f"losses bf16 vs CPU fp32, first {len(cpu)} steps: {pairs}; max relative difference {worst:.2e}"]


def dry_run(args: argparse.Namespace) -> tuple[list[str], int]:
    """The slice `--gpu-memory` holds on `--gpus` GPUs, from the plan alone: what a GPU run would train; exit 1 with
    what would fit when not even one MoE layer does."""
    memory, gpus = parse_memory(args.gpu_memory), args.gpus
    layers, needed = fitting_layers(args, memory, gpus)
    if layers == 0:
        return [
            f"gpu_smoke: not even one MoE layer of {args.recipe} fits {args.gpu_memory} on {gpus} GPU(s) (planned, "
            f"{HEADROOM:.0%}); a MoE slice that fits 24 GB: --recipe seed-2x4090-moe128; or split the experts over "
            f"more GPUs: torchrun --nproc-per-node 2 benchmarks/gpu_smoke.py (--gpus 2 here)"
        ], 1
    cfg = slice_config(args, layers, "cuda", precise=False, gpus=gpus)
    full = recipe_layers(args.recipe)
    device = Accelerator("one GPU", memory, 1.0)
    split = f", experts split over {gpus} GPUs (torchrun --nproc-per-node {gpus})" if gpus > 1 else ""
    more = (f"; {layers + 1} layers would need {planned_bytes(args, layers + 1, device, gpus) / GIB:.1f} GiB"
            if layers < full else "")  # fmt: skip
    return [
        describe(cfg, args.recipe, "cuda (planned)"),
        f"slice: {layers} of {full} layers ({len(cfg.model.moe_layer_indices())} MoE){split}; planned "
        f"{needed / GIB:.1f} GiB of {memory / GIB:.0f} GiB per GPU (≤ {HEADROOM:.0%}){more}",
        f"FLOPs/token {flops_per_token(cfg.model) / 1e9:.2f} G (moetron's formula, the MFU's numerator)",
    ], 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default; skipped without CUDA) or cpu (with --tiny)")
    parser.add_argument("--recipe", choices=list(RECIPES), default="qwen3-30B-A3B", help="the model to slice")
    parser.add_argument("--layers", type=int, default=None, help="layers of the slice (default: the most that fit)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the recipe's entry in RECIPES")
    parser.add_argument("--gpu-memory", default="139GiB", help="with --dry-run: the memory to plan the slice for")
    parser.add_argument("--dry-run", action="store_true", help="print the slice the plan fits, allocate nothing")
    parser.add_argument(
        "--gpus",
        type=int,
        default=world_size(),
        help="with --dry-run: GPUs to plan for (default: torchrun's processes)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--check-steps", type=int, default=3, help="first steps compared with CPU fp32")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--skip-cpu-check", action="store_true")
    parser.add_argument(
        "--no-dry-run-check",
        dest="dry_run_check",
        action="store_false",
        help="on CUDA, skip `moetron dry-run` of the same slice beside the real peak (minutes on the CPU)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same shape family (CPU testing)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        lines, status = dry_run(args)
        print("\n".join(lines), flush=True)
        return status
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_smoke: skipped — no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda})")
        return 0
    env = None
    if world_size() > 1:  # torchrun: one GPU per process, the experts split over them
        env = init_distributed()
        device = env.device
    lines = speed_run(args, device, env)
    if env is None or env.is_main:
        print("\n".join(lines), flush=True)
    if env is not None:
        env.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
