"""The LM head + cross-entropy alone: moetron's fused head against the plain one, and both against their GEMMs.

    python benchmarks/fused_head.py                       # e2e.py's head: 768 tokens × 128 → 50304, 1 and 2 threads
    python benchmarks/fused_head.py --tokens 4096 --hidden 512 --threads 1

One forward + backward per call, process CPU time, every variant interleaved in one process (threads switched with
`torch.set_num_threads`), the median of `--reps`:
  fused        `fused_linear_cross_entropy` (chunked; the gradients computed in its forward) on the CPU head-loss
               backend (`moetron/cpu/head_loss.py`: its kernels, chunks, threads and reused memory)
  fused aten   the same on ATen's ops (`model/backends.py`'s defaults); absent where the CPU kernels do not load
  plain        `F.cross_entropy(F.linear(x, W))`, what nanoGPT and HF run: [N, V] logits, log-softmax, its gradient
  floor fused  the fused head's own GEMMs replayed alone (`gemm_floor.py`): what its element-wise work costs on top
  floor plain  the plain head's GEMMs alone
Start it with the environment `moetron train` sets (`THP_MEM_ALLOC_ENABLE=1 OMP_WAIT_POLICY=PASSIVE`), as e2e.py
starts both sides; the script prints what it found.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from gemm_floor import record_gemms, replay_seconds  # benchmarks/, beside this script
from moetron.cpu import CPU_EXPERTS, CPU_HEAD_LOSS, use_cpu_backends
from moetron.cpu.compiled_kernels import compiled_cpu_kernels
from moetron.model.backends import ATEN_HEAD_LOSS, use_backends
from moetron.model.fused_cross_entropy import fused_linear_cross_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_(True)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    weights = torch.full((args.tokens,), 1.0 / args.tokens)

    def fused():
        x.grad = w.grad = None
        fused_linear_cross_entropy(x, w, labels, weights).backward()

    def plain():
        x.grad = w.grad = None
        F.cross_entropy(F.linear(x, w), labels).backward()

    use_cpu_backends()

    def fused_aten():
        use_backends("cpu", experts=CPU_EXPERTS, head_loss=ATEN_HEAD_LOSS)
        try:
            fused()
        finally:
            use_backends("cpu", experts=CPU_EXPERTS, head_loss=CPU_HEAD_LOSS)

    floors = {"fused": record_gemms(fused), "plain": record_gemms(plain)}
    variants = {
        "fused": fused,
        **({"fused aten": fused_aten} if compiled_cpu_kernels() is not None else {}),
        "plain": plain,
        "floor fused": lambda: replay_seconds(floors["fused"], time.process_time, reps=1),
        "floor plain": lambda: replay_seconds(floors["plain"], time.process_time, reps=1),
    }
    times = {(t, name): [] for t in args.threads for name in variants}
    for _ in range(args.reps):
        for t in args.threads:
            torch.set_num_threads(t)
            for name, run in variants.items():
                if name.startswith("floor"):
                    times[(t, name)].append(run())
                    continue
                start = time.process_time()
                run()
                times[(t, name)].append(time.process_time() - start)
    env = " ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("THP_MEM_ALLOC_ENABLE", "OMP_WAIT_POLICY"))
    print(
        f"head {args.tokens} × {args.hidden} → {args.vocab}, forward + backward, process CPU ms (median of "
        f"{args.reps}); {env}; load average {os.getloadavg()[0]:.1f}"
    )
    for t in args.threads:
        ms = {name: 1e3 * statistics.median(times[(t, name)]) for name in variants}
        print(
            f"  {t} thread(s): fused {ms['fused']:.0f} (floor {ms['floor fused']:.0f}, "
            f"{ms['fused'] / ms['floor fused']:.2f}×), plain {ms['plain']:.0f} (floor {ms['floor plain']:.0f}, "
            f"{ms['plain'] / ms['floor plain']:.2f}×); plain / fused {ms['plain'] / ms['fused']:.2f}×"
        )
        if "fused aten" in ms:
            print(
                f"    softmax by ATen instead of the kernel: {ms['fused aten']:.0f} ms, "
                f"{ms['fused aten'] / ms['fused']:.2f}× the fused head's time"
            )


if __name__ == "__main__":
    main()
