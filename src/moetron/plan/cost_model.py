"""The step-time cost model of `moetron plan --search`: compute, communication and the pipeline bubble of one layout.

One optimizer step on one GPU (the slowest pipeline stage's) costs, in seconds,

    compute     training FLOPs of this GPU's share / (peak × efficiency)
    bubble      compute × b / (1 − b),  b = the bubble fraction (parallel/pp/cost.py: 1F1B (p−1)/(m+p−1),
                interleaved (p−1)/(v·m+p−1); Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
                on GPU Clusters Using Megatron-LM", §2.2)
    tp, ep, cp, dp, pp   each parallel dimension's communication (`Dimension.step_seconds`, in its
                `parallel/<dim>/cost.py`): the tensor-/sequence-parallel collectives of this stage's layers, the
                expert-parallel all-to-alls, the context-parallel attention's exchanges of keys and values, the
                data-parallel gradient reduction and ZeRO's gathers less what overlaps the backward, and the
                activations and their gradients sent between pipeline stages
    overhead    per micro-batch and layer, a fixed cost of eager execution: KERNELS_PER_LAYER operator launches
                (forward and backward of attention and MLP/MoE; ×4/3 with checkpointing) × the device's per-op
                cost (`OP_OVERHEAD_S`). Small on GPUs; on CPU it is what makes many small micro-batches slow

and the step is their sum: nothing but DP/ZeRO traffic is assumed to overlap compute (Megatron's TP collectives
and the MoE all-to-all sit on the critical path; DDP and FSDP2 launch their collectives during the backward).

Compute. FLOPs per token are 6·N_active + attention (model/flops.py: Kaplan et al. 2020; Narayanan et al. 2021
eq. 3), ×4/3 with activation checkpointing (one more forward, Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4); a GPU computes its data-parallel rank's tokens, split over its
tensor-parallel ranks, and with pipelining only its stage's layers. `efficiency` is the share of the datasheet
peak that the kernels reach (default 0.5: Megatron-LM sustains 52 % of an A100's peak at 1T parameters,
Narayanan et al. 2021, Table 1; smaller matmuls get less, so lower it for small hidden sizes).

Collectives (ring algorithms, Thakur et al. 2005 "Optimization of Collective Communication Operations in MPICH";
the same bytes as NCCL's bus bandwidth, nccl-tests docs/PERFORMANCE.md) on a group of n ranks and a buffer of
B bytes, each rank sends
    all-reduce               2·(n−1)/n · B
    all-gather, reduce-scatter  (n−1)/n · B
    all-to-all               (n−1)/n · B
and the time is sent bytes / link bandwidth + latency × collectives. The link is the intra-node one when the
group's ranks share a node (ranks are laid out TP innermost, then DP, then PP: parallel/dims.py), else the
inter-node one (a ring is as slow as its slowest hop).

Each dimension's collectives, their bytes and what overlaps them are described in its `parallel/<dim>/cost.py`.

Links (`INTERCONNECTS`: GB/s one way per GPU, latency per collective), the line rate × `LINK_EFFICIENCY`:
`--gpu-type` picks the defaults of `GPU_LINKS`, `--interconnect` / `--intra-node-bandwidth` /
`--inter-node-bandwidth` override them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from moetron.errors import UserError
from moetron.model.flops import flops_per_token
from moetron.parallel.dimension import StepContext
from moetron.parallel.dimensions import DIMENSIONS
from moetron.parallel.terms.model_cache import cached
from moetron.parallel.terms.rank import LocalParams
from moetron.plan.memory_terms import rank_view
from moetron.plan.stages import stage_parameters, tensor_parallel_share

DEFAULT_EFFICIENCY = 0.5  # of the peak, for the matmuls (Narayanan et al. 2021: 52 % on A100s)
LINK_EFFICIENCY = 0.8  # large-message bus bandwidth / line rate that NCCL reaches (nccl-tests PERFORMANCE.md)
GPUS_PER_NODE = 8  # default node size for more than 8 GPUs without --nodes (DGX/HGX servers)
KERNELS_PER_LAYER = 100  # operators one layer runs per micro-batch, forward + backward (an estimate for eager mode)
# seconds per operator beyond its arithmetic: a CUDA kernel launch (~5 µs, the CUDA C++ Best Practices Guide's
# order of magnitude); on CPU eager dispatch and autograd bookkeeping, fitted to the CPU time per step that
# `moetron plan --measure` reads on 4 gloo ranks (benchmarks/RESULTS.md: ~30 ms per micro-batch of a 4-layer MoE)
OP_OVERHEAD_S = {"cuda": 5e-6, "cpu": 60e-6}


@dataclass(frozen=True)
class Link:
    gbps: float  # line rate, GB/s one way per GPU
    latency_s: float  # per collective
    source: str


INTERCONNECTS = {
    "nvlink4": Link(450, 10e-6, "H100 SXM: NVLink 4, 900 GB/s bidirectional per GPU (NVIDIA H100 datasheet)"),
    "nvlink3": Link(300, 10e-6, "A100 SXM: NVLink 3, 600 GB/s bidirectional per GPU (NVIDIA A100 datasheet)"),
    "nvlink2": Link(150, 10e-6, "V100 SXM2: NVLink 2, 300 GB/s bidirectional per GPU (NVIDIA V100 datasheet)"),
    "pcie5": Link(64, 15e-6, "PCIe 5.0 x16: 64 GB/s one way (PCI-SIG)"),
    "pcie4": Link(32, 15e-6, "PCIe 4.0 x16: 32 GB/s one way (PCI-SIG); RTX 4090s have no NVLink or P2P"),
    "ib-ndr": Link(50, 20e-6, "InfiniBand NDR 400 Gb/s, one NIC per GPU (DGX H100: 8 × ConnectX-7)"),
    "ib-hdr": Link(25, 20e-6, "InfiniBand HDR 200 Gb/s, one NIC per GPU (DGX A100: 8 × ConnectX-6)"),
    "ib-edr": Link(12.5, 20e-6, "InfiniBand EDR 100 Gb/s per GPU (DGX-1/DGX-2 era V100 clusters)"),
    "ethernet-100g": Link(12.5 / 8, 30e-6, "one 100 GbE NIC shared by the node's GPUs (8): 1.56 GB/s per GPU"),
    "gloo": Link(2.0, 100e-6, "gloo between CPU processes of one host (loopback TCP): a few GB/s, ~100 µs a call"),
}
# --gpu-type → (intra-node link, inter-node link)
GPU_LINKS = {
    "H100": ("nvlink4", "ib-ndr"),
    "H200": ("nvlink4", "ib-ndr"),
    "A100-80GB": ("nvlink3", "ib-hdr"),
    "A100-40GB": ("nvlink3", "ib-hdr"),
    "V100-16GB": ("nvlink2", "ib-edr"),
    "V100-32GB": ("nvlink2", "ib-edr"),
    "5090": ("pcie5", "ethernet-100g"),
    "4090": ("pcie4", "ethernet-100g"),
    "3090": ("pcie4", "ethernet-100g"),
    "A6000": ("pcie4", "ethernet-100g"),
    "L40S": ("pcie4", "ethernet-100g"),
    "cpu": ("gloo", "gloo"),
}
DEFAULT_LINKS = ("pcie4", "ethernet-100g")  # a GPU outside the table


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra: Link
    inter: Link
    words: str  # for the report: "NVLink 3 within 8-GPU nodes, IB HDR between"

    def link(self, extent: int) -> Link:
        """The link of a group whose ranks lie within `extent` consecutive ranks."""
        return self.intra if extent <= self.gpus_per_node else self.inter

    def seconds(self, sent_bytes: float, collectives: float, extent: int) -> float:
        if sent_bytes <= 0:
            return 0.0
        link = self.link(extent)
        return sent_bytes / (link.gbps * 1e9 * LINK_EFFICIENCY) + collectives * link.latency_s


def network(gpus: int, nodes: int | None, device_name: str, interconnect: str | None = None,
            intra_gbps: float | None = None, inter_gbps: float | None = None) -> Network:  # fmt: skip
    """The links of `gpus` GPUs on `nodes` nodes (default: one node up to 8 GPUs, else nodes of 8)."""
    if nodes is None:
        nodes = 1 if gpus <= GPUS_PER_NODE else math.ceil(gpus / GPUS_PER_NODE)
    if nodes < 1 or gpus % nodes:
        raise UserError(f"--nodes {nodes} does not divide --gpus {gpus}; give a node count with equal GPUs per node")
    names = GPU_LINKS.get(device_name, DEFAULT_LINKS)
    if interconnect:
        given = [n.strip() for n in interconnect.split(",")]
        unknown = [n for n in given if n not in INTERCONNECTS]
        if unknown or len(given) > 2:
            raise UserError(
                f"--interconnect {interconnect!r}: give INTRA[,INTER] from {', '.join(INTERCONNECTS)}, e.g. "
                "nvlink3,ib-hdr (or set --intra-node-bandwidth / --inter-node-bandwidth in GB/s)"
            )
        names = (given[0], given[1] if len(given) == 2 else names[1])
    intra, inter = INTERCONNECTS[names[0]], INTERCONNECTS[names[1]]
    for flag, value in (("--intra-node-bandwidth", intra_gbps), ("--inter-node-bandwidth", inter_gbps)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} {value} must be > 0 (GB/s one way per GPU, e.g. 300 for NVLink 3)")
    if intra_gbps:
        intra, names = Link(intra_gbps, intra.latency_s, "--intra-node-bandwidth"), (f"{intra_gbps:g} GB/s", names[1])
    if inter_gbps:
        inter, names = Link(inter_gbps, inter.latency_s, "--inter-node-bandwidth"), (names[0], f"{inter_gbps:g} GB/s")
    per_node = gpus // nodes
    words = f"{names[0]} within {nodes} node(s) of {per_node} GPU(s)" + (f", {names[1]} between" if nodes > 1 else "")
    if gpus == 1:
        words = "one GPU: no communication"
    return Network(per_node, intra, inter, words)


# the step's parts in the search table's order (its columns, and the order `StepCost.total` adds them in); a
# dimension not listed here is added after the listed ones
COLUMN_ORDER = ("tp", "ep", "cp", "dp", "pp")


def communication_parts() -> list[str]:
    """The registered dimensions' names, in the table's order."""
    names = [d.name for d in DIMENSIONS]
    return sorted(names, key=lambda n: COLUMN_ORDER.index(n) if n in COLUMN_ORDER else len(COLUMN_ORDER))


@dataclass(frozen=True)
class StepCost:
    """Seconds per optimizer step on the slowest GPU, by part, and what they give."""

    compute: float
    bubble: float
    overhead: float
    tokens_per_step: int
    model_flops_per_step: float  # 6·N_active + attention per token × tokens (no recompute), all GPUs
    communication: dict[str, float]  # seconds per parallel dimension ("tp", "ep", ...), in the table's order

    def part(self, name: str) -> float:
        """Seconds of one part: compute, bubble, overhead or a dimension's communication."""
        return self.communication[name] if name in self.communication else getattr(self, name)

    @property
    def total(self) -> float:
        seconds = self.compute + self.bubble
        for part in self.communication.values():
            seconds += part
        return seconds + self.overhead

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    def mfu(self, gpus: int, peak_tflops: float) -> float:
        return self.model_flops_per_step / (self.total * gpus * peak_tflops * 1e12)


