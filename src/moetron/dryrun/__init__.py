"""`moetron dry-run`: the real training step on fake CUDA devices, one simulated rank per process, on a CPU.

  shim.py / fake_cuda.cpp   a C++ device guard and CUDA hooks so that fake cuda tensors go through autograd
  patches.py                torch-side patches (each asserting that what it replaces still exists)
  attention_kernels.py      SDPA's kernel choice as on a GPU, through that kernel's aten op
  observe.py, stand_ins.py  host reads, collectives, fp32 GEMMs, device mix-ups; values for reads of fake tensors
  rank_step.py, worker.py   one rank's build + steps under FakeTensorMode and MemTracker (the child process)
  report.py                 the ranks' records merged, the verdict, the printed report and the JSON

Importing this package does not import torch (the worker loads the shim first).
"""
