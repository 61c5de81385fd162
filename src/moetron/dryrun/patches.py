"""The torch-side patches that let moetron's GPU path run on fake CUDA tensors in torch's CPU wheel.

Each patch replaces one thing in torch that reads a real device, a real storage or a CUDA runtime (none exists
here), and first asserts that the thing it replaces is still there (`_require`): a torch upgrade that moves or
renames it fails the dry run loudly, in CI, instead of silently measuring something else. None changes moetron.

Applied once, in the dry-run child only (`apply_all`), after the fake-CUDA shim is loaded and torch imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moetron.dryrun import attention_kernels, observe

CAPABILITY = (9, 0)  # an H100's: the grouped-GEMM and compile paths pick their sm90 branches


def _require(owner: object, name: str) -> Callable:
    """`owner.name`, asserting it exists: what a patch replaces must still be there in this torch."""
    assert hasattr(owner, name), (
        f"dry run: torch {torch.__version__} has no {getattr(owner, '__name__', owner)}.{name}; "
        "moetron/dryrun/patches.py must be updated for this torch"
    )
    return getattr(owner, name)


def _replace(owner: object, name: str, new: object) -> None:
    _require(owner, name)
    setattr(owner, name, new)


def patch_autocast() -> None:
    # torch.autocast("cuda") disables itself (with a warning) when CUDA is "definitely not available"; the real
    # step runs under bf16/fp16 autocast, so it must stay on. bf16 is supported on every GPU moetron plans for.
    import torch.cuda.amp.common as amp_common

    _replace(amp_common, "amp_definitely_not_available", lambda: False)
    _replace(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def patch_device_queries() -> None:
    # The experts' backend and compile choose their kernels from the device's compute capability; the CPU wheel
    # raises for any query of a CUDA device.
    _replace(torch.cuda, "get_device_capability", lambda device=None: CAPABILITY)


def patch_to_empty() -> None:
    # `Module.to_empty` swaps each parameter's tensor in place (`swap_tensors`), which fake tensors refuse (they
    # hold weak references). Replacing the Parameter objects has the same effect for a model built on `meta`;
    # the memo keeps tied parameters tied. A Parameter's __dict__ is not copied: a fake one holds its fake device.
    original = _require(torch.nn.Module, "to_empty")

    def to_empty(module: torch.nn.Module, *, device, recurse: bool = True) -> torch.nn.Module:
        memo: dict[int, torch.nn.Parameter] = {}
        for sub in module.modules() if recurse else [module]:
            for name, param in list(sub._parameters.items()):
                if param is None:
                    continue
                if id(param) not in memo:
                    empty = torch.empty_like(param, device=device)
                    memo[id(param)] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
                sub._parameters[name] = memo[id(param)]
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None:
                    sub._buffers[name] = torch.empty_like(buffer, device=device)
        return module

    to_empty.__wrapped__ = original
    torch.nn.Module.to_empty = to_empty


def patch_sdpa() -> None:
    # With no CUDA runtime, SDPA's backend choice falls to the math kernel (and its fp32 internals): neither the
    # dtype nor the memory a GPU would see. `attention_kernels` decides the kernel as PyTorch's selection does and
    # calls that kernel's aten op, so its meta checks run.
    original = _require(F, "scaled_dot_product_attention")
    F.scaled_dot_product_attention = attention_kernels.scaled_dot_product_attention
    attention_kernels.MATH_FALLBACK = original
    # A causal bias (`causal_lower_right`, context parallelism's per-chunk calls) is a tensor subclass of no data,
    # which cannot be made under the fake and observing modes: made outside them, it only carries its sizes.
    from torch.nn.attention import bias
    from torch.utils._python_dispatch import _disable_current_modes

    make = _require(bias, "causal_lower_right")

    def causal_lower_right(*size: int):
        with _disable_current_modes():
            return make(*size)

    bias.causal_lower_right = causal_lower_right


class _NullLogger:
    """DDP's C++ logger reads a CUDA timer on the second forward; the dry run logs nothing through it."""

    def __getattr__(self, name: str) -> Callable:
        return lambda *args, **kwargs: None


