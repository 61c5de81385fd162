"""The MoE router: an fp32 gate, DeepSpeed-exact routing by default, modern routing options on request.

    router = Router(cfg, num_experts=8)            # cfg: a RouterConfig (a ModelConfig is one)
    routing = router(x_TD, seq_len=cfg.seq_length)  # x_TD: the [B, L, D] activations flattened to [T, D]
    loss = lm_loss + cfg.moe_loss_coeff * routing.aux_loss + cfg.moe_z_loss_coeff * routing.z_loss
    ...
    router.update_expert_bias()  # once per optimizer step, by `parallel.expert_bias` (aux-loss-free balancing)

With the default options the routing is DeepSpeed 0.19.x's `TopKGate` (top-1 / top-2 / top-k gating, see
`deepspeed_gating.py`): same capacities, kept routes, weights, aux loss and — from the same torch seed — the same
random choices. Any modern option (sigmoid scores, pre-softmax, forced renormalisation, a scaling factor,
expert-bias balancing, expert groups) switches to the generic top-k path of `generic_gating.py`. The z-loss
and the aux-loss type (global / seq / none) apply to both paths (the losses at the end of this file).

The routing package is three files: this one (the `Router` and the losses it adds), `deepspeed_gating.py` (DeepSpeed's
gating and what every path shares: the `Routing` decision, `TokenRows`, capacity and dropping) and
`generic_gating.py`. The settings are `RouterConfig`'s (`model/config.py`: a `ModelConfig` is one).

Shape legend: T tokens, D hidden size, E experts, K routes per token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetron.errors import ConfigError
from moetron.model.config import RouterConfig
from moetron.model.moe.routing.deepspeed_gating import (
    LOCAL_ROWS,
    Routing,
    RoutingInputError,
    TokenRows,
    balance_loss,
    multiplicative_jitter,
    route_counts,
    route_fraction,
    top1_gating,
    top2_gating,
    topk_gating,
)
from moetron.model.moe.routing.generic_gating import generic_topk_gating

# The routing package's public names: the layer, the dispatchers and context parallelism import them from here.
__all__ = ["Router", "RouterConfig", "Routing", "TokenRows", "route_counts"]


class Router(nn.Module):
    """Token-choice top-k router for one MoE layer.

    Owns `weight` [E, D] (the gate, nn.Linear's default init), buffer `expert_bias` [E] (aux-loss-free
    balancing; selection only) and buffer `load_since_update_E` [E] (fp32 routes per expert accumulated in
    training since the last `update_expert_bias`; expert parallelism all-reduces it before the update).
    """

    def __init__(self, cfg: RouterConfig, num_experts: int):
        super().__init__()
        problems = cfg.routing_problems([num_experts])
        if problems:
            raise ConfigError(problems)
        self.cfg = cfg
        self.num_experts = num_experts
        self.topk = cfg.topk
        self.generic = cfg.uses_generic_path
        # mean of a statistic of this rank's sequences over the other parts of the same sequences (context
        # parallelism sets it: a rank routes only its chunks); the seq and global aux losses' route fractions go
        # through it. None: every sequence is whole here
        self.sequence_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
        # (T, seq_len, device) → where these T tokens sit in the micro-batch (`TokenRows`); context parallelism
        # sets it, so that the random draws and capacity decisions are the one-process run's. None: all are here
        self.token_rows: Callable[[int, int | None, torch.device], TokenRows] | None = None
        self.weight = nn.Parameter(torch.empty(num_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        # Transient (zero after every optimizer step), so it stays out of checkpoints.
        self.register_buffer("load_since_update_E", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear(D, E, bias=False)'s init (same RNG draws), and zero balancing state."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        with torch.no_grad():
            self.expert_bias.zero_()
            self.load_since_update_E.zero_()

    def extra_repr(self) -> str:
        path = "generic" if self.generic else "deepspeed"
        return f"hidden={self.weight.shape[1]}, experts={self.num_experts}, topk={self.topk}, path={path}"

    def gate_logits(self, x_TD: torch.Tensor, rows: TokenRows = LOCAL_ROWS) -> torch.Tensor:
        """fp32 logits [T, E], whatever the input dtype or autocast state (the router always runs in fp32)."""
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            x_TD = x_TD.float()
            if self.cfg.moe_noisy_gate_policy == "Jitter" and self.training:
                x_TD = multiplicative_jitter(x_TD, rows=rows)
            return F.linear(x_TD, self.weight.float())

    def forward(self, x_TD: torch.Tensor, seq_len: int | None = None) -> Routing:
        """Route T tokens. `seq_len`: tokens per sequence (x_TD flattens [B, seq_len, D]); used by the
        sequence-wise aux loss, None = one sequence."""
        rows = LOCAL_ROWS if self.token_rows is None else self.token_rows(x_TD.shape[0], seq_len, x_TD.device)
        logits_TE = self.gate_logits(x_TD, rows)
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            routing = self._route(logits_TE, rows)
            routing = self._with_losses(routing, logits_TE, seq_len)
        if self.training and self.cfg.moe_router_bias_update_rate > 0:
            with torch.no_grad():
                self.load_since_update_E += routing.tokens_per_expert_E.float()
        return routing

    def _route(self, logits_TE: torch.Tensor, rows: TokenRows = LOCAL_ROWS) -> Routing:
        cfg = self.cfg
        capacity_factor = cfg.moe_train_capacity_factor if self.training else cfg.moe_eval_capacity_factor
        if self.generic:
            bias_E = self.expert_bias if cfg.moe_router_bias_update_rate > 0 else None
            return generic_topk_gating(logits_TE, cfg, self.topk, capacity_factor, bias_E, rows)
        drop, min_capacity = cfg.moe_token_dropping, cfg.moe_min_capacity
        if self.topk == 1:
            noisy = cfg.moe_noisy_gate_policy if self.training else None  # TopKGate: no noise in eval
            return top1_gating(logits_TE, capacity_factor, min_capacity, noisy, drop, cfg.moe_use_rts, rows)
        if self.topk == 2:
            sampling = cfg.moe_top2_2nd_expert_sampling  # in train AND eval, as in DeepSpeed
            return top2_gating(logits_TE, capacity_factor, min_capacity, drop, sampling, rows)
        return topk_gating(logits_TE, self.topk, capacity_factor, min_capacity, drop, rows)

    def _with_losses(self, routing: Routing, logits_TE: torch.Tensor, seq_len: int | None) -> Routing:
        """Replace the path's global aux loss when another type is asked for, and add the z-loss."""
        aux_type = self.cfg.moe_aux_loss_type
        if aux_type == "seq":
            routing.aux_loss = sequence_aux_loss(routing.probs_TE, routing.expert_ids_TK, seq_len, self.sequence_mean)
        elif aux_type == "none":
            routing.aux_loss = torch.zeros((), dtype=torch.float32, device=logits_TE.device)
        elif self.sequence_mean is not None:  # global, over sequences split by context parallelism: the whole batch's
            first_choices = not self.generic and self.topk == 2  # GShard's top-2 counts first choices only
            counted_TK = routing.expert_ids_TK[:, :1] if first_choices else routing.expert_ids_TK
            k = 1 if first_choices else self.topk
            routing.aux_loss = split_micro_batch_aux_loss(routing.probs_TE, counted_TK, k, self.sequence_mean)
        routing.z_loss_source = self._z_loss(routing, logits_TE)
        trained_by_a_loss = routing.aux_loss.requires_grad or self.cfg.moe_z_loss_coeff != 0
        if routing.unit_weights and logits_TE.requires_grad and not trained_by_a_loss:
            # The weights are then the gate's only gradient path (0 up to rounding, but a gradient): without it the
            # gate would get none, which optimizers treat as "skip this parameter" and DDP as an unused parameter.
            routing.unit_weights = False
        return routing

    def _z_loss(self, routing: Routing, logits_TE: torch.Tensor):
        """The z-loss (differentiable) when it is trained on; otherwise a detached value computed on first
        read, from each token's first-choice logit and probability (O(T), no [T, E] logsumexp per step)."""
        if self.cfg.moe_z_loss_coeff != 0:
            return z_loss(logits_TE)
        if self.cfg.moe_router_score_function != "softmax":  # probs_TE is not softmax(logits): no shortcut
            return z_loss(logits_TE.detach())
        first_T1 = routing.expert_ids_TK[:, :1]
        logit_T = logits_TE.detach().gather(1, first_T1)
        prob_T = routing.probs_TE.detach().gather(1, first_T1)
        return functools.partial(z_loss_from_route, logit_T, prob_T)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """bias += rate · sign(mean load − load) over the loads accumulated since the last call; reset them.

        Under-loaded experts become more attractive, over-loaded ones less. Only selection sees the bias.
        """
        rate = self.cfg.moe_router_bias_update_rate
        if rate == 0:
            return
        load_E = self.load_since_update_E
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()


