"""`moetron import --hf DIR --save OUT`: a Hugging Face model directory → a moetron run directory.

    result = import_hf("hf/qwen2-moe", "runs/qwen2-moe")
    # moetron train --config runs/qwen2-moe/config.yaml --load runs/qwen2-moe --finetune --data-path ...

Reads `config.json` (the architecture: GPT-2, Llama, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE,
or a moetron remote-code export), maps every tensor with the architecture's rules (`hf_architectures.py`, the same
rules export uses), and writes the checkpoint (fp32 master weights, whatever the files' dtype) and a config.yaml; the
tokenizer files are copied into OUT/tokenizer/. The tensors are read one at a time from the safetensors (or PyTorch
`.bin`, read with `weights_only=True`) files; the converted model is held once in memory for the checkpoint write.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.config import RunConfig
from moetron.errors import UserError
from moetron.interchange.hf_architectures import Architecture, architectures
from moetron.interchange.hf_deepseek_v3 import mtp_layers_present
from moetron.interchange.hf_tensor_rules import Rule, same
from moetron.interchange.hf_weight_checks import check_layers, check_shapes, unplaced
from moetron.interchange.new_run import check_new_run_dir, model_shapes, write_run
from moetron.interchange.safetensors_stream import HFWeights
from moetron.interchange.tokenizer_files import import_tokenizer
from moetron.model.config import ModelConfig


@dataclass
class ImportResult:
    path: Path  # the checkpoint's iter_* directory
    hf_class: str
    cfg: RunConfig
    notes: list[str]


def read_hf_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UserError(f"--hf {hf_dir}: no config.json there; give a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"--hf {hf_dir}: config.json is not JSON ({err})") from None


def architecture_of(hf: dict, hf_dir: Path) -> Architecture | None:
    """The architecture named by `model_type` (None: a moetron remote-code export)."""
    model_type = hf.get("model_type")
    if model_type == "moetron":
        return None
    found = next((a for a in architectures() if a.model_type == model_type), None)
    if found is None:
        names = ", ".join(a.model_type for a in architectures())
        raise UserError(f"--hf {hf_dir}: model_type {model_type!r} is not one moetron imports ({names}, moetron)")
    return found


def _model_config(arch: Architecture | None, hf: dict) -> ModelConfig:
    fields = dict(hf["moetron"]) if arch is None else arch.model_fields(hf)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})


def layer_fields(arch: Architecture | None, hf: dict) -> tuple[str, str | None]:
    """config.json's names for the decoder layer count and the MTP module count (None: the class reads none)."""
    if arch is None:
        return "moetron.num_layers", "moetron.mtp_num_layers"
    layers = "n_layer" if "n_layer" in hf else "num_hidden_layers"
    if not getattr(arch, "mtp", False):
        return layers, None
    return layers, "num_mtp_layers" if "num_mtp_layers" in hf and "num_nextn_predict_layers" not in hf else (
        "num_nextn_predict_layers"
    )  # fmt: skip


def convert_tensors(
    weights: HFWeights,
    rules: list[Rule],
    cfg: ModelConfig,
    source: str,
    arch: Architecture | None = None,
    hf: dict | None = None,
) -> dict[str, torch.Tensor]:
    """moetron name → fp32 tensor, by the rules; the model's tensors no rule makes are zero (expert biases). Every
    tensor in the files is placed or refused: with config.json (`hf`, of class `arch`) given, its layer counts and
    each tensor's shape are checked against the weights first, one line naming both values when they disagree."""
    shapes = model_shapes(RunConfig(model=cfg))
    if hf is not None:
        check_layers(weights, cfg, *layer_fields(arch, hf), source)
        check_shapes(weights, rules, shapes, hf, source)
    left = unplaced(weights, rules, cfg)
    if left:
        raise UserError(
            f"{source}: tensors moetron has no place for: {', '.join(left[:4])}"
            f"{' …' if len(left) > 4 else ''}; is config.json from this checkpoint?"
        )
    tensors = {rule.moetron: rule.to_moetron([weights.get(n) for n in rule.hf]).float().contiguous() for rule in rules}
    for name, shape in shapes.items():
        if name not in tensors and name.endswith("router.expert_bias"):
            tensors[name] = torch.zeros(shape)
    return tensors


def import_hf(hf_dir: str, save: str, seq_length: int | None = None) -> ImportResult:
    source = Path(hf_dir)
    check_new_run_dir(save)
    hf = read_hf_config(source)
    arch = architecture_of(hf, source)
    cfg = RunConfig(model=_model_config(arch, hf))
    if seq_length is not None:
        cfg.model.seq_length = seq_length
    weights = HFWeights(source)
    notes: list[str] = []
    if cfg.model.mtp_num_layers and arch is not None:  # config.json names MTP modules the weights may not hold
        present = mtp_layers_present(cfg.model, weights)
        if present < cfg.model.mtp_num_layers:
            notes.append(f"config.json names {cfg.model.mtp_num_layers} MTP modules, the weights hold {present}")
            cfg.model.mtp_num_layers = present
    rules = arch.import_rules(cfg.model, hf) if arch is not None else [same(n, f"model.{n}") for n in model_shapes(cfg)]
    tensors = convert_tensors(weights, rules, cfg.model, f"--hf {hf_dir}", arch, hf)
    hf_class = arch.hf_class if arch is not None else "MoetronForCausalLM"
    notes = [f"imported by `moetron import --hf {hf_dir}` ({hf_class})", *notes]
    Path(save).mkdir(parents=True, exist_ok=True)
    data_fields = import_tokenizer(source, Path(save))
    if data_fields:
        cfg.data = dataclasses.replace(cfg.data, **data_fields)
    else:
        notes.append("no tokenizer files in the HF directory: set --tokenizer-type/--vocab-file/... to train")
    if getattr(arch, "placement", None) is not None:
        notes.append(
            "training-only routing settings are the family's recipe (see moetron/interchange/hf_config_import.py)"
        )
    path = write_run(save, cfg, tensors, notes, source=f"--hf {hf_dir}")
    return ImportResult(path, hf_class, cfg, notes)