class _ReducerProxy:
    """DDP's reducer, except that rebuilding its buckets after step 1 (which reads parameter storages) is skipped."""

    def __init__(self, reducer: object):
        object.__setattr__(self, "_reducer", reducer)

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


def patch_ddp() -> None:
    # DDP's constructor checks parameter shapes across ranks and broadcasts rank 0's weights: both read storages,
    # which fake tensors do not have, and under the fake process group neither has peers to agree with.
    import torch.nn.parallel.distributed as ddp

    _replace(ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None)
    _replace(ddp, "_sync_module_states", lambda *args, **kwargs: None)
    init_helper = _require(ddp.DistributedDataParallel, "_ddp_init_helper")

    def _ddp_init_helper(self, *args, **kwargs):
        init_helper(self, *args, **kwargs)
        self._dryrun_cpp_logger = self.logger  # kept alive: the reducer holds it weakly
        self.logger = _NullLogger()
        self.reducer = _ReducerProxy(self.reducer)

    ddp.DistributedDataParallel._ddp_init_helper = _ddp_init_helper


class _NoStream:
    """A stream or event of the fake device: ordering is what the code asks for; nothing to wait on."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str) -> Callable:
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _FakeCudaHandle:
    """What FSDP2 and DeviceMesh use of `torch.cuda`: streams, events, the current device. No runtime behind it."""

    Stream = Event = _NoStream

    @staticmethod
    def current_stream(*args, **kwargs) -> _NoStream:
        return _NoStream()

    @staticmethod
    def stream(*args, **kwargs) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(*args, **kwargs) -> None:
        return None

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return True


def patch_device_handle() -> None:
    # FSDP2 and DeviceMesh reach the device through `_get_device_handle("cuda")` = `torch.cuda`, whose streams and
    # events need a CUDA runtime. Every module that imported the function by name gets one that answers a no-op
    # handle for cuda.
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - imported so its name is patched
    import torch.distributed.fsdp._fully_shard._fsdp_init  # noqa: F401
    import torch.distributed.fsdp._fully_shard._fsdp_param_group  # noqa: F401
    import torch.distributed.fsdp._fully_shard._fsdp_state  # noqa: F401
    import torch.distributed.tensor._random  # noqa: F401

    original = _require(device_mesh, "_get_device_handle")

    def _get_device_handle(device_type: str = "cuda"):
        return _FakeCudaHandle if device_type == "cuda" else original(device_type)

    for module in list(sys.modules.values()):
        if getattr(module, "_get_device_handle", None) is original:
            module._get_device_handle = _get_device_handle
    # FSDP2 marks gradients for the reduce-scatter stream; there are no streams
    _replace(torch.Tensor, "record_stream", lambda self, stream: None)


def patch_pipelining() -> None:
    # The pipeline schedule forks the RNG of every cuda device (torch.cuda.get_rng_state needs a runtime); the
    # dry run's values are stand-ins, so the fork has nothing to protect.
    import torch.random

    original = _require(torch.random, "fork_rng")

    @contextlib.contextmanager
    def fork_rng(devices=None, enabled=True, _caller="fork_rng", _devices_kw="devices", device_type=None):
        if device_type == "cuda":
            yield
            return
        with original(devices, enabled, _caller, _devices_kw, device_type=device_type or "cpu"):
            yield

    torch.random.fork_rng = fork_rng


def patch_dtensor_propagation() -> None:
    # DTensor's sharding propagation runs each op once more on fake tensors of the GLOBAL shapes to learn the
    # output's metadata, under whatever fake mode is active: here the dry run's own, so MemTracker and the observer
    # would count those global-size tensors (and their GEMMs) as the rank's. While it runs, `observe.PROPAGATING`
    # tells both to look away.
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = _require(ShardingPropagator, "_propagate_tensor_meta_non_cached")

    def propagate(self, *args, **kwargs):
        observe.PROPAGATING[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            observe.PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def apply_all() -> None:
    """Every patch, once per process."""
    if getattr(apply_all, "done", False):
        return
    for patch in (
        patch_autocast,
        patch_device_queries,
        patch_to_empty,
        patch_sdpa,
        patch_ddp,
        patch_device_handle,
        patch_pipelining,
        patch_dtensor_propagation,
    ):
        patch()
    apply_all.done = True
