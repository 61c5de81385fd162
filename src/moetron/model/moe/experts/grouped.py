"""The experts of one MoE layer, stored as `[E, …]` tensors and run on tokens already sorted by expert.

    experts = GroupedExperts(num_experts=8, hidden=256, ffn=1024, swiglu=False, bias=True)
    y_ND = experts(x_ND, counts_E)  # rows 0..counts_E[0]-1 belong to expert 0, the next counts_E[1] to expert 1, …

Rows past Σ counts_E (the dispatcher's dropped routes) are not computed; their output is unspecified and
their gradient ignored. `counts_E` may also be an `ExpertCounts`, whose host capacity bound lets the
batched backend pad without reading the counts.

Three interchangeable backends compute the same function (`backend`, from `cfg.moe_expert_backend`; see
`backends.py`): grouped_mm (one grouped GEMM per projection), batched (padded bmm), loop (the
reference). `auto` picks grouped_mm where it runs without host syncs, else batched (`auto_backend`). Where
reading the device is free (a CPU tensor), a SwiGLU expert without biases runs through the device's experts
backend instead where it has one (`model/backends.py`; on CPU expert by expert, `moetron/cpu/experts.py`: the same
GEMMs, better cache reuse).

Expert parallelism: a `GroupedExperts` may hold only the experts `expert_offset … expert_offset + E_local − 1`
of a layer with `num_global_experts`; initialisation draws global expert g's weights from a generator seeded
by (seed, layer_index, g), so any slice of experts holds exactly the weights the full layer has there.
Expert tensor parallelism may also keep only a slice of every expert's ffn channels (`param_slices`, see
`moetron.model.init`): each expert is drawn at its full shape and sliced, for the same reason.

Shape legend: N routed rows (sorted by expert), E local experts, D hidden size, F ffn size per expert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from moetron.model.autocast_dtype import autocast_dtype
from moetron.model.backends import experts_backend
from moetron.model.init import TensorSlice, param_slice, seeded_draw, seeded_generator
from moetron.model.mlp import gelu
from moetron.model.moe.dispatch import ExpertCounts, PermuteRows, gather_rows
from moetron.model.moe.experts.backends import (
    BACKENDS,
    AlignedGroups,
    PaddedLayout,
    auto_backend,
    expert_of_rows,
    grouped_matmul,
    loop_matmul,
    padded_matmul,
)


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()  # the grouped_mm backward rejects expanded (stride-0) gradients


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
            generator = seeded_generator(seed, name)
            for weight_name, weight_std in (("w1_EDF", std), ("w3_EDF", std), ("w2_EFD", out_std)):
                weight = getattr(self, weight_name)
                if weight is not None:  # draw on CPU at the full expert shape, then copy: identical everywhere
                    part = param_slice(self, weight_name)  # a tensor-parallel slice of the ffn channels
                    expert_part = TensorSlice(part.full_shape[1:], part.index[1:]) if part else None
                    weight[local].copy_(seeded_draw(weight.shape[1:], generator, std=weight_std, part=expert_part))
        for b in (self.b1_EF, self.b2_ED):
            if b is not None:
                b.zero_()

    # ------------------------------------------------------------ forward
    def resolved_backend(self, x_ND: torch.Tensor) -> str:
        return self.backend if self.backend != "auto" else auto_backend(x_ND.device, x_ND.dtype, self.hidden, self.ffn)

    def forward(self, x_ND: torch.Tensor, counts: torch.Tensor | ExpertCounts) -> torch.Tensor:
        """x_ND: rows sorted by local expert (or in token order: `ExpertCounts.token_order`, see `TokenOrder`);
        counts: int64 [E] rows per expert (or an `ExpertCounts`)."""
        if not isinstance(counts, ExpertCounts):
            counts = ExpertCounts(counts)
        counts_E, capacity, order = counts.counts_E, counts.capacity, counts.token_order
        if counts_E.numel() != self.num_experts:
            raise ValueError(
                f"got token counts for {counts_E.numel()} experts but this module holds {self.num_experts} "
                f"(experts {self.expert_offset}.. of {self.num_global_experts}); a layer holding a slice of the "
                f"experts needs an expert-parallel dispatcher that sends it only its experts' rows"
            )
        x_ND = x_ND.to(autocast_dtype(x_ND))
        backend = self.resolved_backend(x_ND)
        if backend == "grouped_mm" and self._runs_expert_by_expert(x_ND):
            dtype = x_ND.dtype
            weights = (w.to(dtype) for w in (self.w1_EDF, self.w3_EDF, self.w2_EFD))
            tokens_N = order.order_R if order is not None else None
            return experts_backend(x_ND.device).swiglu(x_ND, *weights, counts_E, tokens_N)
        if order is not None:  # these backends take rows sorted by expert: permute here, and back after
            y_ND = self._sorted_rows(
                PermuteRows.apply(x_ND, order.order_R, order.inverse_R), counts_E, capacity, backend
            )
            return PermuteRows.apply(y_ND, order.inverse_R, order.order_R)
        return self._sorted_rows(x_ND, counts_E, capacity, backend)

    def _sorted_rows(
        self, x_ND: torch.Tensor, counts_E: torch.Tensor, capacity: int | None, backend: str
    ) -> torch.Tensor:
        """The experts on rows sorted by expert, by the grouped, batched or loop backend."""
        num_rows = x_ND.shape[0]
        if backend == "grouped_mm":  # on groups aligned for the grouped kernel (zero padding rows)
            groups = AlignedGroups(counts_E, num_rows)
            matmul = functools.partial(grouped_matmul, offsets_E=groups.offsets_E)
            expert_P = groups.buffer_experts() if self.b1_EF is not None else None
            y_PD = self._mlp(groups.scatter(x_ND), matmul, functools.partial(_add_row_bias, expert_N=expert_P))
            if y_PD.requires_grad:
                y_PD.register_hook(_contiguous_grad)
            return groups.gather(y_PD)
        if backend == "batched":
            matmul = functools.partial(padded_matmul, layout=PaddedLayout(counts_E, num_rows, capacity))
        else:
            matmul = functools.partial(loop_matmul, counts=counts_E.tolist())
        expert_N = expert_of_rows(counts_E, num_rows) if self.b1_EF is not None else None
        return self._mlp(x_ND, matmul, functools.partial(_add_row_bias, expert_N=expert_N))

    def _runs_expert_by_expert(self, x_ND: torch.Tensor) -> bool:
        """SwiGLU with SiLU, no biases, where the device's experts backend runs it (the CPU's, which reads the
        counts on the host: free there)."""
        plain_swiglu = self.w3_EDF is not None and self.b1_EF is None and self.activation is nn.functional.silu
        return plain_swiglu and experts_backend(x_ND.device).runs_swiglu(x_ND)

    def runs_experts_backend_on_cpu(self) -> bool:
        """Whether a CPU fp32 forward runs the experts backend's SwiGLU (the CPU's splits the experts over its
        threads, `moetron/cpu/threads.py`)."""
        x_0D = torch.empty(0, self.hidden)
        return self.resolved_backend(x_0D) == "grouped_mm" and self._runs_expert_by_expert(x_0D)

    def dense_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The single expert applied to every row ([..., D] -> [..., D]): the dense-MLP form (needs E == 1)."""
        if self.num_experts != 1:
            raise ValueError(f"dense_forward needs exactly one expert, this module holds {self.num_experts}")
        x_TD = x_TD.to(autocast_dtype(x_TD))
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
            y_ND = add_bias(y_ND, self.output_bias(dtype))
        return y_ND

    def output_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The second projection's bias `b2_ED` in `dtype`. Experts split by tensor parallelism along the ffn
        channels sum their partial outputs over the group, so they add it on one rank only (they override this)."""
        return self.b2_ED.to(dtype)


def _add_row_bias(h_NA: torch.Tensor, b_EA: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
    """Each row's expert bias; rows of no expert (E: past the counts) read the last one and send no gradient
    to it (their h is never computed, so their gradient is unspecified)."""
    has_expert_N = expert_N < b_EA.shape[0]
    return h_NA + gather_rows(b_EA, expert_N.clamp(max=b_EA.shape[0] - 1), has_expert_N)


def _add_single_bias(h_TA: torch.Tensor, b_1A: torch.Tensor) -> torch.Tensor:
    return h_TA + b_1A[0]


def _single_matmul(x_TA: torch.Tensor, w_1AB: torch.Tensor) -> torch.Tensor:
    return x_TA @ w_1AB[0]
