"""Context parallelism on a small MoE GPT: per-rank activation memory at CP 1 / 2 / 4 for a fixed sequence length,
the largest sequence length whose activations fit a fixed budget, and `moetron plan`'s prediction beside each.

    python benchmarks/context_parallel.py                       # seq 1024 at CP 1, 2, 4; sweep 512 … 4096 by 128
    python benchmarks/context_parallel.py --seq 2048 --budget-mib 64
    python benchmarks/context_parallel.py --comm-types          # all_gather / p2p / a2a at CP 2 and 4, seq 1024

Model: 4 layers, hidden 128, 8 heads (4 key/value heads), RoPE, 4 experts every 2nd layer, top-2 dropless; fp32,
gloo on CPU, one thread per process. Reported per rank:
  activations  bytes of the tensors autograd saves in one training forward to the last hidden states (parameters
               excluded, each storage once; the LM head's buffers are the plan's separate logits term), its ratio to
               CP 1, and the plan's `activations` for the same layout as a ratio to this measurement;
  largest seq  the longest sequence of the sweep (`--sweep`, default 512 … 4096 in steps of 128) whose measured
               activations fit `--budget-mib` (default: CP 1's measured activations at `--seq`), measured upward
               until one does not fit (activations grow with the sequence); beside it the longest the plan
               predicts to fit, and their ratio.
With `--comm-types`, per `--cp-comm-type` at CP 2 and 4 and `--seq`: the activations as above, the process CPU
seconds of one forward + backward (the fastest of 3 after a warm-up, one thread), and the whole sequence's loss at
the same initial weights against all_gather's (relative difference: the variants are the same attention).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moetron.config import RunConfig
from moetron.data.context_chunks import take_zigzag
from moetron.parallel.env import init_distributed
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.plan.memory import estimate_memory
from process_group import spawn_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the measure is a test instrument
from saved_tensors import saved_tensor_bytes  # noqa: E402

SIZES = (1, 2, 4)


COMM_TYPES = ("all_gather", "p2p", "a2a")


def bench_config(seq: int, cp: int, comm: str = "all_gather") -> RunConfig:
    cfg = RunConfig()
    m, t = cfg.model, cfg.train
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads = 4, 128, 8, 4
    m.seq_length, m.position_embedding_type, m.vocab_size = seq, "rope", 4096
    m.num_experts, m.topk, m.moe_token_dropping = [4], 2, False
    m.hidden_dropout = m.attention_dropout = 0.0
    t.micro_batch_size, t.global_batch_size, t.train_iters = 1, 1, 1
    cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type = cp, comm
    return cfg


def saved_activation_bytes(model: torch.nn.Module, tokens_BT: torch.Tensor) -> int:
    model.train()
    return saved_tensor_bytes(model, lambda: model(tokens_BT, return_logits=False))


def measure(rank: int, world: int, port: int, seqs: list[int], budget: float, results) -> None:
    """The saved activations (largest over the ranks) at each of `seqs` in order, up to the first over `budget`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    env = init_distributed(backend="gloo")
    out = []
    for seq in seqs:
        cfg = bench_config(seq, world)
        mesh = ParallelMesh.build(cfg.dims(world), env)
        parallel = build(cfg, mesh, env.device)
        tokens = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
        local = take_zigzag(tokens, mesh.coords.cp, world)
        saved = torch.tensor(saved_activation_bytes(parallel.model, local), dtype=torch.float64)
        if dist.is_initialized():  # CP 1 runs without a process group
            dist.all_reduce(saved, op=dist.ReduceOp.MAX)  # every rank stops at the same sequence length
        out.append(int(saved))
        if saved > budget:
            break
    results.put((rank, out))
    env.close()


