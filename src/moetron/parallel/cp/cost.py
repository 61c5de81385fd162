"""Context parallelism in the cost model: the attention's exchanges of keys and values.

Per layer and micro-batch, this rank's K and V blocks `[mbs, seq/cp, kv_heads/tp, head_dim]`:
    all_gather   K, V all-gathered forward ((cp−1) blocks each received, 2 collectives), dK, dV reduce-scattered
                 backward (the same bytes); on the critical path (attention.py)
    p2p          (cp−1) K/V passes forward and (cp−1) backward plus cp passes of the travelling dK/dV (ring.py);
                 posted before each block's compute, so only what exceeds the attention scores' compute is exposed
    a2a          q, k, v and the output all-to-all'd over the cp group forward, and again backward (8 calls,
                 ulysses.py; each rank sends (cp−1)/cp of them); on the critical path
×2 forwards with activation checkpointing; the group spans cp × tp consecutive ranks.
"""

from __future__ import annotations

from moetron.model.flops import attention_score_flops
from moetron.parallel.dimension import StepContext
from moetron.parallel.terms.rank import compute_bytes, ring_share


def cp_seconds(step: StepContext) -> float:
    """The context-parallel attention's K/V traffic of the slowest GPU's layers in one step."""
    plan = step.plan
    d, cfg = plan.dims, plan.cfg
    if d.cp == 1:
        return 0.0
    model, c, m = cfg.model, compute_bytes(cfg), plan.accumulation_steps
    layers = len(step.layers)
    forwards = 2 if model.checkpoint_activations else 1
    tokens = cfg.train.micro_batch_size * model.seq_length // d.cp
    block = tokens * model.kv_heads / d.tp * model.head_dim * c  # this rank's K (or V)
    comm = cfg.parallel.cp_comm_type
    if comm == "a2a":
        moved = tokens * 2 * (model.num_attention_heads + model.kv_heads) / d.tp * model.head_dim * c  # q k v out
        sent, calls = (forwards + 1) * moved * ring_share(d.cp), 4 * (forwards + 1)
    elif comm == "p2p":
        sent, calls = 2 * block * ((forwards + 1) * (d.cp - 1) + d.cp), (forwards + 1) * (d.cp - 1) + d.cp
    else:  # all_gather
        sent, calls = 2 * block * (d.cp - 1) * (forwards + 1), 2 * (forwards + 1)
    seconds = step.net.seconds(m * layers * sent, m * layers * calls, d.cp * d.tp)
    if comm != "p2p":
        return seconds
    scores = m * layers * tokens * attention_score_flops(model, model.seq_length) / d.tp * forwards
    return max(0.0, seconds - scores / (plan.device.peak_tflops * 1e12 * step.efficiency))