def _compute_seconds(plan, efficiency: float) -> float:
    """This GPU's training FLOPs per step / achieved FLOP/s (the slowest stage's with pipelining)."""
    cfg, d = plan.cfg, plan.dims
    tokens = cfg.global_batch(d.dp) * cfg.model.seq_length / (d.dp * d.cp)  # this data-/context-parallel rank's
    per_token = max(s.flops_per_token for s in plan.stages) if plan.stages else plan.flops_per_token
    recompute = 4 / 3 if cfg.model.checkpoint_activations else 1.0
    return tokens / d.tp * per_token * recompute / (plan.device.peak_tflops * 1e12 * efficiency)


def _stage_layers(plan) -> list[int]:
    """Expert counts of the layers the slowest GPU holds (all layers without pipelining)."""
    experts = plan.cfg.model.experts_per_layer()
    if not plan.stages:
        return experts
    heaviest = max(plan.stages, key=lambda s: s.flops_per_token)
    return [experts[i] for i in heaviest.layers]


def _rank_parameters(plan) -> LocalParams:
    """`LocalParams` of the GPU whose reduction is largest: the heaviest pipeline stage's (its tensor-parallel
    share, as the memory plan holds it), or the whole rank's."""
    if not plan.stages:
        return plan.local
    heaviest = max(plan.stages, key=lambda s: s.memory.weights)
    stage = stage_parameters(plan.cfg.model, heaviest.layers, heaviest.first, heaviest.last, plan.dims.ep)
    return tensor_parallel_share(stage, plan.cfg.model, plan.dims)


