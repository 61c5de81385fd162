"""Muon for the hidden weight matrices, AdamW for everything else, in one optimizer (`--optimizer muon`).

Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Moonshot 2025) steps a matrix W with gradient G by

    B ← μ·B + (1 − μ)·G                         momentum (an EMA, as torch's and Keller Jordan's)
    U ← (1 − μ)·G + μ·B   (Nesterov)  or  B     the update before orthogonalisation
    O ← NewtonSchulz5(U)                        ≈ U's polar factor (singular values pulled into ~[0.7, 1.2])
    W ← W·(1 − lr·wd) − lr·scale(m, n)·O        decoupled weight decay, as AdamW's

`scale` is Megatron-Core's `--muon-scale-mode` times `--muon-extra-scale-factor`; moetron's default `spectral` ×
0.2 is Moonlight's rule 0.2·sqrt(max(m, n)): an orthogonal m×n matrix has RMS 1/sqrt(max(m, n)), so the update's RMS
is 0.2, what AdamW's updates have in practice, and AdamW's learning rate and weight decay carry over (Moonlight §2.2;
Megatron-Core's default factor is 1.0, which needs a Muon-specific learning rate). The scale is taken from the shape
of the matrix orthogonalised (the whole one, or one TP block under `--muon-tp-mode blockwise`).

Attention's fused QKV weight is three projections in one tensor, so by default (`--muon-split-qkv`, Megatron-Core's
default; `--muon-no-split-qkv` turns it off) its Q rows (heads · head dim), K rows and V rows (key/value heads · head
dim each) are orthogonalised as three matrices, each scaled by its own shape — as Megatron-Core does, and as any
Muon does on a model with separate q/k/v projections (Hugging Face's layout). moetron's rows are grouped by key/value
head (`model/attention.py`), so the three are gathered out of the groups and put back in place. A TP rank holds
whole groups: `duplicated` gathers them into the one-process matrix first, `blockwise` splits its own groups.

Which parameters are matrices is the parameter registry's (`ParamInfo.matrix`): Linear weights of attention and MLPs
and the routed experts' `[E, in, out]` stacks, each expert orthogonalised as its own matrix in one batched iteration.
Embeddings, the LM head, the router and other gates, norms and biases are AdamW's (`torch.optim.adam.adam`, the
kernel `torch.optim.AdamW` runs, with the same state keys `exp_avg`, `exp_avg_sq`, `step`).

Why not `torch.optim.Muon` (torch 2.13 has one): it accepts only 2-D parameters (experts are 3-D stacks), runs its
Newton–Schulz in bfloat16 on every device, and orthogonalises whatever tensor it is given — under ZeRO that is a
shard, whose orthogonalisation is not a slice of the whole matrix's. Here each matrix is made whole first
(`parallel/whole_matrix.py`: the gather ZeRO 1–3 and TP need, and what it costs); the quintic coefficients are
torch's (Keller Jordan's). Newton–Schulz runs in bfloat16 on CUDA (as theirs: tensor cores, and the iteration
tolerates it) and in float32 elsewhere (CPU bfloat16 matmuls are slower, and layouts compare at 1e-5 on CPU).
Under data parallelism the gradients are already reduced when the step runs, so every replica computes the same O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

from moetron.model.attention import fuse_qkv, split_qkv_weight
from moetron.parallel.params import ParamInfo
from moetron.parallel.whole_matrix import TP_MODES

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def orthogonalise(update: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton–Schulz quintic iteration towards the polar factor of every matrix of `update` [..., m, n] (a batch of
    experts is one batched iteration). Returns the input's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(newton_schulz_dtype(update.device))
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)  # spectral norm ≤ Frobenius norm ≤ 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).to(update.dtype)


def update_scale(mode: str, fan_out: int, fan_in: int, extra: float) -> float:
    """Megatron-Core's `_muon_scale_factor` (`--muon-scale-mode`) times `--muon-extra-scale-factor`."""
    if mode == "spectral":
        base = max(fan_out, fan_in) ** 0.5
    elif mode == "shape_scaling":
        base = max(1.0, fan_out / fan_in) ** 0.5
    else:  # unit_rms_norm
        base = (fan_out / fan_in) ** 0.5
    return base * extra


