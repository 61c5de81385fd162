"""Megatron-DeepSpeed tensor names and layouts → moetron's, one recipe per moetron tensor.

Megatron-DeepSpeed names (after flattening `module['language_model']` and dropping that prefix):

    embedding.word_embeddings.weight  [V_pad / tp, C]         embedding.position_embeddings.weight [P, C]
    encoder.layers.<i>.input_layernorm.{weight,bias}          encoder.layers.<i>.post_attention_layernorm.*
    encoder.layers.<i>.self_attention.query_key_value.*       [Q | K | V] thirds, or per head [q_h k_h v_h] (old)
    encoder.layers.<i>.self_attention.dense.{weight,bias}     row-parallel: weight split on dim 1
    encoder.layers.<i>.mlp.dense_h_to_4h.*  / dense_4h_to_h.* dense MLP (SwiGLU: dense_h_to_4h = [gate | up])
    encoder.layers.<i>.mlp.deepspeed_moe.gate.wg.weight       [E, C] (fp32 gate)
    encoder.layers.<i>.mlp.deepspeed_moe.experts.deepspeed_experts.<G>.dense_h_to_4h.* …   (expert files)
    encoder.layers.<i>.mlp.mlp.*, encoder.layers.<i>.mlp.coefficient.*                      (PR-MoE residual)
    encoder.final_layernorm.*, output_layer.weight (untied)

A recipe lists the Megatron tensors it reads and builds the moetron tensor from `get(name)` — one tensor per
tensor-parallel rank — so the same recipes convert the weights and, moment by moment, the optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.errors import UserError
from moetron.interchange.safe_load import load_pt
from moetron.model.attention import fuse_qkv
from moetron.model.config import ModelConfig

Getter = Callable[[str], list[torch.Tensor]]  # a Megatron name → its tensor on each TP rank


@dataclass(frozen=True)
class Recipe:
    sources: tuple[str, ...]
    build: Callable[[Getter], torch.Tensor]


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            out[name] = value
    return out


def _normalise(name: str) -> str:
    name = name.removeprefix("language_model.")
    return "encoder." + name[len("transformer.") :] if name.startswith("transformer.") else name


@dataclass
class MDSTensors:
    shards: list[dict[str, torch.Tensor]]  # per TP rank: dense tensors by Megatron name
    experts: dict[str, torch.Tensor]  # expert tensors by Megatron name (global expert ids), from TP rank 0

    @classmethod
    def read(cls, step: Path, states: dict, args: dict, allow_pickle: bool = False) -> MDSTensors:
        tp = int(args.get("tensor_model_parallel_size", 1))
        shards = []
        for rank in range(tp):
            path = step / f"mp_rank_{rank:02d}_model_states.pt"
            if not path.is_file():
                raise UserError(f"{step}: {path.name} is missing (the run had --tensor-model-parallel-size {tp})")
            content = states if rank == 0 else load_pt(path, allow_pickle)
            module = content.get("module") or {}
            shards.append({_normalise(k): v for k, v in _flatten(module.get("language_model", module)).items()})
        experts = {}
        for path in sorted(step.glob("layer_*_expert_*_mp_rank_00_model_states.pt")):
            experts.update({_normalise(k): v for k, v in load_pt(path, allow_pickle).items()})
        return cls(shards, experts)

    def get(self, name: str) -> list[torch.Tensor]:
        if name in self.experts:
            return [self.experts[name]]
        if name not in self.shards[0]:
            raise UserError(f"the Megatron-DeepSpeed checkpoint lacks {name}; do its args describe this model?")
        return [shard[name] for shard in self.shards]


# ---------------------------------------------------------------------------- layout helpers
def _column(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, 0)


def _grouped_qkv(ts: list[torch.Tensor], layout: str, heads: int, kv: int) -> torch.Tensor:
    """Each TP shard's fused QKV (its heads) → moetron's grouped layout, shards concatenated (head order)."""
    tp = len(ts)
    if layout == "per-head":  # q_h k_h v_h per head: already moetron's grouping with one query per group
        if heads != kv:
            raise UserError("--qkv-layout per-head with grouped-query attention is not a Megatron layout")
        return _column(ts)
    local_heads, local_kv = heads // tp, kv // tp
    head_dim = ts[0].shape[0] // (local_heads + 2 * local_kv)
    sizes = [local_heads * head_dim, local_kv * head_dim, local_kv * head_dim]
    return _column([fuse_qkv(*t.split(sizes), local_heads, local_kv) for t in ts])


def _halves(ts: list[torch.Tensor], half: int) -> torch.Tensor:
    """SwiGLU's fused [gate | up] on each TP shard: that half, shards concatenated."""
    return _column([t.chunk(2)[half] for t in ts])


def _expert_stack(get: Getter, pattern: str, experts: int, transform: Callable[[torch.Tensor], torch.Tensor]):
    return torch.stack([transform(get(pattern.format(g=g))[0]) for g in range(experts)])


