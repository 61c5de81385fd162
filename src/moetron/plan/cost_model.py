"""The step-time cost model of `moetron plan --search`: compute, communication and the pipeline bubble of one layout.

One optimizer step on one GPU (the slowest pipeline stage's) costs, in seconds,

    compute     training FLOPs of this GPU's share / (peak × efficiency)
    bubble      compute × b / (1 − b),  b = the bubble fraction (plan/pipeline_parallel.py: 1F1B (p−1)/(m+p−1),
                interleaved (p−1)/(v·m+p−1); Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
                on GPU Clusters Using Megatron-LM", §2.2)
    tp          the tensor-/sequence-parallel collectives of this stage's layers (bytes: plan/tensor_parallel.py)
    ep          the expert-parallel all-to-alls (dispatch and combine, forward and backward)
    cp          the context-parallel attention's exchanges of keys and values (`--cp-comm-type`, below)
    dp          the data-parallel gradient reduction and ZeRO's gathers, less what overlaps the backward
    pp          the activations and their gradients sent between pipeline stages
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

    DP, ZeRO 0   all-reduce of the fp32 gradients: dense over dp, each rank's experts over edp (DDP: bucketed,
                 during the last micro-batch's backward)
    ZeRO 1       + all-gather of the updated fp32 parameters after the step (parallel/dp/sharded_optimizer.py)
    ZeRO 2       reduce-scatter of the fp32 gradients after every micro-batch + one all-gather of the weights in
                 the compute dtype per step (parallel/dp/fsdp.py)
    ZeRO 3       reduce-scatter per micro-batch + all-gathers per micro-batch forward and backward
    The DP term overlaps the backward (2/3 of the compute) of the last micro-batch (ZeRO 0–2) or of every
    micro-batch (ZeRO 3, FSDP2 prefetches the next unit's gather); only the rest is exposed.
    Dense groups are dp × cp ranks (`dp_cp`: context-parallel peers hold other tokens of the same samples).
    ZeRO 2–3 under pipelining (parallel/dp/fsdp.py `shard_stage`; torch's PipelineStage): every backward runs with
                 `set_requires_gradient_sync(False)` / `set_reshard_after_backward(False)` and blocks are never
                 resharded after forward, so a stage's weights are all-gathered ONCE per step (its first forward)
                 and its gradients reduce-scattered ONCE (fp32, `perform_reduce_grad` after the step's last
                 backward: nothing left to overlap). With more than 3 stages per rank, torch's runtime schedules
                 (interleaved, zero bubble) keep only 3 stage modules unsharded at a time
                 (`_add_unshard_reshard`), and the gathers per step are counted from its action list
                 (`pipeline_parallel.fsdp_gathers_per_step`). Only the first micro-batch's forward (1/3 of its
                 compute) hides the gathers.
    ZeRO 0–1 under pipelining: DDP's all-reduce during the last backward, as without (zero bubble: after the
                 schedule, split.py `dense_after_backward`, not overlapped).
    CP           per layer and micro-batch, this rank's K and V blocks `[mbs, seq/cp, kv_heads/tp, head_dim]`:
                 all_gather   K, V all-gathered forward ((cp−1) blocks each received, 2 collectives), dK, dV
                              reduce-scattered backward (the same bytes); on the critical path (attention.py)
                 p2p          (cp−1) K/V passes forward and (cp−1) backward plus cp passes of the travelling dK/dV
                              (ring.py); posted before each block's compute, so only what exceeds the attention
                              scores' compute is exposed
                 a2a          q, k, v and the output all-to-all'd over the cp group forward, and again backward
                              (8 calls, ulysses.py; each rank sends (cp−1)/cp of them); on the critical path
                 ×2 forwards with activation checkpointing; the group spans cp × tp consecutive ranks.
    EP           per MoE layer and micro-batch, 4 all-to-alls of the routed rows × h in the compute dtype
                 (dispatch and combine, forward and backward; 6 with checkpointing: the recompute repeats the
                 forward two) — DeepSpeed-MoE, Rajbhandari et al. 2022, §5
    PP           per micro-batch and virtual stage, [mbs, seq, h] activations forward and their gradients back

Links (`INTERCONNECTS`: GB/s one way per GPU, latency per collective), the line rate × `LINK_EFFICIENCY`:
`--gpu-type` picks the defaults of `GPU_LINKS`, `--interconnect` / `--intra-node-bandwidth` /
`--inter-node-bandwidth` override them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moetron.errors import UserError
from moetron.model.flops import attention_score_flops, flops_per_token
from moetron.parallel.pp.stage_layout import MULTI_STAGE, PipelineLayout
from moetron.plan.memory import compute_bytes, routed_rows
from moetron.plan.model_cache import cached
from moetron.plan.pipeline_parallel import fsdp_gathers_per_step, stage_parameters, tensor_parallel_share
from moetron.plan.tensor_parallel import activation_split

DEFAULT_EFFICIENCY = 0.5  # of the peak, for the matmuls (Narayanan et al. 2021: 52 % on A100s)
LINK_EFFICIENCY = 0.8  # large-message bus bandwidth / line rate that NCCL reaches (nccl-tests PERFORMANCE.md)
GPUS_PER_NODE = 8  # default node size for more than 8 GPUs without --nodes (DGX/HGX servers)
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb: one all-reduce per 25 MiB
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


@dataclass(frozen=True)
class StepCost:
    """Seconds per optimizer step on the slowest GPU, by part, and what they give."""

    compute: float
    bubble: float
    tp: float
    ep: float
    dp: float
    pp: float
    overhead: float
    tokens_per_step: int
    model_flops_per_step: float  # 6·N_active + attention per token × tokens (no recompute), all GPUs
    cp: float = 0.0  # context-parallel attention's K/V traffic

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.ep + self.cp + self.dp + self.pp + self.overhead

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    def mfu(self, gpus: int, peak_tflops: float) -> float:
        return self.model_flops_per_step / (self.total * gpus * peak_tflops * 1e12)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "tokens_per_s": self.tokens_per_s}


def _ring(n: int) -> float:
    """Bytes a rank sends per byte of buffer in an all-gather / reduce-scatter / all-to-all of n ranks."""
    return (n - 1) / n if n > 1 else 0.0


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


def _tp_seconds(plan, net: Network) -> float:
    d = plan.dims
    if d.tp == 1:
        return 0.0
    layers = plan.cfg.model.num_layers
    share = len(_stage_layers(plan)) / layers  # plan.tp_comm_bytes counts every layer of the model
    forwards = 2 if plan.cfg.model.checkpoint_activations else 1
    collectives = plan.accumulation_steps * len(_stage_layers(plan)) * 2 * (forwards + 1 + (1 if d.sp else 0))
    share /= d.cp  # plan.tp_comm_bytes counts the whole sequence; a context-parallel rank holds seq / cp of it
    return net.seconds(plan.tp_comm_bytes * share, collectives, d.tp)


def _ep_seconds(plan, net: Network) -> float:
    d, model = plan.dims, plan.cfg.model
    moe = [e for e in _stage_layers(plan) if e > 1]
    if d.ep == 1 or not moe:
        return 0.0
    tokens = plan.cfg.train.micro_batch_size * model.seq_length // d.cp
    calls = 6 if model.checkpoint_activations else 4
    share = activation_split(d).routes
    per_micro = sum(routed_rows(model, e, tokens, d.ep) * share * model.hidden_size for e in moe)
    sent = plan.accumulation_steps * calls * per_micro * compute_bytes(plan.cfg) * _ring(d.ep)
    return net.seconds(sent, plan.accumulation_steps * calls * len(moe), d.ep * d.etp)


def _cp_seconds(plan, net: Network, efficiency: float) -> float:
    """The context-parallel attention's K/V traffic of this GPU's layers (see the module docstring)."""
    d, cfg = plan.dims, plan.cfg
    if d.cp == 1:
        return 0.0
    model, c, m = cfg.model, compute_bytes(cfg), plan.accumulation_steps
    layers = len(_stage_layers(plan))
    forwards = 2 if model.checkpoint_activations else 1
    tokens = cfg.train.micro_batch_size * model.seq_length // d.cp
    block = tokens * model.kv_heads / d.tp * model.head_dim * c  # this rank's K (or V)
    comm = cfg.parallel.cp_comm_type
    if comm == "a2a":
        moved = tokens * 2 * (model.num_attention_heads + model.kv_heads) / d.tp * model.head_dim * c  # q k v out
        sent, calls = (forwards + 1) * moved * _ring(d.cp), 4 * (forwards + 1)
    elif comm == "p2p":
        sent, calls = 2 * block * ((forwards + 1) * (d.cp - 1) + d.cp), (forwards + 1) * (d.cp - 1) + d.cp
    else:  # all_gather
        sent, calls = 2 * block * (d.cp - 1) * (forwards + 1), 2 * (forwards + 1)
    seconds = net.seconds(m * layers * sent, m * layers * calls, d.cp * d.tp)
    if comm != "p2p":
        return seconds
    scores = m * layers * tokens * attention_score_flops(model, model.seq_length) / d.tp * forwards
    return max(0.0, seconds - scores / (plan.device.peak_tflops * 1e12 * efficiency))


def _dp_seconds(plan, net: Network, compute: float) -> float:
    """The exposed part of the gradient reduction and ZeRO's gathers (see the module docstring)."""
    d, stage, m = plan.dims, plan.memory.zero_stage, plan.accumulation_steps
    local = _rank_parameters(plan)
    experts, dense = local.experts, local.total - local.experts
    replicas = d.dp * d.cp  # the dense gradients' group: dp_cp
    extent = replicas * d.tp  # dp and edp groups span one pipeline stage's ranks
    c = compute_bytes(plan.cfg)
    layout = PipelineLayout.from_config(plan.cfg.model.num_layers, plan.cfg.parallel) if d.pp > 1 else None
    if stage == 0 or stage == 1:
        grads = 4 * (dense * 2 * _ring(replicas) + experts * 2 * _ring(d.edp))
        gather = 4 * (dense * _ring(replicas) + experts * _ring(d.edp)) if stage == 1 else 0.0
        calls = math.ceil(4 * (dense + experts) / DDP_BUCKET_BYTES) * (2 if stage == 1 else 1)
        comm, overlap = net.seconds(grads + gather, calls, extent), compute / m * 2 / 3
        if layout is not None and layout.splits_backward:
            overlap = 0.0  # zero bubble: the dense gradients are reduced after the schedule (pp/split.py)
        gathered_after = net.seconds(gather, 0, extent)  # after the step: nothing left to hide it behind
        return max(0.0, comm - gathered_after - overlap) + gathered_after
    sharded = dense * _ring(replicas) + experts * _ring(d.edp)
    if layout is not None:  # FSDP2 per pipeline stage: gathered once per step (or per re-unshard), reduced once
        blocks = len(_stage_layers(plan)) + 1
        gathers = fsdp_gathers_per_step(layout, m)
        gather = net.seconds(gathers * c * sharded, blocks * gathers, extent)
        scatter = net.seconds(4 * sharded, blocks, extent)
        return max(0.0, gather - compute / m / 3) + scatter
    blocks = len(plan.cfg.model.experts_per_layer()) + 1
    scatter = m * 4 * sharded
    gathers = (2 * m if stage == 3 else 1) * c * sharded
    comm = net.seconds(scatter + gathers, blocks * (m + (2 * m if stage == 3 else 1)), extent)
    overlap = compute * 2 / 3 if stage == 3 else compute / m * 2 / 3
    return max(0.0, comm - overlap)


