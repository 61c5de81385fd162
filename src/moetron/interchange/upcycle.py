"""Upcycling (Megatron-Core's `--moe-use-upcycling`): a dense checkpoint → a MoE model that computes the same thing.

    upcycle(load="runs/dense", save="runs/moe", overrides={"num_experts": [8], "topk": 2, "expert_interval": 1})
    # moetron train --config runs/moe/config.yaml --load runs/moe --finetune --data-path ...

Every MoE layer's experts start as copies of that layer's dense MLP (and a PR-MoE residual MLP too), so at step 0
each token's MoE output is Σ_k w_k · MLP(x) = MLP(x) whenever its kept weights sum to one: renormalised top-k
(DeepSpeed's top-2 / top-k, `--moe-router-topk-renorm`, pre-softmax), with a scaling factor s undone by scaling the
copies' output projection by 1/s. A single shared expert (of the dense MLP's size) takes half: routed copies and
the shared copy each give MLP/2 (with `--shared-expert-gate` the gate starts at zero, sigmoid 0.5, and the shared
copy gives the full MLP·0.5). The router (and PR-MoE's coefficient) start from the model's own initialisation, so
tokens spread over the experts and the identical experts diverge as they see different tokens. A token dropped by
capacity has no MoE output, so step-0 equality needs no drops: upcycle with --disable-moe-token-dropping, or a
capacity factor large enough for the first batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.config import RunConfig
from moetron.config_cli import apply_values
from moetron.errors import ConfigError, UserError
from moetron.interchange.hf_architectures import normalised_weights
from moetron.interchange.moetron_checkpoint import MoetronCheckpoint
from moetron.interchange.new_run import check_new_run_dir, write_run
from moetron.model.gpt import create_model


@dataclass
class UpcycleResult:
    path: Path
    cfg: RunConfig
    moe_layers: list[int]
    notes: list[str]


def dense_source(load: str | None, hf: str | None) -> tuple[RunConfig, dict[str, torch.Tensor], str]:
    """(config, fp32 weights, a description) of the dense model, from a moetron checkpoint or an HF directory."""
    if (load is None) == (hf is None):
        raise UserError("give the dense model as --load CHECKPOINT or --hf DIRECTORY (one of them)")
    if load is not None:
        ckpt = MoetronCheckpoint.open(load)
        return ckpt.cfg, {name: ckpt.read(name).float() for name in ckpt.shapes}, f"--load {load}"
    from moetron.interchange.hf_import import _model_config, architecture_of, convert_tensors, read_hf_config
    from moetron.interchange.safetensors_stream import HFWeights

    source = Path(hf)
    config = read_hf_config(source)
    arch = architecture_of(config, source)
    if arch is None:
        raise UserError(f"--hf {hf}: a moetron remote-code export; upcycle its moetron checkpoint with --load")
    cfg = RunConfig(model=_model_config(arch, config))
    tensors = convert_tensors(HFWeights(source), arch.rules(cfg.model), cfg.model, f"--hf {hf}", arch, config)
    cfg.data = dataclasses.replace(cfg.data, **hf_tokenizer_fields(source))
    return cfg, tensors, f"--hf {hf} ({arch.hf_class})"


def hf_tokenizer_fields(source: Path) -> dict:
    """Tokenizer fields pointing into the HF directory itself (upcycling copies nothing there)."""
    if (source / "tokenizer.json").is_file():
        return {"tokenizer_type": "HFTokenizer", "tokenizer_model": str((source / "tokenizer.json").resolve())}
    if (source / "vocab.json").is_file() and (source / "merges.txt").is_file():
        return {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": str((source / "vocab.json").resolve()),
            "merge_file": str((source / "merges.txt").resolve()),
        }
    return {}


def moe_config(dense: RunConfig, overrides: dict) -> RunConfig:
    """The dense config with the MoE flags given; every problem with them at once."""
    cfg = dataclasses.replace(dense, model=dataclasses.replace(dense.model))
    problems: list[str] = []
    apply_values(cfg, overrides, "command line", problems)
    m = cfg.model
    if any(e > 1 for e in dense.model.experts_per_layer()):
        problems.append("the source model already has MoE layers; upcycle a dense model")
    if not any(e > 1 for e in m.experts_per_layer()):
        problems.append(f"--num-experts {m.num_experts} with --expert-interval {m.expert_interval} makes no MoE layer")
    if m.expert_ffn_size != dense.model.ffn_size:
        problems.append(
            f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size}: experts copy the dense MLP, so they need its "
            f"size {dense.model.ffn_size}"
        )
    if not normalised_weights(m):
        problems.append(
            f"--topk {m.topk} keeps the raw router probability as the weight (DeepSpeed's top-1), so "
            f"copies of the MLP would sum to less than it: add --moe-router-topk-renorm or use --topk 2"
        )
    if m.num_shared_experts > 1:
        problems.append(
            f"--num-shared-experts {m.num_shared_experts}: a shared expert copies the dense MLP, so at most 1"
        )
    problems += m.problems()
    if problems:
        raise ConfigError(problems)
    return cfg


def mlp_copies(dense: dict[str, torch.Tensor], mlp: str, count: int, scale: float) -> dict[str, torch.Tensor]:
    """`count` stacked copies of the dense MLP at `mlp` as GroupedExperts tensors (w1/w3/w2, b1/b2), the output
    projection (and its bias) scaled by `scale`."""
    out = {"w1_EDF": dense[mlp + "dense_h_to_4h.weight"].t(), "w2_EFD": dense[mlp + "dense_4h_to_h.weight"].t() * scale}
    if mlp + "dense_h_to_4h_up.weight" in dense:
        out["w3_EDF"] = dense[mlp + "dense_h_to_4h_up.weight"].t()
    if mlp + "dense_h_to_4h.bias" in dense:
        out["b1_EF"] = dense[mlp + "dense_h_to_4h.bias"]
        out["b2_ED"] = dense[mlp + "dense_4h_to_h.bias"] * scale
    return {name: t.expand(count, *t.shape).clone() for name, t in out.items()}


@torch.no_grad()
def upcycled_tensors(dense: dict[str, torch.Tensor], cfg: RunConfig, seed: int) -> dict[str, torch.Tensor]:
    """The MoE model's tensors: dense ones copied, experts = copies of the MLP, routers freshly initialised."""
    m = cfg.model
    fresh = create_model(m, "cpu", seed=seed).state_dict()
    out = {name: dense[name] for name in fresh if name in dense}
    shared = m.num_shared_experts == 1
    for i in m.moe_layer_indices():
        mlp = f"layers.{i}.mlp."  # the dense MLP's tensors and the MoE layer's share this prefix
        routed_scale = (0.5 if shared else 1.0) / m.moe_router_topk_scaling_factor
        parts = {"experts.": (m.experts_per_layer()[i], routed_scale)}
        if m.mlp_type == "residual":  # mixed with the routed output by the coefficient: the same share of MLP(x)
            parts["mlp."] = (1, 0.5 if shared else 1.0)
        if shared:
            parts["shared_experts."] = (1, 1.0 if m.shared_expert_gate else 0.5)
        for part, (count, scale) in parts.items():
            out.update({mlp + part + k: t for k, t in mlp_copies(dense, mlp, count, scale).items()})
        for name in fresh:
            if name.startswith(mlp) and name not in out:
                out[name] = fresh[name]  # router, expert bias, coefficient: the model's own initialisation
        if m.shared_expert_gate:
            out[mlp + "shared_expert_gate.weight"] = torch.zeros_like(fresh[mlp + "shared_expert_gate.weight"])
    missing = [n for n in fresh if n not in out]
    if missing:
        raise AssertionError(f"upcycling left {missing[:3]} unset")
    return out


def upcycle(save: str, overrides: dict, load: str | None = None, hf: str | None = None) -> UpcycleResult:
    check_new_run_dir(save)
    dense, tensors, what = dense_source(load, hf)
    cfg = moe_config(dense, overrides)
    moe_tensors = upcycled_tensors(tensors, cfg, cfg.train.seed)
    layers = cfg.model.moe_layer_indices()
    notes = [f"upcycled by `moetron upcycle` from {what}: MoE layers {layers}, experts = copies of each dense MLP"]
    if cfg.model.moe_token_dropping:
        notes.append("token dropping is on: the step-0 output equals the dense model's only for tokens within capacity")
    path = write_run(save, cfg, moe_tensors, notes, source="upcycle")
    return UpcycleResult(path, cfg, layers, notes)