def scaled_orthogonal(update: torch.Tensor, info: ParamInfo, group: dict) -> torch.Tensor:
    """The step direction of one whole matrix (or expert stack): orthogonalised and scaled by its shape, or for a
    fused QKV weight under `split_qkv` its Q, K and V rows each on their own."""
    if not (group.get("split_qkv") and info.qkv_heads is not None):
        return _scaled_orthogonal_matrix(update, info, group)
    queries_per_group, head_dim = info.qkv_heads
    rows_per_group = (queries_per_group + 2) * head_dim
    if update.shape[0] % rows_per_group:  # whole key/value groups always: TP splits by groups
        raise ValueError(f"{info.name}: {update.shape[0]} rows are not whole QKV groups of {rows_per_group} rows")
    groups = update.shape[0] // rows_per_group
    q, k, v = split_qkv_weight(update, groups * queries_per_group, groups)
    parts = (_scaled_orthogonal_matrix(part, info, group) for part in (q, k, v))
    return fuse_qkv(*parts, groups * queries_per_group, groups)


def _scaled_orthogonal_matrix(update: torch.Tensor, info: ParamInfo, group: dict) -> torch.Tensor:
    orthogonal = orthogonalise(update, group["ns_steps"])
    fan_out, fan_in = info.fan_out_in(tuple(update.shape))
    return orthogonal * update_scale(group["scale_mode"], fan_out, fan_in, group["extra_scale_factor"])


@dataclass
class MatrixPlan:
    info: ParamInfo
    part: object  # parallel.whole_matrix: whole(local) / mine(whole)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.AdamW):
    """AdamW groups (`muon: False`) and Muon groups (`muon: True`, with `momentum`, `nesterov`, `ns_steps`,
    `scale_mode`, `extra_scale_factor`, optionally `split_qkv`) in one optimizer: one state, one LR schedule, one
    checkpoint. `plans`: each Muon parameter's registry entry and how it is made whole (by `id`)."""

    def __init__(self, groups: list[dict], plans: dict[int, MatrixPlan], **adamw):
        super().__init__(groups, **adamw)
        self.plans = plans

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(param)
            grad, buf = _local(param.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            plan = self.plans[id(param)]
            direction = scaled_orthogonal(plan.part.whole(update), plan.info, group)
            weight = _local(param)
            weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(plan.part.mine(direction).to(weight.dtype), alpha=-lr)

    def _adamw_group(self, group: dict) -> None:
        """`torch.optim.Adam.step`'s body for one group (decoupled weight decay: AdamW)."""
        from torch.optim.adam import adam

        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
            decoupled_weight_decay=True,
        )


def muon_problems(train) -> list[str]:
    """The Muon flags' problems (validate.py reports them with every other problem)."""
    t, problems = train, []
    if t.optimizer not in ("adam", "muon"):
        problems.append(f"--optimizer {t.optimizer!r} is not one of adam, muon")
    if not 0 <= t.muon_momentum < 1:
        problems.append(f"--muon-momentum {t.muon_momentum} must be in [0, 1) (Muon's default: 0.95)")
    if not 1 <= t.muon_num_ns_steps < 100:
        problems.append(f"--muon-num-ns-steps {t.muon_num_ns_steps} must be between 1 and 99 (default: 5)")
    if t.muon_scale_mode not in SCALE_MODES:
        problems.append(f"--muon-scale-mode {t.muon_scale_mode!r} is not one of {', '.join(SCALE_MODES)}")
    if not (math.isfinite(t.muon_extra_scale_factor) and t.muon_extra_scale_factor > 0):
        problems.append(
            f"--muon-extra-scale-factor {t.muon_extra_scale_factor} must be positive (0.2: AdamW's update RMS)"
        )
    if t.muon_tp_mode not in TP_MODES:
        problems.append(f"--muon-tp-mode {t.muon_tp_mode!r} is not one of {', '.join(TP_MODES)}")
    return problems
