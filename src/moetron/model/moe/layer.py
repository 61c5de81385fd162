"""One MoE layer: router → dispatcher → grouped experts → dispatcher, plus the optional dense branches.

    layer = MoELayer(cfg, num_experts=8, layer_index=1)
    y_BTD, aux = layer(x_BTD)
    lm_loss.backward()  # the router also gets d(aux.loss(cfg))/d(router): the aux loss is attached to y_BTD

`aux.loss(cfg)` = moe_loss_coeff · aux.aux_loss + moe_z_loss_coeff · aux.z_loss is attached to the output by
`aux_loss.attach_aux_loss` (its gradient arrives when y's backward runs), so no caller adds it to the loss; a caller
that multiplies the LM loss by a factor sets `aux_loss_grad_scale` to it (`aux_loss.aux_loss_grad_scale`).
In training the layer reports its routing statistics (on device) to the step record the executor gave it
(`stats.MoEStepRecord`, read once per optimizer step).

Options (reference: deepspeed-moe.md §4, modern-moe.md §1.4):
  residual MoE (`cfg.mlp_type == "residual"`, PR-MoE): a dense MLP of the expert size beside the experts,
    mixed per token by `p = softmax(coefficient(x))`: out = moe·p0 + mlp·p1.
  shared experts (`cfg.num_shared_experts`): always-on experts fused into one MLP of
    num_shared·expert_ffn channels, added to the routed output; `cfg.shared_expert_gate` scales it by
    sigmoid(x·w_gate) (Qwen2-MoE / Megatron-Core's shared expert gate).
The router runs in fp32; experts run in the input dtype (the autocast dtype under autocast). The layer
does no communication: expert parallelism swaps `self.dispatcher` and builds the layer with only its
local experts (`expert_offset`, `num_local_experts`).

Shape legend: B batch, T tokens per sequence, D hidden size, N kept routes, E experts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.init import seeded_draw, seeded_generator
from moetron.model.moe.aux_loss import attach_aux_loss
from moetron.model.moe.dispatch import LocalDispatcher, TokenDispatcher, ep_load_of
from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.routing.router import Router, Routing
from moetron.model.moe.stats import MoEStats, MoEStepRecord


@dataclass
class MoEAux:
    """What one MoE layer reports besides its output. The losses are NOT multiplied by their coefficients:
    the model (or `loss(cfg)`) applies moe_loss_coeff and moe_z_loss_coeff."""

    aux_loss: torch.Tensor  # fp32 scalar, differentiable (to the router)
    tokens_per_expert_E: torch.Tensor  # int64 [E], routes per expert before dropping (detached)
    dropped_routes: torch.Tensor  # int64 scalar: routes cut by capacity (device tensor, no host sync)
    capacity: int | torch.Tensor  # per-expert capacity: a host int, or (dropless) a 0-dim device tensor
    routing: Routing  # the full routing decision, for reports (routing.stats())

    @property
    def z_loss(self) -> torch.Tensor:
        """fp32 scalar router z-loss (differentiable when moe_z_loss_coeff != 0; else computed when read)."""
        return self.routing.z_loss

    def loss(self, cfg: ModelConfig) -> torch.Tensor:
        """moe_loss_coeff · aux_loss + moe_z_loss_coeff · z_loss (fp32 scalar)."""
        return cfg.moe_loss_coeff * self.aux_loss.float() + cfg.moe_z_loss_coeff * self.z_loss.float()


def step_stats(aux: MoEAux, ep_load: torch.Tensor | None = None) -> MoEStats:
    """This forward's routing statistics (one layer, on device): see `MoEStats`."""
    routes = aux.routing.kept_TK.numel()
    return MoEStats.measure(aux.tokens_per_expert_E, aux.dropped_routes, routes, aux.aux_loss, aux.z_loss, ep_load)


def routing_distribution(aux: MoEAux) -> torch.Tensor:
    """[2, E] fp32 of one forward: routes per expert, and the router's probability of each expert averaged over the
    tokens (the mean routing distribution; zeros where the router does not expose its probabilities)."""
    routes_E = aux.tokens_per_expert_E.float()
    probs_TE = aux.routing.probs_TE
    mean_E = (
        probs_TE.detach().float().mean(0) if probs_TE is not None and probs_TE.numel() else torch.zeros_like(routes_E)
    )
    return torch.stack([routes_E, mean_E])


def _dense_mlp(cfg: ModelConfig, ffn: int) -> GroupedExperts:
    """A dense MLP is a one-expert GroupedExperts (same math and init rules as the experts)."""
    return GroupedExperts(1, cfg.hidden_size, ffn, cfg.swiglu, cfg.add_bias_linear, backend="loop")


def _generator(seed: int, *key: object) -> torch.Generator:
    return seeded_generator(seed, "/".join(str(part) for part in key))


@torch.no_grad()
def _fill(param: torch.Tensor, generator: torch.Generator, low: float | None = None, std: float | None = None) -> None:
    """Draw on CPU (uniform(-low, low) or N(0, std)) and copy: the same values on every device and layout."""
    param.copy_(seeded_draw(param.shape, generator, std=std, low=low if std is None else None))