def _overhead_seconds(plan) -> float:
    """Operator launches of this GPU's layers (+ the embedding and head as one more) for every micro-batch."""
    recompute = 4 / 3 if plan.cfg.model.checkpoint_activations else 1.0
    layers = len(_stage_layers(plan)) + 1
    per_op = OP_OVERHEAD_S.get(plan.device.kind, OP_OVERHEAD_S["cuda"])
    return plan.accumulation_steps * layers * KERNELS_PER_LAYER * recompute * per_op


def step_context(plan, net: Network, compute: float, efficiency: float = DEFAULT_EFFICIENCY) -> StepContext:
    """What the dimensions' cost hooks read: `plan` on `net`, with `compute` seconds of compute."""
    local = rank_view(plan.cfg, plan.dims)
    return StepContext(plan, local, net, compute, efficiency, _stage_layers(plan), _rank_parameters(plan))


def step_cost(plan, net: Network, efficiency: float = DEFAULT_EFFICIENCY) -> StepCost:
    """The cost of one optimizer step of `plan` (an `estimate.Plan`) on `net`."""
    compute = _compute_seconds(plan, efficiency)
    bubble = compute * plan.bubble / (1 - plan.bubble) if plan.bubble else 0.0
    cfg = plan.cfg
    tokens = cfg.global_batch(plan.dims.dp) * cfg.model.seq_length
    model_flops = tokens * cached(flops_per_token, cfg.model, cfg.model.seq_length)  # per model (the search)
    step = step_context(plan, net, compute, efficiency)
    seconds = {d.name: d.step_seconds(step) for d in DIMENSIONS}
    return StepCost(
        compute=compute,
        bubble=bubble,
        overhead=_overhead_seconds(plan),
        tokens_per_step=tokens,
        model_flops_per_step=model_flops,
        communication={name: seconds[name] for name in communication_parts()},
    )


def priced(plan, net: Network, efficiency: float = DEFAULT_EFFICIENCY):
    """`plan` with the step time `plan --search` gives its layout (one model for both commands): its `StepCost`
    on `net`, at `efficiency` of the peak for the matmuls."""
    cost = step_cost(plan, net, efficiency)
    return replace(plan, step_time_s=cost.total, cost=cost, efficiency=efficiency)
