"""GPU smoke test: bf16 training of a 1.3B-MoE128 slice on one GPU, in one command, in under 10 minutes.

    python benchmarks/gpu_smoke.py                  # on a CUDA machine (sized for one H200); skips without CUDA
    python benchmarks/gpu_smoke.py --layers 4       # a deeper slice where memory allows
    python benchmarks/gpu_smoke.py --device cpu --tiny   # the same code path on CPU with a tiny model (tests)

The model is the `gpt-1.3B-moe128` recipe (hidden 2048, 16 heads, seq 2048, 128 GELU experts of 8192 on every 2nd
layer, top-1, capacity factor 1.0, DeepSpeed routing) cut to `--layers` layers (default 2: one dense, one MoE layer,
4.5B parameters; 16 bytes each with fp32 master weights, gradients and AdamW state: 72 GB). It trains with
`--bf16 --compile`, `torch._grouped_mm` experts (`--moe-expert-backend grouped_mm`: the grouped kernel on sm90/sm100)
and SDPA restricted to the flash backend (an error if flash cannot run), and prints:
  - tokens/s over the timed steps after warm-up (compilation included in the warm-up), and MFU against the device's
    bf16 peak (moetron.model.flops: 989 TFLOP/s for H200) with moetron's FLOPs/token formula;
  - peak GPU memory (`torch.cuda.max_memory_allocated`);
  - host syncs per step, counted with `torch.cuda.set_sync_debug_mode("warn")` over one timed step, with where they
    come from (the trainer's design: exactly one, the gradient-norm read);
  - the first `--check-steps` losses against the same run in fp32 on the CPU (same seed, hence the same weights —
    moetron's init is layout- and device-free — and the same batches), with their relative differences.
Without CUDA (and without `--device cpu`) it prints one `gpu_smoke: skipped — …` line and exits 0.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter

import torch

from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from moetron.model.flops import count_parameters, flops_per_token, peak_tflops
from moetron.parallel.env import DistEnv
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.train.trainer import Trainer

SLICE_FLAGS = "--config gpt-1.3B-moe128 --no-checkpoint-activations --micro-batch-size {mbs} --global-batch-size {mbs}"
SLICE_FLAGS += " --num-layers {layers} --train-iters 1000 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0"
SLICE_FLAGS += " --log-interval 1000000 --lr-warmup-iters 0 --lr-decay-style constant --no-fp16"
SLICE_FLAGS += " --moe-expert-parallel-size 1"
TINY_FLAGS = " --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --num-experts 8"
TINY_FLAGS += " --vocab-size 512"


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


def run_config(args: argparse.Namespace, device: torch.device, precise: bool):
    """The slice's RunConfig: bf16 + compile + grouped_mm on the accelerator, fp32 eager for the CPU reference."""
    flags = SLICE_FLAGS.format(mbs=args.micro_batch_size, layers=args.layers) + (TINY_FLAGS if args.tiny else "")
    if not precise:
        flags += " --bf16" + (" --compile" if args.compile else "")
        flags += " --moe-expert-backend grouped_mm" if device.type == "cuda" else ""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    parser.add_argument("--config")
    parsed = parser.parse_args(flags.split())
    cfg, _ = load_config(parsed.config, cli_overrides(parsed))
    return cfg


def build_trainer(cfg, device: torch.device) -> Trainer:
    env = DistEnv(device=device)
    mesh = ParallelMesh.build(cfg.dims(1), env)
    parallel = build(cfg, mesh, device)  # compiled per --compile, experts in the autocast dtype
    loader = RandomLoader(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size)
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


def speed_run(args: argparse.Namespace, device: torch.device) -> list[str]:
    cfg = run_config(args, device, precise=False)
    counts = count_parameters(cfg.model)
    lines = [
        f"model: {cfg.model.num_layers} layers of gpt-1.3B-moe128 ({counts.total / 1e6:,.1f}M parameters, "
        f"{counts.active / 1e6:,.1f}M active), micro-batch {cfg.train.micro_batch_size} × {cfg.model.seq_length} "
        f"tokens, bf16={cfg.train.bf16}, compile={cfg.train.compile}, experts={cfg.model.moe_expert_backend}, "
        f"device {device}"
    ]
    started = time.perf_counter()
    trainer = build_trainer(cfg, device)
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
    tokens_per_s = args.steps * cfg.train.micro_batch_size * cfg.model.seq_length / elapsed
    achieved = flops_per_token(cfg.model) * tokens_per_s / 1e12
    peak = peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    mfu = f"{achieved / peak:.1%} of {peak:g}" if peak else "n/a (unknown peak)"
    lines.append(f"tokens/s {tokens_per_s:.0f}, {achieved:.1f} TFLOP/s, MFU {mfu} TFLOP/s bf16")
    if device.type == "cuda":
        lines.append(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
        lines.append(f"host syncs per step: {syncs} ({', '.join(f'{k} ×{v}' for k, v in where.items()) or 'none'})")
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return lines + check_against_cpu(args, checked)


def check_against_cpu(args: argparse.Namespace, accelerated: list[float]) -> list[str]:
    if args.skip_cpu_check or not accelerated:
        return ["loss check against CPU fp32: skipped"]
    cpu_device = torch.device("cpu")
    cpu = losses(build_trainer(run_config(args, cpu_device, precise=True), cpu_device), len(accelerated))
    worst = max(abs(a - c) / abs(c) for a, c in zip(accelerated, cpu, strict=True))
    pairs = ", ".join(f"{a:.4f}/{c:.4f}" for a, c in zip(accelerated, cpu, strict=True))
    return [f"losses bf16 vs CPU fp32, first {len(cpu)} steps: {pairs}; max relative difference {worst:.2e}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default; skipped without CUDA) or cpu (with --tiny)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the 1.3B-MoE128 model (every 2nd is MoE)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--check-steps", type=int, default=3, help="first steps compared with CPU fp32")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--skip-cpu-check", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same shape family (CPU testing)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_smoke: skipped — no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda})")
        return 0
    for line in speed_run(args, device):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