# ---------------------------------------------------------------- the losses the router adds
# Switch/GShard's aux loss over sequences (per sequence, or split by context parallelism) and the ST-MoE z-loss,
# each WITHOUT its coefficient (`moe_loss_coeff`, `moe_z_loss_coeff`). B sequences of L tokens, X any leading dims.
def sequence_aux_loss(
    probs_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    seq_len: int | None,
    sequence_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the global formula per sequence, averaged over sequences.

    Tokens are the flattening of [B, L] (each sequence contiguous); `seq_len=None` means one sequence.
    `sequence_mean` (context parallelism: each of N ranks holds L tokens of every sequence) averages the route
    fractions over the sequence's other parts, so they are the whole sequence's; the loss is then linear in the
    local mean probabilities, and its mean over the N ranks (what averaging their gradients and reports does) is
    the whole sequences' loss.
    """
    num_tokens, num_experts = probs_TE.shape
    seq_len = seq_len or num_tokens
    if num_tokens % seq_len:
        raise RoutingInputError(
            f"--moe-aux-loss-type seq: {num_tokens} tokens are not a whole number of {seq_len}-token sequences; "
            f"route whole sequences (x flattened from [B, seq_len, D])"
        )
    mask_TE = torch.zeros_like(probs_TE).scatter_(1, ids_TK, 1.0)
    probs_BLE = probs_TE.view(-1, seq_len, num_experts)
    mask_BLE = mask_TE.view(-1, seq_len, num_experts)
    fraction_BE = mask_BLE.mean(1)
    if sequence_mean is not None:
        fraction_BE = sequence_mean(fraction_BE)
    return balance_loss(probs_BLE.mean(1), fraction_BE, ids_TK.shape[1]).mean()


def split_micro_batch_aux_loss(
    probs_TE: torch.Tensor, counted_ids_TK: torch.Tensor, k: int, sequence_mean: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The `global` aux loss, `balance_loss(mean probability, route fraction, k)`, of a micro-batch whose sequences
    are split over context-parallel ranks (each of N ranks holds an equal part of every sequence).

    Every gating path's global aux loss has this form (DeepSpeed's top-1: k = 1; GShard's top-2: the first
    choices' fractions only, k = 1; top-k and the generic path: every route, k), over the tokens it routes. The
    one-process micro-batch is the union of the ranks' tokens: `sequence_mean` averages the detached route
    fractions over the ranks, so they are the whole micro-batch's, and the loss, linear in the local mean
    probabilities, has as its mean over the N ranks (what averaging their gradients and reports does) the
    one-process loss, gradient included. `counted_ids_TK`: the routes the path counts (before capacity)."""
    num_tokens, num_experts = probs_TE.shape
    fraction_E = sequence_mean(route_fraction(route_counts(counted_ids_TK, num_experts), num_tokens))
    return balance_loss(probs_TE.mean(0), fraction_E, k)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def z_loss_from_route(logit_T: torch.Tensor, prob_T: torch.Tensor) -> torch.Tensor:
    """`z_loss` from one logit and its softmax probability per token: logsumexp = logit − log(prob).

    O(T) instead of O(T·E). Exact up to rounding when the route's probability is not tiny, which holds for
    a token's first choice; only for a z-loss that is reported, not trained on (no gradient)."""
    lse_T = logit_T.float() - prob_T.float().clamp_min(torch.finfo(torch.float32).tiny).log()
    return lse_T.square().mean()
