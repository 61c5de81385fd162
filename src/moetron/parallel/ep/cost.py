"""Expert parallelism in the cost model: the all-to-alls of the routed tokens.

Per MoE layer and micro-batch, 4 all-to-alls of the routed rows × h in the compute dtype (dispatch and combine,
forward and backward; 6 with checkpointing: the recompute repeats the forward two) — DeepSpeed-MoE, Rajbhandari
et al. 2022, §5. Each rank sends (ep−1)/ep of its rows; the group spans ep × etp consecutive ranks.
"""

from __future__ import annotations

from moetron.parallel.dimension import StepContext
from moetron.parallel.ep.memory import routed_rows
from moetron.parallel.terms.rank import compute_bytes, ring_share
from moetron.parallel.tp.memory import activation_split


def ep_seconds(step: StepContext) -> float:
    """The expert-parallel all-to-alls of the slowest GPU's MoE layers in one step."""
    plan = step.plan
    d, model = plan.dims, plan.cfg.model
    moe = [e for e in step.layers if e > 1]
    if d.ep == 1 or not moe:
        return 0.0
    tokens = plan.cfg.train.micro_batch_size * step.local.model.seq_length  # this rank's tokens of a micro-batch
    calls = 6 if model.checkpoint_activations else 4
    share = activation_split(d).routes
    per_micro = sum(routed_rows(model, e, tokens, d.ep) * share * model.hidden_size for e in moe)
    sent = plan.accumulation_steps * calls * per_micro * compute_bytes(plan.cfg) * ring_share(d.ep)
    return step.net.seconds(sent, plan.accumulation_steps * calls * len(moe), d.ep * d.etp)
