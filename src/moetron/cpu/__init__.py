"""moetron's CPU backend: the speed work that runs only on a CPU, kept out of the device-neutral model.

    from moetron.cpu import use_cpu_backends
    use_cpu_backends()   # the model's CPU tensors now run through CPU_EXPERTS and CPU_HEAD_LOSS

It reaches the model through the two seams of `moetron/model/backends.py` only:
  experts.py          `CpuExperts`: SwiGLU experts expert by expert (C++ or a Python loop), the router's top-1 pick
                      and the combine's row adds in C++
  head_loss.py        `CpuHeadLoss`: the fused LM head's chunk size, one-exp softmax and fp32 chunk loop in C++,
                      its buffers, and the embedding lookup that shares its [V, C] gradient memory
and the trainer's thread policy (`threads.py`, `step_threads.py`: a small model's step on one thread, its kernels
on every thread). Below them: `compiled_kernels.py` builds and loads the C++ sources of `csrc/` (cached by their
content), `gradient_memory.py` keeps the [V, C] gradients' memory across steps. Every kernel computes what ATen's
ops compute (bit for bit, the head to fp32 rounding), so whether it loads changes speed only.
"""

from __future__ import annotations

from moetron.cpu.experts import CPU_EXPERTS
from moetron.cpu.head_loss import CPU_HEAD_LOSS
from moetron.model.backends import use_backends


def use_cpu_backends() -> None:
    """Run the model's CPU tensors through the CPU experts and head-loss backends (idempotent)."""
    use_backends("cpu", experts=CPU_EXPERTS, head_loss=CPU_HEAD_LOSS)
