"""RoPE in a Hugging Face `config.json` both ways: the base, and YaRN scaling (`--rope-type yarn`, `model/rotary.py`).

transformers 5 keeps RoPE in `rope_parameters` ({rope_type, rope_theta, factor, …}); older configs (DeepSeek-V3's
own) in `rope_theta` and `rope_scaling` ({type: yarn, …}). Import reads both (rope_parameters winning), export
writes `rope_parameters` and, for YaRN, the same settings as `rope_scaling` for loaders that read the old key
(vLLM / SGLang on transformers 4). transformers' YaRN derives its attention factor from `mscale` only when
`mscale` and `mscale_all_dim` are both set (else 0.1·ln s + 1), where Megatron-Core (and moetron) always take
mscale(s, mscale) / mscale(s, mscale_all_dim); so import maps the other cases to the settings that compute
transformers' value, and export writes `attention_factor` explicitly in them. Other RoPE scalings (linear, dynamic,
llama3, longrope) and `truncate: false` stop the import with one line.
"""

from __future__ import annotations

from moetron.model.config import ModelConfig
from moetron.model.rotary import Yarn, yarn_mscale, yarn_of


def rope_fields(hf: dict, problems: list[str], mla: bool = False) -> dict:
    """config.json → `rotary_base` and the YaRN fields (`mla`: the class applies YaRN's softmax correction)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        problems.append("partial_rotary_factor != 1 (RoPE on part of each head) has no moetron equivalent")
    fields: dict = {"rotary_base": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return fields
    if kind != "yarn":
        problems.append(f"rope_type {kind!r} (RoPE scaling) has no moetron equivalent; plain RoPE and yarn import")
        return fields
    original = params.get("original_max_position_embeddings")
    if not original:
        problems.append("rope_type yarn without original_max_position_embeddings (the pretraining length)")
        return fields
    factor = float(params.get("factor") or int(hf.get("max_position_embeddings") or original) / int(original))
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):  # transformers' attention factor is then mscale(s, 1): see the module docstring
        if all_dim and mla:
            problems.append(
                f"rope_type yarn with mscale_all_dim {all_dim} but mscale {mscale!r} has no moetron equivalent "
                f"(the attention factor transformers takes then differs from Megatron-Core's)"
            )
        mscale, all_dim = 1.0, float(all_dim or 0.0) if mla else 0.0
    if params.get("truncate", True) is False:
        problems.append("rope_type yarn with truncate false has no moetron equivalent (Megatron-Core truncates)")
    fields.update(
        rope_type="yarn",
        rotary_scaling_factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale),
        mscale_all_dim=float(all_dim),
    )
    given = params.get("attention_factor")
    want = Yarn(factor, int(original), mscale=float(mscale), mscale_all_dim=float(all_dim)).attention_factor()
    if given is not None and abs(float(given) - want) > 1e-12:
        problems.append(
            f"rope_type yarn with attention_factor {given} (not the {want:.6g} its mscale settings give) has no "
            f"moetron equivalent"
        )
    return fields


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    """`rope_parameters` of the exported config.json."""
    out = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    yarn = yarn_of(cfg)
    if yarn is None:
        return out
    out.update(yarn_settings(yarn), rope_type="yarn")
    return out


def yarn_settings(yarn: Yarn) -> dict:
    """YaRN's keys as transformers and DeepSeek's config.json spell them."""
    out = {
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim,
    }
    if not (yarn.mscale and yarn.mscale_all_dim) and yarn.attention_factor() != yarn_mscale(yarn.factor):
        out["attention_factor"] = yarn.attention_factor()
    return out


def hf_rope_keys(cfg: ModelConfig) -> dict:
    """The RoPE keys of the exported config.json: `rope_theta`, `rope_parameters` and, for YaRN, `rope_scaling`."""
    out = {"rope_theta": cfg.rotary_base, "rope_parameters": hf_rope_parameters(cfg)}
    if yarn_of(cfg) is not None:
        out["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", **yarn_settings(yarn_of(cfg))}
    return out