def _rank_parameters(plan):
    """`LocalParams` of the GPU whose reduction is largest: the heaviest pipeline stage's (its tensor-parallel
    share, as the memory plan holds it), or the whole rank's."""
    if not plan.stages:
        return plan.local
    heaviest = max(plan.stages, key=lambda s: s.memory.weights)
    stage = stage_parameters(plan.cfg.model, heaviest.layers, heaviest.first, heaviest.last, plan.dims.ep)
    return tensor_parallel_share(stage, plan.cfg.model, plan.dims)


def _pp_seconds(plan, net: Network) -> float:
    d, cfg = plan.dims, plan.cfg
    if d.pp == 1:
        return 0.0
    layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    v = layout.virtual if layout.schedule in MULTI_STAGE else 1
    seq = cfg.model.seq_length // (d.cp * (d.tp if d.sp else 1))
    message = cfg.train.micro_batch_size * seq * cfg.model.hidden_size * compute_bytes(cfg)
    sends = 2 * plan.accumulation_steps * v  # activations forward, their gradients backward
    return net.seconds(sends * message, sends, d.world_size)


def _overhead_seconds(plan) -> float:
    """Operator launches of this GPU's layers (+ the embedding and head as one more) for every micro-batch."""
    recompute = 4 / 3 if plan.cfg.model.checkpoint_activations else 1.0
    layers = len(_stage_layers(plan)) + 1
    per_op = OP_OVERHEAD_S.get(plan.device.kind, OP_OVERHEAD_S["cuda"])
    return plan.accumulation_steps * layers * KERNELS_PER_LAYER * recompute * per_op


def step_cost(plan, net: Network, efficiency: float = DEFAULT_EFFICIENCY) -> StepCost:
    """The cost of one optimizer step of `plan` (an `estimate.Plan`) on `net`."""
    compute = _compute_seconds(plan, efficiency)
    bubble = compute * plan.bubble / (1 - plan.bubble) if plan.bubble else 0.0
    cfg = plan.cfg
    tokens = cfg.global_batch(plan.dims.dp) * cfg.model.seq_length
    model_flops = tokens * cached(flops_per_token, cfg.model, cfg.model.seq_length)  # per model (the search)
    return StepCost(
        compute=compute,
        bubble=bubble,
        tp=_tp_seconds(plan, net),
        ep=_ep_seconds(plan, net),
        cp=_cp_seconds(plan, net, efficiency),
        dp=_dp_seconds(plan, net, compute),
        pp=_pp_seconds(plan, net),
        overhead=_overhead_seconds(plan),
        tokens_per_step=tokens,
        model_flops_per_step=model_flops,
    )
