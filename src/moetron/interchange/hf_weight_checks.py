"""What `import --hf` checks of the weight files against config.json before converting a tensor, so that every
tensor in the files is either placed or named in a one-line refusal, and every disagreement between config.json and
the weights is one line naming both values (the field, the config's value, the value the weights imply, the tensor
and its file) instead of a traceback from a reshape, or layers silently left behind.

    check_layers(weights, cfg, hf, layers_field, mtp_field, source)    # layers past / short of config.json's count
    check_shapes(weights, rules, cfg, hf, source)                      # each tensor's shape against config.json's
    unplaced(weights, rules, cfg)                                      # what no rule reads (expert leftovers, …)

Decoder layer i is `model.layers.<i>.` (GPT-2: `transformer.h.<i>.`); a DeepSeek-V3-layout MTP module k is the layer
`num_hidden_layers + k` holding `eh_proj` (`hf_deepseek_v3.py`), with copies of the shared embedding and head that
the model's own stand for (transformers' `MtpModel` ignores them too).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from moetron.errors import UserError
from moetron.interchange.hf_tensor_rules import Rule
from moetron.interchange.safetensors_stream import HFWeights
from moetron.model.config import ModelConfig

LAYER = re.compile(r"^(?:model\.layers|transformer\.h)\.(\d+)\.")
# Tensors some HF checkpoints carry that moetron computes instead (RoPE frequencies) or does not have.
IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"), re.compile(r".*\.attn\.(masked_)?bias$"))
# An MTP module's copies of the shared embedding and head (DeepSeek's release stores them per module).
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


# ---------------------------------------------------------------------------- layers
def layer_of(name: str) -> int | None:
    found = LAYER.match(name)
    return int(found.group(1)) if found else None


def _weights_layers(weights: HFWeights) -> tuple[list[int], list[int]]:
    """(decoder layer indices, MTP module layer indices) the weights hold; an MTP module is a layer with eh_proj."""
    layers = sorted({i for i in map(layer_of, weights.names()) if i is not None})
    mtp = [i for i in layers if f"model.layers.{i}.eh_proj.weight" in weights]
    return [i for i in layers if i not in mtp], mtp


def _span(indices: list[int], prefix: str) -> str:
    if len(indices) == 1:
        return f"{prefix}{indices[0]}"
    return f"{prefix}{indices[0]}–{indices[-1]}" if indices == list(range(indices[0], indices[-1] + 1)) else (
        f"{prefix}{{{', '.join(map(str, indices))}}}"
    )  # fmt: skip


def check_layers(weights: HFWeights, cfg: ModelConfig, layers_field: str, mtp_field: str | None, source: str) -> None:
    """config.json's layer count (`layers_field`) and MTP module count (`mtp_field`; None: the class reads no MTP
    modules) against the layers the weights hold, one line naming both when they disagree."""
    decoder, mtp = _weights_layers(weights)
    if not decoder and not mtp:  # names of another layout: the rules name the tensors they miss
        return
    prefix = "transformer.h." if any(n.startswith("transformer.h.") for n in weights.names()) else "model.layers."
    count = len(decoder)
    if decoder and decoder != list(range(count)):
        gaps = sorted(set(range(decoder[-1] + 1)) - set(decoder))
        raise UserError(
            f"{source}: the weights hold no {_span(gaps, prefix)} but do hold {prefix}{decoder[-1]}; the files are "
            f"incomplete (download them again)"
        )
    if count != cfg.num_layers:
        extra = f" and {len(mtp)} MTP module(s) ({_span(mtp, 'model.layers.')})" if mtp else ""
        fix = f"set {layers_field} to {count}" + (f" (and {mtp_field} to {len(mtp)})" if mtp and mtp_field else "")
        raise UserError(
            f"{source}: config.json's {layers_field} {cfg.num_layers} disagrees with the weights, which hold {count} "
            f"decoder layers ({_span(decoder, prefix) if decoder else 'none'}){extra}; {fix}, or use the config.json "
            f"that came with these weights"
        )
    if not mtp or len(mtp) <= cfg.mtp_num_layers:
        return
    unread = mtp[cfg.mtp_num_layers :]
    what = f"{len(unread)} MTP module(s) ({_span(unread, 'model.layers.')}: enorm, hnorm, eh_proj, a layer)"
    if mtp_field is None:
        raise UserError(
            f"{source}: the weights hold {what}, which this class's import does not read (moetron reads "
            f"DeepseekV3ForCausalLM's and Glm4MoeForCausalLM's); remove their tensors from the files to import the "
            f"model alone"
        )
    raise UserError(
        f"{source}: the weights hold {what} past config.json's {mtp_field} {cfg.mtp_num_layers}; set {mtp_field} to "
        f"{len(mtp)} to import them (moetron's --mtp-num-layers {len(mtp)}), or remove their tensors from the files"
    )


# ---------------------------------------------------------------------------- what no rule reads
def unplaced(weights: HFWeights, rules: list[Rule], cfg: ModelConfig) -> list[str]:
    """The HF tensors no rule reads, other than known extras (RoPE buffers, a tied checkpoint's stored output layer,
    the imported MTP modules' copies of the shared embedding and head)."""
    used = {n for r in rules for n in r.hf}
    tied = not cfg.untie_embeddings_and_output_weights
    copies = {f"model.layers.{cfg.num_layers + k}.{n}" for k in range(cfg.mtp_num_layers) for n in MTP_COPIES}
    left = []
    for name in weights.names():
        if name in used or name in copies or any(p.match(name) for p in IGNORED):
            continue
        if name == "lm_head.weight" and tied:  # some checkpoints store the tied output layer anyway
            continue
        left.append(name)
    return left


# ---------------------------------------------------------------------------- shapes
Implied = Callable[[tuple[int, ...], dict], list[tuple[str, float]]]


def _head_dim(hf: dict) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def _experts_key(hf: dict) -> str:
    return next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in hf), "n_routed_experts")


