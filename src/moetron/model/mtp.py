"""Multi-token prediction (`--mtp-num-layers D`): DeepSeek-V3's sequential MTP modules, Megatron-Core's flags.

Shapes: B batch, T tokens, C hidden size. Module k (k = 1 … D) sees, at position i, the previous depth's hidden
state h^{k-1}_i and the embedding of token t_{i+k}, and predicts t_{i+k+1}:

    h^0   = the model's final_layernorm(last layer's output)        # what its own head reads
    h'_i  = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])      # 2C → C; embedding first, as Megatron-Core and
    h^k   = module k's final_layernorm(transformer layer(h'))      # DeepSeek-V3's released weights order them
    loss_k = CE(head(h^k), t_{i+k+1})                              # the model's own embedding and output head

Every depth reads the state after a final norm, as Megatron-Core does (its decoder block applies the final layernorm
before `MultiTokenPredictionBlock` runs, and each MTP layer returns its own final layernorm's output, which the
next depth and the head share) and as transformers' `MtpModel` does (`generate(use_mtp=True)` hands it
`hidden_states[-1]`, the normed last state, and chains each layer's `post_norm` output, DeepSeek's
`shared_head.norm`). The head reads each norm through its own call (under tensor parallelism the norm's output is
laid out for the vocabulary-parallel head); the next depth reads it through `chain_input`, which tensor
parallelism sets to turn that layout back into the module input's (`parallel/tp/apply_tp.py`).

The shifted tokens and labels are the micro-batch's rolled left by k; the k positions at the end that would need
tokens past the sequence are masked out of loss_k (Megatron-Core's `roll_tensor`). The MTP loss is the mean of the
D losses; the trainer adds `--mtp-loss-scaling-factor` times it to the LM loss (Megatron-Core: factor / D × Σ).

Each module's transformer layer is built like the last main layer: a MoE layer in a MoE model (DeepSeek-V3's MTP
block is one; Megatron-Core builds it from the decoder's layer spec), keyed as layer num_layers + k − 1 (its router's
random draws, its row in the routing statistics). Its aux loss reaches its router the way every MoE layer's does
(attached to its output, `moe/aux_loss.py`), its selection-only expert bias is updated with the others
(`GPTModel.moe_layers()` lists it), and `--mtp-dense-layers` makes it a dense layer of --ffn-hidden-size channels.
`GPTOutput.moe_loss` (a report) sums the main layers' aux losses only. Generation never runs the modules.
Layouts: data, tensor (the layer on the main layers' TP plan, the shared head vocab-parallel:
`parallel/tp/apply_tp.py`), sequence (each module's input shard gathered for the shift and eh_proj, eh_proj's
output scattered back into the layer's SP plan, `_mtp_plan`), pipeline (the modules on the last stage with copies
of the embeddings: `parallel/pp/split.py`) and expert parallelism (a MoE MTP layer's experts sharded and dispatched
over the EP group like the main layers', `parallel/ep/apply_ep.py`; under ZeRO-2/3 its own FSDP2 block with the
experts over edp); not yet context parallelism (refused by `parallel/cp/sizes.py`).
They are built by `GPTModel` (which hands in its layer class), so this module imports nothing of the model's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.loss import HeadLoss
from moetron.model.norm import build_norm
from moetron.model.rng import STREAMS


class MTPModule(nn.Module):
    """One depth: the two norms, the 2C → C projection, one transformer layer and its own final norm (which the
    caller applies: `forward` returns the layer's output, before it)."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        self.enorm = build_norm(cfg)
        self.hnorm = build_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.transformer_layer = layer
        self.final_layernorm = build_norm(cfg)

    def forward(self, h_BTC: torch.Tensor, embedded_BTC: torch.Tensor, rope) -> torch.Tensor:
        x_BTC = self.eh_proj(torch.cat([self.enorm(embedded_BTC), self.hnorm(h_BTC)], dim=-1))
        with STREAMS.fork("layers", str(self.transformer_layer.self_attention.layer_index)):
            x_BTC, _ = self.transformer_layer(x_BTC, rope)
        return x_BTC


class _DepthHead:
    """What a `HeadLoss` reads of a model, for one depth: the module's final norm, the model's shared head."""

    def __init__(self, model: nn.Module, module: MTPModule):
        self.final_layernorm, self.head_weight = module.final_layernorm, model.head_weight

    def logits(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.final_layernorm(x_BTC), self.head_weight())


class MultiTokenPrediction(nn.Module):
    """The D sequential MTP modules, `layers` keyed "0" … "D-1" (Megatron-Core's `mtp.layers.{k}`);
    `make_layer(index)` builds each one's transformer layer (index: its place after the main layers,
    num_layers + k − 1, which keys its random streams)."""

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(k): MTPModule(cfg, make_layer(cfg.num_layers + k)) for k in range(cfg.mtp_num_layers)}
        )
        # a final norm's output → the next depth's input; the identity on one process (tensor parallelism lays
        # the norms' outputs out for the head and sets the way back: `apply_tp`)
        self.chain_input: Callable[[torch.Tensor], torch.Tensor] = _unchanged

    def loss(
        self,
        model: nn.Module,
        hidden_BTC: torch.Tensor,
        tokens_BT: torch.Tensor,
        labels_BT: torch.Tensor,
        head_loss: HeadLoss,
        loss_mask_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean over depths of each depth's masked cross-entropy (fp32 scalar, with its gradient)."""
        T = tokens_BT.shape[1]
        mask_BT = torch.ones_like(labels_BT, dtype=torch.float32) if loss_mask_BT is None else loss_mask_BT.float()
        rope = model.rope_angles(torch.arange(T, device=tokens_BT.device))
        h_BTC, losses = self.chain_input(model.final_layernorm(hidden_BTC)), []  # h^0: after the final norm
        depths = list(self.layers.values())
        for k, module in enumerate(depths, start=1):  # depth k: everything one more position to the left
            tokens_BT, labels_BT, mask_BT = rolled(tokens_BT), rolled(labels_BT), rolled(mask_BT)
            x_BTC = module(h_BTC, embed_tokens(model, tokens_BT), rope)
            losses.append(head_loss(_DepthHead(model, module), x_BTC, labels_BT, mask_BT))
            if k < len(depths):  # the next depth reads this one's normed state, as the head does
                h_BTC = self.chain_input(module.final_layernorm(x_BTC))
        return torch.stack(losses).mean()


def _unchanged(h_BTC: torch.Tensor) -> torch.Tensor:
    return h_BTC


def mtp_transformer_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer layers of the MTP modules a model or pipeline stage module holds (none without `mtp`): the
    one list expert parallelism, TP and ZeRO's FSDP blocks each cover beside the main layers."""
    mtp = getattr(module, "mtp", None)
    return [] if mtp is None else [m.transformer_layer for m in mtp.layers.values()]


def embed_tokens(model: nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
    """The shared word embeddings of `tokens` (+ learned positions 0 … T − 1), without the embedding dropout."""
    x_BTC = model.word_embeddings(tokens_BT)
    if model.position_embeddings is not None:
        x_BTC = x_BTC + model.position_embeddings(torch.arange(tokens_BT.shape[1], device=tokens_BT.device))[None]
    return x_BTC


def rolled(x_BT: torch.Tensor) -> torch.Tensor:
    """`x` one position to the left, the vacated last position zeroed (a mask's 0: out of the loss)."""
    out = torch.roll(x_BT, -1, dims=1)
    out[:, -1] = 0
    return out
