"""Trainer overhead and activation-checkpointing memory, as ratios measured side by side in one process.

    python benchmarks/train_step.py                       # dense and MoE, 30 interleaved steps each
    python benchmarks/train_step.py --steps 50 --threads 2

Time: one optimizer step of moetron's `Trainer` (accumulation, loss scaling path, clipping, skip check,
LR schedule, metrics accumulated on device and logged every `--log-interval` steps to a temporary run dir)
against a minimal plain-PyTorch loop on the SAME model object and the SAME batches (forward with the same LM
head + loss — fused with the cross-entropy under `--fused-cross-entropy`, the default —, backward with
loss ÷ num_micro, `clip_grad_norm_`, torch AdamW with the same fused/foreach choice, no logging). Steps are
interleaved (trainer, plain, trainer, plain, …) so machine noise hits both alike; the ratio of medians is
printed (1.00 = no overhead; the goal is < 1.05).

Memory: peak bytes live in torch's CPU allocator during one optimizer step (torch.profiler allocation events,
summed in time order, minus what was live before), with and without `--checkpoint-activations`; on CUDA,
`max_memory_allocated`. Printed as a ratio (checkpointed / not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from memory_peak import peak_cpu_bytes
from moetron.config import RunConfig
from moetron.parallel.env import DistEnv
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build as build_parallel
from moetron.train.trainer import Trainer


class ListLoader:
    """Cycles through pre-built micro-batches (so both loops see identical data and no loading cost)."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches, self.i = batches, 0

    @property
    def next_first_sample(self) -> int:
        return self.i * self.batches[0].shape[0]

    def next_micro_batch(self) -> torch.Tensor:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["consumed_samples"]


def make_config(moe: bool, checkpoint_activations: bool = False, log_interval: int = 10) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 4, 128, 4, 128, 2048
    m.num_experts, m.topk = ([8], 2) if moe else ([1], 1)
    m.checkpoint_activations = checkpoint_activations
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.log_interval = 4, 8, 10**6, log_interval
    return cfg


def make_batches(cfg: RunConfig, n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length + 1)
    return [torch.randint(0, cfg.model.vocab_size, shape, generator=g) for _ in range(n)]


def build(cfg: RunConfig, run_dir: str) -> Trainer:
    cfg.train.output_dir = run_dir
    env = DistEnv()
    parallel = build_parallel(cfg, ParallelMesh.build(cfg.dims(1), env), "cpu")
    trainer = Trainer(cfg, env, parallel, ListLoader(make_batches(cfg)))
    from moetron.train.metrics import RunLogger

    trainer.logger = RunLogger(run_dir, None, True, cfg.train.train_iters)
    trainer.logger.print = lambda line: None  # keep the benchmark's own output readable; files are still written
    return trainer


def trainer_step(trainer: Trainer, state: dict) -> None:
    result = trainer.train_step()
    trainer._account(result)
    state["n"] += 1
    if trainer.progress.iteration % trainer.cfg.train.log_interval == 0:
        trainer._log(time.perf_counter() - state["t0"], state["n"])
        state["t0"], state["n"] = time.perf_counter(), 0


def plain_step(model, optimizer, batches, num_micro: int, fused_head: bool) -> None:
    optimizer.zero_grad(set_to_none=True)
    for batch in batches:
        # the same LM head + loss as the trainer's (`--fused-cross-entropy`: logits never materialised)
        out = model(batch[:, :-1], labels_BT=batch[:, 1:], return_logits=not fused_head)
        ((out.lm_loss + out.moe_loss) / num_micro).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def time_overhead(
    moe: bool, steps: int, warmup: int, run_dir: str, clock=time.perf_counter, profile_steps: int = 0
) -> tuple[float, float, float, list[str]]:
    trainer = build(make_config(moe), run_dir)
    plain_opt = torch.optim.AdamW(trainer.model.parameters(), lr=1e-4, fused=trainer.optimizer.defaults.get("fused"))
    plain_batches = ListLoader(make_batches(trainer.cfg))
    state = {"t0": time.perf_counter(), "n": 0}
    fused_head = trainer.cfg.train.fused_cross_entropy
    times = {"trainer": [], "plain": []}

    def run(name: str) -> None:
        if name == "trainer":
            trainer_step(trainer, state)
        else:
            batches = [plain_batches.next_micro_batch() for _ in range(trainer.num_micro)]
            plain_step(trainer.model, plain_opt, batches, trainer.num_micro, fused_head)

    for i in range(warmup + steps):
        for name in ("trainer", "plain") if i % 2 == 0 else ("plain", "trainer"):
            start = clock()
            run(name)
            if i >= warmup:
                times[name].append(clock() - start)
    profiles = operator_profiles(run, profile_steps, "MoE" if moe else "dense") if profile_steps else []
    t, p = statistics.median(times["trainer"]), statistics.median(times["plain"])
    return t, p, t / p, profiles