def _expert_ffn_key(hf: dict) -> str:
    return "moe_intermediate_size" if "moe_intermediate_size" in hf else "intermediate_size"


def _q_head_dim(hf: dict) -> int:
    """A query head's channels: MLA's no-position + rotary parts, else head_dim."""
    if "qk_nope_head_dim" in hf:
        return int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])
    return _head_dim(hf)


# tensor name pattern → the config.json fields its shape implies (field, value), in the order they are checked
IMPLIED: list[tuple[re.Pattern, Implied]] = [
    (re.compile(r"self_attn\.kv_a_proj_with_mqa\.weight$"),
     lambda s, hf: [("kv_lora_rank", s[0] - int(hf.get("qk_rope_head_dim") or 0)), ("hidden_size", s[1])]),
    (re.compile(r"self_attn\.kv_a_layernorm\.weight$"), lambda s, hf: [("kv_lora_rank", s[0])]),
    (re.compile(r"self_attn\.kv_b_proj\.weight$"), lambda s, hf: [("kv_lora_rank", s[1])]),
    (re.compile(r"self_attn\.q_a_proj\.weight$"), lambda s, hf: [("q_lora_rank", s[0]), ("hidden_size", s[1])]),
    (re.compile(r"self_attn\.q_a_layernorm\.weight$"), lambda s, hf: [("q_lora_rank", s[0])]),
    (re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$"),
     lambda s, hf: [("num_key_value_heads", s[0] / _head_dim(hf))] + ([("hidden_size", s[1])] if len(s) > 1 else [])),
    (re.compile(r"self_attn\.q_proj\.(weight|bias)$"),
     lambda s, hf: [("num_attention_heads", s[0] / _q_head_dim(hf))] + ([("hidden_size", s[1])] if len(s) > 1 else [])),
    (re.compile(r"self_attn\.o_proj\.weight$"), lambda s, hf: [("hidden_size", s[0])]),
    (re.compile(r"self_attn\.[qk]_norm\.weight$"), lambda s, hf: [("head_dim", s[0])]),
    (re.compile(r"(embed_tokens|lm_head|shared_head\.head|wte)\.weight$"),
     lambda s, hf: [("vocab_size", s[0]), ("hidden_size" if "hidden_size" in hf else "n_embd", s[1])]),
    (re.compile(r"\.(gate|router)\.weight$"), lambda s, hf: [(_experts_key(hf), s[0]), ("hidden_size", s[1])]),
    (re.compile(r"experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"),
     lambda s, hf: [(_expert_ffn_key(hf), s[0]), ("hidden_size", s[1])]),
    (re.compile(r"experts\.\d+\.(down_proj|w2)\.weight$"),
     lambda s, hf: [(_expert_ffn_key(hf), s[1]), ("hidden_size", s[0])]),
    (re.compile(r"mlp\.(gate_proj|up_proj)\.weight$"), lambda s, hf: [("intermediate_size", s[0])]),
    (re.compile(r"mlp\.down_proj\.weight$"), lambda s, hf: [("intermediate_size", s[1])]),
    (re.compile(r"(input_layernorm|post_attention_layernorm|model\.norm|enorm|hnorm|shared_head\.norm)\.weight$"),
     lambda s, hf: [("hidden_size", s[0])]),
]  # fmt: skip


def _expected_shapes(rule: Rule, shape: torch.Size) -> list[tuple[int, ...]] | None:
    """The HF shapes the config implies for one rule (its export run on a meta tensor); None if it cannot tell."""
    try:
        return [tuple(t.shape) for t in rule.to_hf(torch.empty(shape, device="meta"))]
    except Exception:  # noqa: BLE001 - a layout transform meta tensors cannot run: the conversion still checks
        return None


def _disagreement(name: str, actual: tuple[int, ...], expected: tuple[int, ...], hf: dict) -> str:
    """The config.json field the weights' shape contradicts, with both values (else the two shapes)."""
    for pattern, implied in IMPLIED:
        if not pattern.search(name):
            continue
        try:
            candidates = implied(actual, hf)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError):
            break
        for field, value in candidates:
            configured = hf.get(field)
            if configured is not None and value != configured:
                shown = int(value) if float(value).is_integer() else f"{value:g} (not a whole number)"
                return f"config.json's {field} {configured} disagrees with the weights' {shown}"
        break
    return f"config.json's fields give {name} the shape {list(expected)}, the weights another"


def check_shapes(weights: HFWeights, rules: list[Rule], shapes: dict[str, torch.Size], hf: dict, source: str) -> None:
    """Each HF tensor a rule reads has the shape config.json implies (`shapes`: the model's tensors'); the first
    that does not is one line naming the field it contradicts with both values, and the tensor's file and shape."""
    for rule in rules:
        if rule.moetron not in shapes or not all(n in weights for n in rule.hf):
            continue  # a tensor missing from the files is named when it is read
        expected = _expected_shapes(rule, shapes[rule.moetron])
        if expected is None:
            continue
        for name, want in zip(rule.hf, expected, strict=True):
            got = weights.shape(name)
            if got != want:
                raise UserError(
                    f"{source}: {_disagreement(name, got, want, hf)} ({name} in {weights.file_of(name)} is "
                    f"{list(got)}); correct config.json, or use the one that came with these weights"
                )