class MoELayer(nn.Module):
    """Router + experts + dispatcher (+ residual MLP and coefficient, + shared experts and their gate)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_experts: int,
        layer_index: int,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
    ):
        super().__init__()
        self.cfg, self.num_experts, self.layer_index = cfg, num_experts, layer_index
        hidden, ffn = cfg.hidden_size, cfg.expert_ffn_size
        self.router = Router(cfg, num_experts)
        self.experts = GroupedExperts(
            num_local_experts or num_experts,
            hidden,
            ffn,
            cfg.swiglu,
            cfg.add_bias_linear,
            backend=cfg.moe_expert_backend,
            expert_offset=expert_offset,
            num_global_experts=num_experts,
        )
        self.dispatcher: TokenDispatcher = LocalDispatcher(num_experts)
        self.mlp = _dense_mlp(cfg, ffn) if cfg.mlp_type == "residual" else None
        self.coefficient = nn.Linear(hidden, 2) if cfg.mlp_type == "residual" else None
        shared = cfg.num_shared_experts
        self.shared_experts = _dense_mlp(cfg, shared * ffn) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared and cfg.shared_expert_gate else None
        # the gradient of the attached aux loss: what the caller multiplies its LM loss by (`aux_loss.py`)
        self.aux_loss_grad_scale = 1.0
        self.step_record: MoEStepRecord | None = None  # where training forwards report (the executor's)

    def extra_repr(self) -> str:
        return f"layer_index={self.layer_index}, dispatcher={self.dispatcher!r}"

    # ------------------------------------------------------------ forward
    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        """y_BTD (the input's shape; the compute dtype) and the layer's MoEAux."""
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.router(x_TD, seq_len=x_BTD.shape[-2] if x_BTD.dim() == 3 else None)
        shared_TD = None
        overlapped = getattr(self.dispatcher, "dispatch_compute_combine", None)
        if overlapped is not None:  # EP overlap: experts run chunk by chunk between the all-to-alls, shared beside
            beside = self._shared if self.shared_experts is not None else None
            y_TD, ctx, shared_TD = overlapped(x_TD, routing, self.experts, beside)
        else:
            x_ND, counts_E, ctx = self.dispatcher.dispatch(x_TD, routing)
            y_TD = self.dispatcher.combine(self.experts(x_ND, counts_E), ctx)
        if self.mlp is not None:
            p_T2 = torch.softmax(self.coefficient(x_TD), dim=-1)
            y_TD = y_TD * p_T2[:, :1] + self.mlp.dense_forward(x_TD) * p_T2[:, 1:]
        if self.shared_experts is not None:
            y_TD = y_TD + (self._shared(x_TD) if shared_TD is None else shared_TD)
        aux = self._aux(routing)
        if self.training and self.step_record is not None:  # a recompute's report is dropped (`recomputing`)
            self.step_record.add(self.layer_index, step_stats(aux, ep_load_of(ctx)), routing_distribution(aux))
        return attach_aux_loss(y_TD.reshape(x_BTD.shape), aux.loss(self.cfg), self.aux_loss_grad_scale), aux

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """The block is activation checkpointing's recomputation of a forward that already ran and reported: what
        it reports is dropped again. The same record and the same branch as in the forward, rather than a flag: a
        compiled block then reruns a graph it already has (a flag would be a new guard, and compiling inside the
        backward is what AOTAutograd's cache mishandles: `parallel/compile.py`)."""
        record = self.step_record
        kept = record.layer_report(self.layer_index) if record is not None else None
        try:
            yield
        finally:
            if record is not None:
                record.restore_layer_report(self.layer_index, kept)

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        out_TD = self.shared_experts.dense_forward(x_TD)
        if self.shared_expert_gate is not None:
            out_TD = out_TD * torch.sigmoid(self.shared_expert_gate(x_TD))
        return out_TD

    @staticmethod
    def _aux(routing: Routing) -> MoEAux:
        dropped = (~routing.kept_TK).sum()
        return MoEAux(
            routing.aux_loss,
            routing.tokens_per_expert_E.detach(),
            dropped,
            # an int, or (dropless) a 0-dim device tensor: not read here; `routing.capacity` is the int on demand
            routing.capacity_source,
            routing,
        )

    # ------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, seed: int) -> None:
        """Initialise everything this layer owns from (seed, layer_index) only, never the global RNG, so the
        result does not depend on construction order, device or expert-parallel layout. The one init path: the
        model's `init_weights` calls it (`model/init.py`); the constructor leaves its parts' defaults.

        router gate: nn.Linear's default (uniform ±1/sqrt(D)); experts: per global expert id, N(0, std) and
        N(0, out_std) for the output projection, zero biases (`moe_identical_expert_init`: all = expert 0);
        residual MLP: its own stream (DeepSpeed's template, = expert 0, under identical init);
        coefficient: nn.Linear's default; shared experts: N(0, std)/N(0, out_std); shared gate: N(0, std)."""
        layer, hidden = self.layer_index, self.cfg.hidden_size
        _fill(self.router.weight, _generator(seed, layer, "router"), low=1 / math.sqrt(hidden))
        for name in ("expert_bias", "load_since_update_E"):
            if hasattr(self.router, name):
                getattr(self.router, name).zero_()
        identical = self.cfg.moe_identical_expert_init
        self.experts.reset_parameters(std, out_std, seed, layer, identical=identical)
        if self.mlp is not None:
            key = (layer,) if identical else (layer, "residual_mlp")
            self.mlp.reset_parameters(std, out_std, seed, *key, identical=identical)
            _fill(self.coefficient.weight, _generator(seed, layer, "coefficient.weight"), low=1 / math.sqrt(hidden))
            _fill(self.coefficient.bias, _generator(seed, layer, "coefficient.bias"), low=1 / math.sqrt(hidden))
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std, out_std, seed, layer, "shared_experts")
        if self.shared_expert_gate is not None:
            _fill(self.shared_expert_gate.weight, _generator(seed, layer, "shared_expert_gate"), std=std)