def operator_profiles(run, steps: int, config: str) -> list[str]:
    """Self CPU time per operator of `steps` steps of each loop: where the trainer's extra time goes."""
    from torch.profiler import profile

    totals = {}
    for name in ("trainer", "plain"):
        with profile() as prof:
            for _ in range(steps):
                run(name)
        totals[name] = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    keys = set(totals["trainer"]) | set(totals["plain"])
    diff = sorted(keys, key=lambda k: totals["trainer"].get(k, 0) - totals["plain"].get(k, 0), reverse=True)
    whole = {name: sum(t.values()) / 1e3 / steps for name, t in totals.items()}
    lines = [f"# {config}: profiled self CPU ms/step trainer {whole['trainer']:.1f}, plain {whole['plain']:.1f}"]
    lines += ["| operator | trainer ms/step | plain ms/step | difference |", "|---|---|---|---|"]
    for k in diff[:10]:
        t, p = totals["trainer"].get(k, 0) / 1e3 / steps, totals["plain"].get(k, 0) / 1e3 / steps
        lines.append(f"| {k} | {t:.2f} | {p:.2f} | {t - p:+.2f} |")
    return lines


def peak_step_bytes(moe: bool, checkpoint_activations: bool, run_dir: str) -> int:
    trainer = build(make_config(moe, checkpoint_activations), run_dir)
    trainer.train_step()  # warm: optimizer state exists, one-time probes done
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cpu_peak = peak_cpu_bytes(trainer.train_step)
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else cpu_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per loop and config")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time per step")
    parser.add_argument("--profile", type=int, default=0, help="also profile N steps of each loop, per operator")
    parser.add_argument("--skip-memory", action="store_true", help="only the time ratios")
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    cfg = make_config(True)
    m = cfg.model
    print(
        f"# layers={m.num_layers} hidden={m.hidden_size} seq={m.seq_length} vocab={m.vocab_size} "
        f"micro={cfg.train.micro_batch_size} global={cfg.train.global_batch_size} (2 micro-batches) "
        f"MoE: E=8 top-2 every 2nd layer; threads={args.threads}; {args.clock} clock; torch {torch.__version__}"
    )
    print("| config | trainer step (ms) | plain loop step (ms) | trainer / plain |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        profiles = []
        for moe in (False, True):
            t, p, ratio, lines = time_overhead(
                moe, args.steps, args.warmup, str(Path(tmp) / f"t{moe}"), clock, args.profile
            )
            print(f"| {'MoE' if moe else 'dense'} | {1e3 * t:.1f} | {1e3 * p:.1f} | {ratio:.3f} |", flush=True)
            profiles += lines
        if profiles:
            print("\n" + "\n".join(profiles))
        if args.skip_memory:
            return 0
        print()
        print("| config | peak step memory, no ckpt (MiB) | with --checkpoint-activations (MiB) | ratio |")
        print("|---|---|---|---|")
        for moe in (False, True):
            plain = peak_step_bytes(moe, False, str(Path(tmp) / "m0"))
            ckpt = peak_step_bytes(moe, True, str(Path(tmp) / "m1"))
            name = "MoE" if moe else "dense"
            print(f"| {name} | {plain / 2**20:.1f} | {ckpt / 2**20:.1f} | {ckpt / plain:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