# ---------------------------------------------------------------------------- recipes
def recipes(cfg: ModelConfig, layout: str) -> dict[str, Recipe]:
    """moetron tensor name → how to build it from Megatron-DeepSpeed's tensors."""
    r: dict[str, Recipe] = {}
    heads, kv, swiglu = cfg.num_attention_heads, cfg.kv_heads, cfg.swiglu

    def add(name: str, sources: list[str], build: Callable[[Getter], torch.Tensor]) -> None:
        r[name] = Recipe(tuple(sources), build)

    def copy(name: str, source: str, merge=lambda ts: ts[0]) -> None:
        add(name, [source], lambda get: merge(get(source)))

    copy("word_embeddings.weight", "embedding.word_embeddings.weight", _column)
    if cfg.position_embedding_type == "learned_absolute":
        copy("position_embeddings.weight", "embedding.position_embeddings.weight")
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    norm_kinds = ("weight", "bias") if cfg.normalization == "layernorm" else ("weight",)
    for i, experts in enumerate(cfg.experts_per_layer()):
        m, e = f"layers.{i}.", f"encoder.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            for k in norm_kinds:
                copy(f"{m}{norm}.{k}", f"{e}{norm}.{k}")
        for k in kinds:
            qkv = f"{e}self_attention.query_key_value.{k}"
            add(
                f"{m}self_attention.query_key_value.{k}",
                [qkv],
                lambda get, s=qkv: _grouped_qkv(get(s), layout, heads, kv),
            )
        copy(f"{m}self_attention.dense.weight", f"{e}self_attention.dense.weight", lambda ts: torch.cat(ts, 1))
        if cfg.add_bias_linear:
            copy(f"{m}self_attention.dense.bias", f"{e}self_attention.dense.bias")
        if experts == 1:
            _dense_mlp(add, copy, f"{m}mlp.", f"{e}mlp.", kinds, swiglu)
        else:
            _moe(add, copy, cfg, f"{m}mlp.", f"{e}mlp.", experts)
    for k in norm_kinds:
        copy(f"final_layernorm.{k}", f"encoder.final_layernorm.{k}")
    if cfg.untie_embeddings_and_output_weights:
        copy("output_layer.weight", "output_layer.weight", _column)
    return r


def _dense_mlp(add, copy, m: str, e: str, kinds: tuple[str, ...], swiglu: bool) -> None:
    for k in kinds:
        source = f"{e}dense_h_to_4h.{k}"
        if swiglu:
            add(f"{m}dense_h_to_4h.{k}", [source], lambda get, s=source: _halves(get(s), 0))
            add(f"{m}dense_h_to_4h_up.{k}", [source], lambda get, s=source: _halves(get(s), 1))
        else:
            copy(f"{m}dense_h_to_4h.{k}", source, _column)
    copy(f"{m}dense_4h_to_h.weight", f"{e}dense_4h_to_h.weight", lambda ts: torch.cat(ts, 1))
    if "bias" in kinds:
        copy(f"{m}dense_4h_to_h.bias", f"{e}dense_4h_to_h.bias")


def _moe(add, copy, cfg: ModelConfig, m: str, e: str, experts: int) -> None:
    if cfg.swiglu and cfg.add_bias_linear:
        raise UserError("SwiGLU experts with biases (the up projection's bias) have no moetron equivalent")
    copy(f"{m}router.weight", f"{e}deepspeed_moe.gate.wg.weight")
    x = e + "deepspeed_moe.experts.deepspeed_experts.{g}."
    h_to_4h, _4h_to_h = x + "dense_h_to_4h.", x + "dense_4h_to_h."
    names = [p.format(g=g) + k for g in range(experts) for p in (h_to_4h, _4h_to_h) for k in ("weight", "bias")]

    def stack(pattern: str, transform):
        return lambda get: _expert_stack(get, pattern, experts, transform)

    gate = (lambda w: w.chunk(2)[0].t()) if cfg.swiglu else (lambda w: w.t())
    add(f"{m}experts.w1_EDF", names, stack(h_to_4h + "weight", gate))
    if cfg.swiglu:
        add(f"{m}experts.w3_EDF", names, stack(h_to_4h + "weight", lambda w: w.chunk(2)[1].t()))
    add(f"{m}experts.w2_EFD", names, stack(_4h_to_h + "weight", lambda w: w.t()))
    if cfg.add_bias_linear:
        add(f"{m}experts.b1_EF", names, stack(h_to_4h + "bias", lambda b: b))
        add(f"{m}experts.b2_ED", names, stack(_4h_to_h + "bias", lambda b: b))
    if cfg.mlp_type == "residual":  # DeepSpeed's residual MLP → a one-expert GroupedExperts
        r = e + "mlp."
        add(f"{m}mlp.w1_EDF", [r + "dense_h_to_4h.weight"], lambda get: gate(get(r + "dense_h_to_4h.weight")[0])[None])
        add(f"{m}mlp.w2_EFD", [r + "dense_4h_to_h.weight"], lambda get: get(r + "dense_4h_to_h.weight")[0].t()[None])
        if cfg.swiglu:
            add(
                f"{m}mlp.w3_EDF",
                [r + "dense_h_to_4h.weight"],
                lambda get: get(r + "dense_h_to_4h.weight")[0].chunk(2)[1].t()[None],
            )
        if cfg.add_bias_linear:
            add(f"{m}mlp.b1_EF", [r + "dense_h_to_4h.bias"], lambda get: get(r + "dense_h_to_4h.bias")[0][None])
            add(f"{m}mlp.b2_ED", [r + "dense_4h_to_h.bias"], lambda get: get(r + "dense_4h_to_h.bias")[0][None])
        for k in ("weight", "bias"):
            copy(f"{m}coefficient.{k}", f"{e}coefficient.{k}")


def moetron_tensors(source: MDSTensors, cfg: ModelConfig, layout: str) -> dict[str, torch.Tensor]:
    """Every moetron weight (fp32); routers' expert biases (not in Megatron-DeepSpeed) are zero."""
    tensors = {name: recipe.build(source.get).float().contiguous() for name, recipe in recipes(cfg, layout).items()}
    for i, experts in enumerate(cfg.experts_per_layer()):
        if experts > 1:
            tensors[f"layers.{i}.mlp.router.expert_bias"] = torch.zeros(experts)
    return tensors
