"""The experts of one MoE layer, stored as `[E, …]` tensors and run on tokens already sorted by expert.

    experts = GroupedExperts(num_experts=8, hidden=256, ffn=1024, swiglu=False, bias=True)
    y_ND = experts(x_ND, counts_E)  # rows 0..counts_E[0]-1 belong to expert 0, the next counts_E[1] to expert 1, …

Three interchangeable backends compute the same function (`backend`, from `cfg.moe_expert_backend`):
  grouped_mm  one `torch._grouped_mm` per projection (CPU fp32/bf16/fp16 in torch >= 2.9; CUDA sm80+);
              no padding, no host sync. Needs row strides that are multiples of 16 bytes. On CPU a SwiGLU
              expert without biases runs expert by expert instead (`ExpertByExpertSwiGLU`, the same GEMMs).
  batched     rows scattered into a padded `[E, C_max, D]` buffer, then `torch.bmm` (any torch, any device).
  loop        one matmul per expert (the readable reference).
`auto` picks grouped_mm when a tiny probe call succeeds for this device/dtype/shape, else batched.

Expert parallelism: a `GroupedExperts` may hold only the experts `expert_offset … expert_offset + E_local − 1`
of a layer with `num_global_experts`; initialisation draws global expert g's weights from a generator seeded
by (seed, layer_index, g), so any slice of experts holds exactly the weights the full layer has there.

Shape legend: N routed rows (sorted by expert), E local experts, D hidden size, F ffn size per expert.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

from moetron.model.init import stable_seed
from moetron.model.mlp import gelu

BACKENDS = ("auto", "grouped_mm", "batched", "loop")


# ---------------------------------------------------------------- backend selection
@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Probe `torch._grouped_mm` once per (device type, dtype): availability differs by build and GPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype)
        w = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        offs = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
        return bool(torch._grouped_mm(x, w, offs=offs)[0, 0].item() == 8)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """True when `torch._grouped_mm` runs here and every row of width in `dims` is 16-byte aligned."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(d * itemsize % 16 == 0 for d in dims) and _grouped_mm_runs(device.type, dtype)


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()  # the grouped_mm backward rejects expanded (stride-0) gradients


