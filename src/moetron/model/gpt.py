"""The GPT language model: Megatron's GPT by default, modern options through `ModelConfig`.

Shapes: B batch, T tokens, C hidden size, V padded vocabulary.

    tokens ─▶ word embeddings (+ learned positions) ─▶ dropout
           ─▶ N × [ x + drop(attn(norm(x))),  x + drop(mlp_or_moe(norm(x))) ]
           ─▶ final norm ─▶ logits (tied word embeddings, or a separate output layer)
    (training with --mtp-num-layers D: the final norm's output also feeds D multi-token-prediction modules,
     `model/mtp.py`, that share the embedding and the head; `forward(mtp_labels_BT=...)` returns their loss)

Layer i is a MoE layer when `cfg.experts_per_layer()[i] > 1` (Megatron's `get_num_experts_per_layer`).
`layers` is keyed by the GLOBAL layer index ("0", "1", …): a pipeline stage that keeps layers 4–7 still calls
them `layers.4` … `layers.7`, so checkpoint keys and initialisation (both by parameter name) never depend on
the layout. The three parts — `embed`, `run_layers`, `logits` — are callable on their own; a stage whose
embedding or head was removed (set to None) skips that part.

The LM loss lives outside the model (`moetron.model.loss`); `forward(labels_BT=...)` computes Megatron's
`Σ(CE · loss_mask) / Σ loss_mask` in fp32 for convenience: with the caller's `head_loss` when given (the parallel
model's, e.g. the vocab-parallel cross-entropy under tensor parallelism), else the plain loss on the logits, or —
`return_logits=False` — the head `fuses_head` picks for a plain model: the fused head + cross-entropy, which never
builds the logits. `GPTOutput.hidden` is the last layer's output, what a `HeadLoss` starts from. Each MoE layer
attaches its weighted aux loss to its own output (`moe/aux_loss.py`), so `lm_loss.backward()` alone trains the
routers too; `GPTOutput.moe_loss` is the value `moe_loss_coeff · Σ aux + moe_z_loss_coeff · Σ z` over the MoE
layers (reference §4.5), for reports. Parameter names follow Megatron (`query_key_value`, `dense_h_to_4h`,
`input_layernorm`, …) so converters stay simple. Nothing here is distributed; parallelism wraps this model from outside.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetron.errors import ConfigError, UserError
from moetron.model.attention import SelfAttention
from moetron.model.backends import head_loss_backend
from moetron.model.config import ModelConfig
from moetron.model.init import init_tree, output_std
from moetron.model.kv_cache import KVCache
from moetron.model.loss import HeadLoss, fuses_head, make_head_loss
from moetron.model.mla import MultiLatentAttention
from moetron.model.mlp import MLP
from moetron.model.moe.layer import MoEAux, MoELayer
from moetron.model.mtp import MultiTokenPrediction, mtp_transformer_layers
from moetron.model.norm import build_norm
from moetron.model.rng import STREAMS
from moetron.model.rotary import rotary_angles, yarn_of


@dataclass
class GPTOutput:
    logits: torch.Tensor | None  # [B, T, V_padded]; None when forward(return_logits=False)
    lm_loss: torch.Tensor | None  # fp32 scalar, None without labels
    moe_loss: torch.Tensor  # fp32 scalar value (detached: its gradient is attached in the layers); 0 when dense
    moe_aux: list[MoEAux] = field(default_factory=list)  # one MoEAux per MoE layer, in layer order
    hidden: torch.Tensor | None = None  # [B, T, C]: the last layer's output, before the final norm
    mtp_loss: torch.Tensor | None = None  # fp32, with its gradient: the MTP modules' mean loss (given mtp_labels_BT)


class TransformerLayer(nn.Module):
    """One pre-norm block; its MLP is a MoE layer when the layer has more than one expert."""

    def __init__(self, cfg: ModelConfig, layer_index: int, num_experts: int | None = None):
        super().__init__()
        self.input_layernorm = build_norm(cfg)
        attention = MultiLatentAttention if cfg.multi_latent_attention else SelfAttention
        self.self_attention = attention(cfg, layer_index)
        self.post_attention_layernorm = build_norm(cfg)
        num_experts = cfg.experts_per_layer()[layer_index] if num_experts is None else num_experts
        self.is_moe = num_experts > 1
        self.mlp = MoELayer(cfg, num_experts, layer_index=layer_index) if self.is_moe else MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self, x_BTC: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: KVCache | None = None
    ) -> tuple[torch.Tensor, MoEAux | None]:
        """Returns (hidden states, MoEAux or None); aux is returned (not stored) so checkpointing keeps it."""
        x_BTC = x_BTC + self.hidden_dropout(self.self_attention(self.input_layernorm(x_BTC), rope, kv_cache))
        h_BTC = self.post_attention_layernorm(x_BTC)
        aux = None
        if self.is_moe:
            h_BTC, aux = self.mlp(h_BTC)
        else:
            h_BTC = self.mlp(h_BTC)
        return x_BTC + self.hidden_dropout(h_BTC), aux

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """Activation checkpointing's (forward, recompute) contexts (`checkpoint`'s `context_fn`): while the backward
        recomputes this layer, its MoE layer adds no routing statistics a second time."""
        return contextlib.nullcontext(), self.mlp.recomputing() if self.is_moe else contextlib.nullcontext()


class GPTModel(nn.Module):
    """A decoder-only transformer LM; builds on any device, including `meta`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        problems = cfg.problems()
        if problems:
            raise ConfigError(problems)
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size(), cfg.hidden_size)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, i) for i in range(cfg.num_layers)})
        self.final_layernorm = build_norm(cfg)
        self.recompute_layers = cfg.checkpoint_activations  # activation checkpointing (parallel.apply_ac sets it)
        # (T, device) → the absolute positions of the T tokens a forward receives; None: 0 … T−1. Context
        # parallelism (parallel/cp/) sets it: a rank holds two distant chunks of every sequence.
        self.sequence_positions: Callable[[int, torch.device], torch.Tensor] | None = None
        self.output_layer = None
        if cfg.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size(), bias=False)
        self.mtp = None  # multi-token prediction (model/mtp.py): layers after the last one, training only
        if cfg.mtp_num_layers:
            experts = cfg.mtp_layer_experts()  # MoE like the last layer (DeepSeek-V3), or --mtp-dense-layers
            self.mtp = MultiTokenPrediction(cfg, lambda index: TransformerLayer(cfg, index, num_experts=experts))

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        tokens_BT: torch.Tensor,
        labels_BT: torch.Tensor | None = None,
        loss_mask_BT: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_logits: bool = True,
        head_loss: HeadLoss | None = None,
        mtp_labels_BT: torch.Tensor | None = None,
    ) -> GPTOutput:
        """`mtp_labels_BT` (the next tokens; the trainer passes them when --mtp-num-layers is set): also run the
        MTP modules and return their loss; evaluation and generation never do."""
        B, T = tokens_BT.shape
        past = 0
        if kv_cache is not None:
            kv_cache.check_room(B, T)
            past = kv_cache.length
        x_BTC, rope = self.embed(tokens_BT, past)
        moe_aux: list[MoEAux] = []
        x_BTC = self.run_layers(x_BTC, rope, kv_cache, moe_aux)
        if kv_cache is not None:
            kv_cache.advance(T)
        logits_BTV = self.logits(x_BTC) if return_logits else None
        lm_loss = mtp_loss = None
        # a plain model fuses its head when the logits are not wanted (never builds them)
        plain_head = make_head_loss(fuses_head(not return_logits, vocab_parallel=False, splits_backward=False))
        if self.mtp is not None and mtp_labels_BT is not None:
            mtp_loss = self.mtp.loss(self, x_BTC, tokens_BT, mtp_labels_BT, head_loss or plain_head, loss_mask_BT)
        if labels_BT is not None:
            head_loss = head_loss or plain_head
            if logits_BTV is not None and not head_loss.fused:  # the logits are there: no second head
                lm_loss = head_loss.loss_fn(logits_BTV, labels_BT, loss_mask_BT)
            else:
                lm_loss = head_loss(self, x_BTC, labels_BT, loss_mask_BT)
        return GPTOutput(
            logits=logits_BTV,
            lm_loss=lm_loss,
            moe_loss=self.weighted_moe_loss(moe_aux, x_BTC.device),
            moe_aux=moe_aux,
            hidden=x_BTC,
            mtp_loss=mtp_loss,
        )

    def embed(
        self, tokens_BT: torch.Tensor, past: int = 0
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Token (+ position) embeddings after dropout, and the RoPE angles when rotary positions are on.

        The tokens sit at absolute positions `past … past + T − 1` (`past` = tokens already in a KV cache).
        """
        end = past + tokens_BT.shape[1]
        positions_T = torch.arange(past, end, device=tokens_BT.device)
        if self.sequence_positions is not None and past == 0:
            positions_T = self.sequence_positions(tokens_BT.shape[1], tokens_BT.device)
        x_BTC = self.lookup_tokens(tokens_BT)
        rope = None
        if self.position_embeddings is not None:
            if end > self.cfg.max_positions:
                raise UserError(
                    f"sequence reaches position {end} but the model has --max-position-embeddings "
                    f"{self.cfg.max_positions}; shorten the input (or prompt + new tokens)"
                )
            x_BTC = x_BTC + self.position_embeddings(positions_T)[None]
        else:
            rope = self.rope_angles(positions_T)
        with STREAMS.fork("embedding"):
            return self.embedding_dropout(x_BTC), rope

    def lookup_tokens(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The word embeddings of `tokens_BT`: a plain `nn.Embedding`'s lookup goes through the device's head-loss
        backend (`model/backends.py`: on CPU its [V, C] gradient reuses memory across steps and adds into a tied
        fused head's); any other (tensor parallelism's hooks, a sharding wrapper's) is called as it is."""
        module = self.word_embeddings
        plain = type(module) is nn.Embedding and not (module._forward_hooks or module._forward_pre_hooks)
        if plain and module.padding_idx is None and module.max_norm is None and not module.sparse:
            if not module.scale_grad_by_freq:
                return head_loss_backend(module.weight.device).lookup(tokens_BT, module.weight)
        return module(tokens_BT)

    def rope_angles(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE angles of `positions_T` (None with learned positions): computed, not stored, so a pipeline
        stage without the embedding recomputes them from the sequence length."""
        if self.cfg.position_embedding_type == "learned_absolute":
            return None
        cfg = self.cfg
        return rotary_angles(positions_T, cfg.rotary_dim, cfg.rotary_base, cfg.rotary_compat, yarn_of(cfg))

    def run_layers(
        self,
        x_BTC: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: KVCache | None = None,
        moe_aux: list[MoEAux] | None = None,
        layers: Mapping[str, TransformerLayer] | None = None,
    ) -> torch.Tensor:
        """Every layer this model holds (or those of `layers`, e.g. one pipeline stage's), in order, each on its own
        random stream; MoE reports go to `moe_aux`."""
        for name, layer in (self.layers if layers is None else layers).items():
            with STREAMS.fork("layers", name):
                x_BTC, aux = self.run_layer(layer, x_BTC, rope, kv_cache)
            if aux is not None and moe_aux is not None:
                moe_aux.append(aux)
        return x_BTC

    def run_layer(
        self,
        layer: TransformerLayer,
        x_BTC: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: KVCache | None,
    ) -> tuple[torch.Tensor, MoEAux | None]:
        """Run one layer, recomputing it in backward when activation checkpointing is on.

        Non-reentrant checkpointing restores the CPU/GPU RNG state before recomputation, so dropout
        masks and the router's random draws (RTS, noisy gates) are the same in both passes.
        """
        if self.recompute_layers and self.training and torch.is_grad_enabled() and kv_cache is None:
            return checkpoint(layer, x_BTC, rope, None, use_reentrant=False, context_fn=layer.recompute_contexts)
        return layer(x_BTC, rope, kv_cache)

    def logits(self, x_BTC: torch.Tensor) -> torch.Tensor:
        """Final norm, then the output layer (or the tied word embeddings): [B, T, V_padded] (under tensor
        parallelism a DTensor sharded over the vocabulary: the weight is a vocabulary shard)."""
        return F.linear(self.final_layernorm(x_BTC), self.head_weight())

    def head_weight(self) -> torch.Tensor:
        """[V_padded, C]: the output layer's weight, or the word embeddings' when they are tied."""
        return self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight

    def weighted_moe_loss(self, moe_aux: list[MoEAux], device: torch.device) -> torch.Tensor:
        """moe_loss_coeff · Σ aux_loss + moe_z_loss_coeff · Σ z_loss over the MoE layers (fp32; 0 when dense)."""
        total = torch.zeros((), dtype=torch.float32, device=device)
        for aux in moe_aux:
            total = total + aux.loss(self.cfg).detach()
        return total

    # ------------------------------------------------------------------ MoE helpers
    def layer_items(self) -> list[tuple[int, TransformerLayer]]:
        """(global layer index, layer) of every layer this model holds, in order."""
        return [(int(name), layer) for name, layer in self.layers.items()]

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers, in layer order, then the MTP modules' (so expert parallelism, tensor parallelism's
        dispatchers, the expert-bias updates and the routing statistics cover them: `cfg.routed_layer_indices()`)."""
        layers = list(self.layers.values()) + mtp_transformer_layers(self)
        return [layer.mlp for layer in layers if layer.is_moe]

    def set_inference_routing(self, dropless: bool) -> None:
        """dropless=True: every MoE router keeps all tokens (capacity = the largest expert load), so that
        generation never silently drops a token; False: back to the config's `moe_token_dropping`.

        Routers read `router.cfg` at every call, so swapping in a copy with `moe_token_dropping` changed
        switches both the DeepSpeed and the generic gating paths. Out of training (`.eval()`), routers
        that drop use the eval capacity factor.
        """
        dropping = False if dropless else self.cfg.moe_token_dropping
        for moe in self.moe_layers():
            moe.router.cfg = dataclasses.replace(moe.router.cfg, moe_token_dropping=dropping)

    @contextlib.contextmanager
    def inference_routing(self, dropless: bool = True) -> Iterator[None]:
        """`set_inference_routing(dropless)` within the block, restoring each router's setting after it."""
        routers = [moe.router for moe in self.moe_layers()]
        previous = [r.cfg for r in routers]
        try:
            self.set_inference_routing(dropless)
            yield
        finally:
            for router, cfg in zip(routers, previous, strict=True):
                router.cfg = cfg

    # ------------------------------------------------------------------ initialisation
    def init_weights(self, seed: int) -> None:
        """Deterministic, layout-free init (see `moetron.model.init`)."""
        std = self.cfg.init_method_std
        init_tree(self, seed, std, output_std(std, self.cfg.num_layers))


def create_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 1234) -> GPTModel:
    """Build on the meta device (no memory), materialise on `device`, then initialise from `seed`."""
    with torch.device("meta"):
        model = GPTModel(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
