"""The three ways `GroupedExperts` multiplies rows sorted by expert with per-expert weights, and the rule
its `auto` backend follows.

    y_RB = matmul(x_RA, w_EAB)   # rows 0..counts_E[0]-1 times w_EAB[0], the next counts_E[1] times w_EAB[1], …

Rows past N = Σ counts_E are dropped routes that the dispatcher appends (static shapes): no backend
computes them, and their output rows are unspecified (uninitialised memory on grouped_mm).

  grouped_mm  one `torch._grouped_mm` per projection on groups aligned to GROUP_ALIGN rows (`AlignedGroups`:
              each expert's rows start at a multiple of 8, the padding rows zeros, the dropped routes in no
              group), and no host sync where torch runs a grouped kernel (see `auto_backend`). Needs row
              strides that are multiples of 16 bytes.
  batched     rows scattered into a padded `[E, C + 1, A]` buffer, then one `torch.bmm` (any torch, any device).
              C = the capacity when the router knows it on the host (capacity-factor mode); otherwise the
              largest count, read from the device: the ONE host sync this backend makes (dropless mode).
  loop        one matmul per expert: the readable reference (reads the counts on the host).

Shape legend: R rows sorted by expert, N of them computed, E experts, A input and B output width.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "grouped_mm", "batched", "loop")


# ---------------------------------------------------------------- which backend `auto` picks
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


def cuda_grouped_mm_is_a_grouped_kernel(dtype: torch.dtype, capability: tuple[int, int], rocm: bool) -> bool:
    """Whether torch's CUDA `_grouped_mm` runs one grouped kernel here, rather than its host-synchronising loop.

    `_grouped_mm_cuda` (aten/src/ATen/native/cuda/GroupedBlas.cpp) takes its fast path — a CUTLASS grouped
    GEMM that reads the offsets on the device — only when mat_a, mat_b and the output are all bf16 and
    `scaled_mm_arch_allowed(sm90_only=true, sm100_only=true)` holds: compute capability major 9 (Hopper) or
    10 (Blackwell). Everything else goes to `_grouped_mm_fallback`, which copies the offsets to the host
    (`offs.cpu()`) and runs one mm per expert: a host sync in every projection, forward and backward.
    On ROCm the fast path needs a CK build and gfx942/gfx950; treated as the fallback. (Builds against
    CUDA >= 13.3 may also use cuBLASLt's grouped GEMM for fp16; not relied on.)
    """
    return not rocm and dtype == torch.bfloat16 and capability[0] in (9, 10)


def auto_backend(device: torch.device, dtype: torch.dtype, *dims: int) -> str:
    """`auto`: grouped_mm where it needs no host sync and the row widths `dims` are 16-byte aligned, else batched.

    CPU: grouped_mm whenever it runs (torch >= 2.9): its loop of mm reads the offsets from host memory,
    which waits for nothing. CUDA: grouped_mm only where `cuda_grouped_mm_is_a_grouped_kernel`, because the
    fallback loop syncs in every projection; batched syncs at most once per layer (dropless) or never.
    Other devices: batched.
    """
    if device.type == "cuda":
        fast = cuda_grouped_mm_is_a_grouped_kernel(
            dtype, torch.cuda.get_device_capability(device), rocm=torch.version.hip is not None
        )
        return "grouped_mm" if fast and grouped_mm_supported(device, dtype, *dims) else "batched"
    if device.type == "cpu" and grouped_mm_supported(device, dtype, *dims):
        return "grouped_mm"
    return "batched"


# ---------------------------------------------------------------- the three backends: [R, A] x [E, A, B] -> [R, B]
def grouped_matmul(x_RA: torch.Tensor, w_EAB: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows offsets_E[e-1]..offsets_E[e]-1 of x times w_EAB[e], in one kernel (offsets: int32 cumulative ends;
    rows past the last offset are not computed)."""
    return torch._grouped_mm(x_RA, w_EAB, offs=offsets_E)


def loop_matmul(x_RA: torch.Tensor, w_EAB: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: one matmul per expert (unbind, not w[e], so the backward stacks once instead of E times).
    Rows past the counts come out as zeros."""
    tail = x_RA.shape[0] - sum(counts)
    rows_per_expert = x_RA.split([*counts, tail])[: len(counts)]
    pieces = [x_e @ w_AB for x_e, w_AB in zip(rows_per_expert, w_EAB.unbind(0), strict=True)]
    if tail:
        pieces.append(x_RA.new_zeros(tail, w_EAB.shape[-1]))
    return torch.cat(pieces) if pieces else x_RA.new_empty(0, w_EAB.shape[-1])


def expert_of_rows(counts_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [R]: each sorted row's expert; rows past Σ counts_E get E (no expert). No host sync: the output
    size is given, and the tail is one more group, so the repeats sum to it exactly."""
    num_experts = counts_E.numel()
    tail = (num_rows - counts_E.sum()).reshape(1)
    experts = torch.arange(num_experts + 1, device=counts_E.device)
    return torch.repeat_interleave(experts, torch.cat([counts_E, tail]), output_size=num_rows)


GROUP_ALIGN = 8  # rows: the grouped kernels' alignment for 16-bit types (torchtitan's TOKEN_GROUP_ALIGN_SIZE_M)


class AlignedGroups:
    """Rows sorted by expert placed so that every expert's group starts at a multiple of `align` rows, for
    `torch._grouped_mm`: a zero-filled `[P, ·]` buffer of a size known without reading the device
    (P = R + E·(align − 1) + 1), its last row the place of the dropped routes (past every group: never computed,
    and their outputs and gradients are zeros)."""

    def __init__(self, counts_E: torch.Tensor, num_rows: int, align: int = GROUP_ALIGN):
        num_experts = counts_E.numel()
        self.num_rows, self.size = num_rows, num_rows + num_experts * (align - 1) + 1
        padded_E = (counts_E + align - 1) // align * align
        self.offsets_E = torch.cumsum(padded_E, 0, dtype=torch.int32)  # each group's end, in the buffer
        expert_R = expert_of_rows(counts_E, num_rows)
        self.valid_R = expert_R < num_experts
        first_row_E = torch.cumsum(counts_E, 0) - counts_E  # where each expert's rows start among the sorted rows
        expert_R = expert_R.clamp(max=max(num_experts - 1, 0))
        if num_experts:
            within_R = torch.arange(num_rows, device=counts_E.device) - first_row_E[expert_R]
            place_R = (self.offsets_E.long() - padded_E)[expert_R] + within_R
        else:
            place_R = torch.zeros(num_rows, dtype=torch.long, device=counts_E.device)
        self.place_R = torch.where(self.valid_R, place_R, self.size - 1)
        self.expert_P = None  # each buffer row's expert, for the biases (built on first use)
        self._padded_E = padded_E

    def scatter(self, x_RA: torch.Tensor) -> torch.Tensor:
        kept_RA = torch.where(self.valid_R[:, None], x_RA, 0)  # a dropped route's row gets no gradient
        return x_RA.new_zeros(self.size, x_RA.shape[1]).index_copy(0, self.place_R, kept_RA)

    def gather(self, y_PB: torch.Tensor) -> torch.Tensor:
        return torch.where(self.valid_R[:, None], y_PB.index_select(0, self.place_R), 0)

    def buffer_experts(self) -> torch.Tensor:
        """int64 [P]: each buffer row's expert (E for the rows past every group)."""
        if self.expert_P is None:
            self.expert_P = expert_of_rows(self._padded_E, self.size)
        return self.expert_P


class PaddedLayout:
    """Where each sorted row lives in a padded `[E, C + 1, ·]` buffer, for bmm.

    C bounds every count: `capacity` when the caller knows one on the host, else the largest count (read
    from the device: one host sync). The extra slot per expert takes the rows past Σ counts_E (all of them
    into the last expert's extra slot), so that they neither need a host-side count nor overwrite a row.
    """

    def __init__(self, counts_E: torch.Tensor, num_rows: int, capacity: int | None = None):
        num_experts = counts_E.numel()
        if capacity is None:
            capacity = int(counts_E.max()) if num_experts else 0  # the batched backend's host sync (dropless)
        self.num_experts, self.slots = num_experts, capacity + 1
        expert_R = expert_of_rows(counts_E, num_rows)
        first_row_E = torch.cumsum(counts_E, 0) - counts_E
        rank_R = torch.arange(num_rows, device=counts_E.device) - first_row_E[expert_R.clamp(max=num_experts - 1)]
        spare = num_experts * self.slots - 1  # the last expert's extra slot
        self.slot_R = torch.where(expert_R < num_experts, expert_R * self.slots + rank_R, spare)

    def pad(self, x_RA: torch.Tensor) -> torch.Tensor:
        buffer = x_RA.new_zeros(self.num_experts * self.slots, x_RA.shape[-1])
        return buffer.index_copy(0, self.slot_R, x_RA).view(self.num_experts, self.slots, x_RA.shape[-1])

    def unpad(self, x_ECA: torch.Tensor) -> torch.Tensor:
        return x_ECA.reshape(-1, x_ECA.shape[-1]).index_select(0, self.slot_R)


def padded_matmul(x_RA: torch.Tensor, w_EAB: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """The batched backend: pad into [E, C + 1, A], one bmm, read the rows back out."""
    return layout.unpad(torch.bmm(layout.pad(x_RA), w_EAB))