def measure_comm(rank: int, world: int, port: int, seq: int, comm: str, results) -> None:
    """This rank's saved activations, the CPU seconds of one forward + backward, and the whole sequence's loss."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    env = init_distributed(backend="gloo")
    cfg = bench_config(seq, world, comm)
    mesh = ParallelMesh.build(cfg.dims(world), env)
    model = build(cfg, mesh, env.device).model
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = (take_zigzag(x, mesh.coords.cp, world) for x in (tokens[:, :-1], tokens[:, 1:]))
    saved = saved_activation_bytes(model, inputs)
    seconds, loss = [], None
    for _ in range(4):  # a warm-up, then the fastest of three
        start = time.process_time()
        lm_loss = model(inputs, labels, return_logits=False).lm_loss
        lm_loss.backward()
        seconds.append(time.process_time() - start)
        loss = lm_loss.detach().clone()
    dist.all_reduce(loss, group=mesh.group("cp"))  # equal chunks: the mean of the ranks' means is the sequence's
    results.put((rank, saved, min(seconds[1:]), float(loss) / world))
    env.close()


def comm_types_table(seq: int) -> None:
    print(f"small MoE GPT as above, micro batch 1, seq {seq}: --cp-comm-type (CPU, gloo, per rank, one thread)")
    print("| layout | activations (ratio to CP 1) | plan / measured | fwd + bwd CPU s | loss vs all_gather |")
    print("|---|---|---|---|---|")
    one = measured_bytes(seq, 1)
    for cp in SIZES[1:]:
        reference = None
        for comm in COMM_TYPES:
            rows = spawn_group(measure_comm, cp, (seq, comm))
            saved, seconds, loss = max(r[1] for r in rows), max(r[2] for r in rows), rows[0][3]
            reference = loss if reference is None else reference
            cfg = bench_config(seq, cp, comm)
            plan = estimate_memory(cfg, cfg.dims(cp), "cpu").activations / saved
            print(
                f"| CP {cp} {comm} | {saved / 2**20:.2f} MiB ({saved / one:.2f}) | {plan:.2f} | {seconds:.3f} | "
                f"{abs(loss - reference) / reference:.1e} |"
            )


def measured_bytes(seq: int, cp: int) -> int:
    return spawn_group(measure, cp, ([seq], float("inf")))[0][1][0]


def largest_measured(seqs: list[int], cp: int, budget: float) -> int | None:
    """The longest of `seqs` (ascending) whose measured activations at CP `cp` fit `budget`."""
    sizes = spawn_group(measure, cp, (seqs, budget))[0][1]
    fits = [seq for seq, size in zip(seqs, sizes, strict=False) if size <= budget]
    return fits[-1] if fits else None


def planned_bytes(seq: int, cp: int) -> int:
    cfg = bench_config(seq, cp)
    return estimate_memory(cfg, cfg.dims(cp), "cpu").activations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--sweep", type=int, nargs="+", default=list(range(512, 4097, 128)))
    parser.add_argument("--budget-mib", type=float, default=None, help="default: CP 1's activations at --seq")
    parser.add_argument("--comm-types", action="store_true", help="compare --cp-comm-type all_gather, p2p, a2a")
    args = parser.parse_args()
    if args.comm_types:
        comm_types_table(args.seq)
        return
    at_seq = {cp: measured_bytes(args.seq, cp) for cp in SIZES}
    budget = args.budget_mib * 2**20 if args.budget_mib else at_seq[1]
    print(f"small MoE GPT (4 layers, hidden 128, GQA 8/4, RoPE), micro batch 1, seq {args.seq} (CPU, gloo, per rank)")
    print("| layout | activations (ratio to CP 1) | plan / measured | largest seq in budget: measured | plan | ratio |")
    print("|---|---|---|---|---|---|")
    for cp in SIZES:
        seqs = sorted(s for s in args.sweep if s % (2 * cp) == 0)
        fits = largest_measured(seqs, cp, budget)
        plan_fits = max((s for s in seqs if planned_bytes(s, cp) <= budget), default=None)
        ratio = planned_bytes(args.seq, cp) / at_seq[cp]
        seq_ratio = f"{plan_fits / fits:.2f}" if fits and plan_fits else "-"
        print(
            f"| CP {cp} | {at_seq[cp] / 2**20:.2f} MiB ({at_seq[cp] / at_seq[1]:.2f}) | {ratio:.2f} | "
            f"{fits or '-'} | {plan_fits or '-'} | {seq_ratio} |"
        )
    sweep = f"{min(args.sweep)} … {max(args.sweep)} ({len(args.sweep)} lengths)"
    print(f"budget {budget / 2**20:.2f} MiB per rank; sweep {sweep}")


if __name__ == "__main__":
    main()