# ---------------------------------------------------------------- the three backends: [N, A] x [E, A, B] -> [N, B]
def grouped_matmul(x_NA: torch.Tensor, w_EAB: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows offsets_E[e-1]..offsets_E[e]-1 of x times w_EAB[e], in one kernel (offsets: int32 cumulative ends)."""
    return torch._grouped_mm(x_NA, w_EAB, offs=offsets_E)


def loop_matmul(x_NA: torch.Tensor, w_EAB: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: one matmul per expert (unbind, not w[e], so the backward stacks once instead of E times)."""
    pieces = [x_e @ w_AB for x_e, w_AB in zip(x_NA.split(counts), w_EAB.unbind(0), strict=True)]
    return torch.cat(pieces) if pieces else x_NA.new_empty(0, w_EAB.shape[-1])


class PaddedLayout:
    """Where each sorted row lives in a padded `[E, C, ·]` buffer (C = the largest count), for bmm."""

    def __init__(self, counts_E: torch.Tensor):
        num_experts = counts_E.numel()
        self.capacity = int(counts_E.max().item()) if num_experts else 0
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        expert_N = torch.repeat_interleave(torch.arange(num_experts, device=counts_E.device), counts_E)
        rank_N = torch.arange(expert_N.numel(), device=counts_E.device) - starts_E[expert_N]
        self.slot_N = expert_N * self.capacity + rank_N
        self.num_experts = num_experts

    def pad(self, x_NA: torch.Tensor) -> torch.Tensor:
        buffer = x_NA.new_zeros(self.num_experts * self.capacity, x_NA.shape[-1])
        return buffer.index_copy(0, self.slot_N, x_NA).view(self.num_experts, self.capacity, x_NA.shape[-1])

    def unpad(self, x_ECA: torch.Tensor) -> torch.Tensor:
        return x_ECA.reshape(-1, x_ECA.shape[-1]).index_select(0, self.slot_N)


_HUGE_PAGE = 2 << 20
_OWN_MAPPING_BYTES = 32 << 20  # glibc serves larger blocks from a fresh mmap every time (its mmap ceiling)
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable | None:
    """libc's madvise on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def empty_for_gradient(like: torch.Tensor) -> torch.Tensor:
    """`torch.empty_like(like)`, backed by transparent huge pages when it is a large CPU buffer on Linux.

    An [E, D, F] weight gradient is a fresh mmap every step (zero_grad(set_to_none=True) frees it), and
    faulting it in 4 KiB at a time cost ~25 ms per 64 MiB here — a fifth of the layer's step at E=128.
    With the MADV_HUGEPAGE hint the kernel maps 2 MiB pages: ~6x less. Only a hint: it changes no value,
    and anything unexpected leaves the plain allocation. (torch's THP_MEM_ALLOC_ENABLE does the same for
    every allocation, but must be set before torch starts.)
    """
    out = torch.empty_like(like)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and nbytes >= _OWN_MAPPING_BYTES else None
    if madvise is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the 2 MiB-aligned interior of the buffer
        end = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        madvise(start, end - start, _MADV_HUGEPAGE)  # a refused hint (errno) changes nothing
    return out


class ExpertByExpertSwiGLU(torch.autograd.Function):
    """`(silu(x·w1) * (x·w3))·w2` on rows sorted by expert, running each expert's WHOLE MLP (and then its
    whole backward) before the next expert's.

    On CPU `torch._grouped_mm` is a loop of one mm per expert, so the three grouped projections stream
    every expert's rows and [N, F] activations through memory three times forward and more backward.
    Expert by expert, an expert's rows and activations are reused from cache by its next GEMM: ~10% less
    CPU time than the grouped projections (or one bmm per projection) at E=64, D=128, F=256.
    Same per-expert mm calls on the same operands as the grouped_mm fallback, so the same values.
    Saves x·w1 and x·w3 only; silu(x·w1) and the product are recomputed per expert in the backward.
    """

    @staticmethod
    def forward(ctx, x_ND, w1_EDF, w3_EDF, w2_EFD, counts: list[int]):
        y_ND = x_ND.new_empty(x_ND.shape[0], w2_EFD.shape[-1])
        # Per-expert activation tensors, not one [N, F] buffer: allocations past glibc's 32 MiB mmap ceiling
        # get fresh pages every step, and faulting them in cost more system time than the GEMMs they feed.
        a_list, b_list = [], []
        # Views made in bulk (split/unbind): the per-expert Python work is a visible cost at E = 128.
        for x_e, y_e, w1_DF, w3_DF, w2_FD in zip(
            x_ND.split(counts), y_ND.split(counts), w1_EDF.unbind(0), w3_EDF.unbind(0), w2_EFD.unbind(0), strict=True
        ):
            a_e, b_e = torch.mm(x_e, w1_DF), torch.mm(x_e, w3_DF)
            torch.mm(torch.nn.functional.silu(a_e) * b_e, w2_FD, out=y_e)
            a_list.append(a_e)
            b_list.append(b_e)
        ctx.save_for_backward(x_ND, w1_EDF, w3_EDF, w2_EFD)
        ctx.activations, ctx.counts = (a_list, b_list), counts
        return y_ND

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ND):
        x_ND, w1_EDF, w3_EDF, w2_EFD = ctx.saved_tensors
        counts = ctx.counts
        grad_x = x_ND.new_empty(x_ND.shape) if ctx.needs_input_grad[0] else None
        grad_w1, grad_w3, grad_w2 = (empty_for_gradient(w) for w in (w1_EDF, w3_EDF, w2_EFD))
        per_expert = zip(
            grad_ND.split(counts),
            x_ND.split(counts),
            *ctx.activations,
            grad_x.split(counts) if grad_x is not None else [None] * len(counts),
            w1_EDF.transpose(1, 2).unbind(0),
            w3_EDF.transpose(1, 2).unbind(0),
            w2_EFD.transpose(1, 2).unbind(0),
            grad_w1.unbind(0),
            grad_w3.unbind(0),
            grad_w2.unbind(0),
            strict=True,
        )
        for g_e, x_e, a_e, b_e, gx_e, w1_FD, w3_FD, w2_DF, gw1_DF, gw3_DF, gw2_FD in per_expert:
            silu_e = torch.nn.functional.silu(a_e)
            torch.mm((silu_e * b_e).t(), g_e, out=gw2_FD)
            dh_e = torch.mm(g_e, w2_DF)
            db_e = dh_e * silu_e  # the autograd graph's MulBackward and SiluBackward, op for op
            da_e = torch.ops.aten.silu_backward(dh_e * b_e, a_e)
            x_DN = x_e.t()
            torch.mm(x_DN, da_e, out=gw1_DF)
            torch.mm(x_DN, db_e, out=gw3_DF)
            if gx_e is not None:
                torch.mm(da_e, w1_FD, out=gx_e).add_(torch.mm(db_e, w3_FD))
        ctx.activations = None
        return grad_x, grad_w1, grad_w3, grad_w2, None


def _expert_by_expert(x_ND: torch.Tensor, w1_EDF, w3_EDF, w2_EFD, counts_E: torch.Tensor) -> torch.Tensor:
    with torch.autocast(device_type=x_ND.device.type, enabled=False):  # operands are already in compute dtype
        return ExpertByExpertSwiGLU.apply(x_ND, w1_EDF, w3_EDF, w2_EFD, counts_E.tolist())


# ---------------------------------------------------------------- the module
class GroupedExperts(nn.Module):
    """E feed-forward experts, `y = act(x·w1 [+ b1]) [· (x·w3)] · w2 [+ b2]`, weights stored as `[E, …]`.

    `activation` applies to the first projection (GELU, or SiLU for SwiGLU by default). GELU is Megatron's
    bias-GELU fusion (tanh approximation, `moetron.model.mlp.gelu`) so an expert computes exactly what the
    dense `ParallelMLP` it replaces computes. Expert math runs in the input dtype (the autocast dtype under
    autocast); parameters stay in their own dtype.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        swiglu: bool,
        bias: bool,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
        backend: str = "auto",
        expert_offset: int = 0,
        num_global_experts: int | None = None,
    ):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"--moe-expert-backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.swiglu, self.backend = swiglu, backend
        self.activation = activation or (nn.functional.silu if swiglu else gelu)
        self.expert_offset = expert_offset
        self.num_global_experts = num_global_experts or num_experts
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3_EDF = nn.Parameter(torch.empty(num_experts, hidden, ffn)) if swiglu else None
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.b1_EF = nn.Parameter(torch.empty(num_experts, ffn)) if bias else None
        self.b2_ED = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        if not self.w1_EDF.is_meta:  # meta-built models are initialised after `to_empty` instead
            self.reset_parameters()

    def extra_repr(self) -> str:
        first, last = self.expert_offset, self.expert_offset + self.num_experts - 1
        return (
            f"experts={first}..{last} of {self.num_global_experts}, hidden={self.hidden}, ffn={self.ffn}, "
            f"swiglu={self.swiglu}, bias={self.b1_EF is not None}, backend={self.backend}"
        )

    # ------------------------------------------------------------ initialisation
    @torch.no_grad()
    def reset_parameters(
        self, std: float = 0.02, out_std: float = 0.02, seed: int = 0, *key: object, identical: bool = False
    ) -> None:
        """Local expert i gets global expert (expert_offset + i)'s weights from the generator of
        (seed, *key, global id): N(0, std) for w1/w3, N(0, out_std) for w2, zero biases.
        `identical`: every expert takes expert 0's draw (DeepSpeed's deep copies of one template)."""
        for local in range(self.num_experts):
            global_id = 0 if identical else self.expert_offset + local
            name = "/".join(str(part) for part in (*key, "expert", global_id))
            generator = torch.Generator(device="cpu").manual_seed(stable_seed(seed, name))
            for weight, weight_std in ((self.w1_EDF, std), (self.w3_EDF, std), (self.w2_EFD, out_std)):
                if weight is not None:  # draw on CPU, then copy: identical on every device
                    draw = torch.empty(weight.shape[1:], dtype=torch.float32).normal_(
                        0.0, weight_std, generator=generator
                    )
                    weight[local].copy_(draw)
        for b in (self.b1_EF, self.b2_ED):
            if b is not None:
                b.zero_()

    # ------------------------------------------------------------ forward
    def resolved_backend(self, x_ND: torch.Tensor) -> str:
        if self.backend != "auto":
            return self.backend
        ok = grouped_mm_supported(x_ND.device, x_ND.dtype, self.hidden, self.ffn)
        return "grouped_mm" if ok else "batched"

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ND: rows sorted by local expert; counts_E (int64 [E]): rows per expert (sums to N)."""
        if counts_E.numel() != self.num_experts:
            raise ValueError(
                f"got token counts for {counts_E.numel()} experts but this module holds {self.num_experts} "
                f"(experts {self.expert_offset}.. of {self.num_global_experts}); a layer holding a slice of the "
                f"experts needs an expert-parallel dispatcher that sends it only its experts' rows"
            )
        x_ND = x_ND.to(_compute_dtype(x_ND))
        backend = self.resolved_backend(x_ND)
        if backend == "grouped_mm" and self._runs_expert_by_expert(x_ND):
            dtype = x_ND.dtype
            return _expert_by_expert(x_ND, *(w.to(dtype) for w in (self.w1_EDF, self.w3_EDF, self.w2_EFD)), counts_E)
        if backend == "grouped_mm":
            matmul = functools.partial(grouped_matmul, offsets_E=torch.cumsum(counts_E, 0, dtype=torch.int32))
        elif backend == "batched":
            matmul = functools.partial(_padded_matmul, layout=PaddedLayout(counts_E))
        else:
            matmul = functools.partial(loop_matmul, counts=counts_E.tolist())
        expert_N = None
        if self.b1_EF is not None:
            expert_N = torch.repeat_interleave(torch.arange(self.num_experts, device=x_ND.device), counts_E)
        y_ND = self._mlp(x_ND, matmul, functools.partial(_add_row_bias, expert_N=expert_N))
        if y_ND.requires_grad and backend == "grouped_mm":
            y_ND.register_hook(_contiguous_grad)
        return y_ND

    def _runs_expert_by_expert(self, x_ND: torch.Tensor) -> bool:
        """CPU, SwiGLU with SiLU, no biases: the case `ExpertByExpertSwiGLU` implements."""
        plain_swiglu = self.w3_EDF is not None and self.b1_EF is None and self.activation is nn.functional.silu
        return plain_swiglu and x_ND.device.type == "cpu"

    def dense_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The single expert applied to every row ([..., D] -> [..., D]): the dense-MLP form (needs E == 1)."""
        if self.num_experts != 1:
            raise ValueError(f"dense_forward needs exactly one expert, this module holds {self.num_experts}")
        x_TD = x_TD.to(_compute_dtype(x_TD))
        return self._mlp(x_TD, _single_matmul, _add_single_bias)

    def _mlp(self, x_ND: torch.Tensor, matmul: Callable, add_bias: Callable) -> torch.Tensor:
        dtype = x_ND.dtype
        h_NF = matmul(x_ND, self.w1_EDF.to(dtype))
        if self.b1_EF is not None:
            h_NF = add_bias(h_NF, self.b1_EF.to(dtype))
        h_NF = self.activation(h_NF)
        if self.w3_EDF is not None:
            h_NF = h_NF * matmul(x_ND, self.w3_EDF.to(dtype))
        y_ND = matmul(h_NF, self.w2_EFD.to(dtype))
        if self.b2_ED is not None:
            y_ND = add_bias(y_ND, self.b2_ED.to(dtype))
        return y_ND


def _add_row_bias(h_NA: torch.Tensor, b_EA: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
    return h_NA + b_EA.index_select(0, expert_N)


def _add_single_bias(h_TA: torch.Tensor, b_1A: torch.Tensor) -> torch.Tensor:
    return h_TA + b_1A[0]


def _single_matmul(x_TA: torch.Tensor, w_1AB: torch.Tensor) -> torch.Tensor:
    return x_TA @ w_1AB[0]


def _padded_matmul(x_NA: torch.Tensor, w_EAB: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    return layout.unpad(torch.bmm(layout.pad(x_NA), w_EAB))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device (and x is floating), else x's own dtype."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def init_expert_weights(experts: GroupedExperts, std: float, out_std: float, seed: int, layer_index: int) -> None:
    """Initialise a layer's experts by GLOBAL expert id from (seed, layer_index, id) — layout-free."""
    experts.reset_parameters(std, out_std, seed, layer_index)
