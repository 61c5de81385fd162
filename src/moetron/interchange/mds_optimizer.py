"""Megatron-DeepSpeed's optimizer state (`expp_rank_<R>_mp_rank_00_optim_states.pt`) → moetron's.

Those files hold `torch.optim` state dicts: state keyed by parameter INDEX, indices numbered through the param
groups in order. Which parameter an index is follows from how Megatron-DeepSpeed built the groups
(`megatron/optimizer/__init__.py: get_param_groups` walks `model.named_parameters()` into a weight-decay and a
no-weight-decay group — no decay for biases and 1-D tensors — and DeepSpeed's
`split_params_into_different_moe_groups_for_optimizer` moves each group's expert parameters, in order, to groups
marked `moe` (chunked by size)). So: rebuild EP rank R's `named_parameters()` order from the checkpoint (the
non-expert tensors in state-dict order, each MoE layer's local experts right after its gate), sort it into the four
(expert?, decays?) queues, and hand each saved group its next `len(params)` names. Every moment's shape is checked
against its parameter's. The moments then go through the weights' own recipes (`mds_tensors.recipes`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moetron.errors import UserError
from moetron.interchange.mds_tensors import MDSTensors, recipes
from moetron.interchange.safe_load import load_pt
from moetron.model.config import ModelConfig

EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")


def _decays(name: str, shape: torch.Size) -> bool:
    return not (name.endswith(".bias") or len(shape) == 1)


def parameter_order(source: MDSTensors, cfg: ModelConfig, ep_rank: int, ep_size: int) -> list[tuple[str, torch.Size]]:
    """EP rank `ep_rank`'s parameters in `named_parameters()` order, by Megatron name with GLOBAL expert ids."""
    by_layer: dict[str, list[str]] = {}  # gate name → the expert parameter names of that layer, in order
    for name in source.experts:
        match = EXPERT.match(name)
        by_layer.setdefault(match.group(1).replace("experts.deepspeed_experts.", "gate.wg.weight"), []).append(name)
    order = []
    for name, tensor in source.shards[0].items():
        order.append((name, tensor.shape))
        if name in by_layer:
            experts = sorted({int(EXPERT.match(n).group(2)) for n in by_layer[name]})
            local = len(experts) // ep_size
            leaves = [EXPERT.match(n).group(3) for n in by_layer[name] if int(EXPERT.match(n).group(2)) == 0]
            for g in range(ep_rank * local, (ep_rank + 1) * local):
                prefix = EXPERT.match(by_layer[name][0]).group(1)
                order += [(f"{prefix}{g}{leaf}", source.experts[f"{prefix}{g}{leaf}"].shape) for leaf in leaves]
    return order


def index_names(param_groups: list[dict], order: list[tuple[str, torch.Size]], where: Path) -> dict[int, str]:
    """Saved parameter index → Megatron name, group by group (see the module docstring)."""
    queues: dict[tuple[bool, bool], list[str]] = {}
    for name, shape in order:
        queues.setdefault((bool(EXPERT.match(name)), _decays(name, shape)), []).append(name)
    names = {}
    for group in param_groups:
        decay = group.get("wd_mult", 1.0 if group.get("weight_decay", 0) else 0.0) != 0
        queue = queues.get((bool(group.get("moe", False)), decay), [])
        if len(queue) < len(group["params"]):
            raise UserError(
                f"{where}: its param group {group.get('name')!r} has {len(group['params'])} parameters "
                f"but the model has {len(queue)} left of that kind; import with --no-optim"
            )
        for index in group["params"]:
            names[index] = queue.pop(0)
    if any(queues.values()):
        raise UserError(f"{where}: {sum(map(len, queues.values()))} parameters have no optimizer state; --no-optim")
    return names


def read_moments(step: Path, source: MDSTensors, cfg: ModelConfig, allow_pickle: bool, ep_size: int = 1):
    """({Megatron name: {state key: tensor}}, why not) from every EP rank's optimizer file (`ep_size` of them, as the
    saved args say; a missing one is refused naming it, not mistaken for a smaller EP)."""
    if list(step.glob("*zero_pp_rank_*_optim_states.pt")):
        return None, "ZeRO-partitioned optimizer state (zero_pp_rank_* files) is not read"
    if len(source.shards) > 1:
        return None, "tensor-parallel optimizer state is not merged (only the weights are)"
    files = sorted(step.glob("expp_rank_*_mp_rank_00_optim_states.pt"), key=lambda p: int(p.name.split("_")[2]))
    if not files:
        return None, "the checkpoint holds no expp_rank_*_optim_states.pt files"
    ranks = max(ep_size, 1 + max(int(p.name.split("_")[2]) for p in files))
    expected = [step / f"expp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(ranks)]
    missing = [path.name for path in expected if path not in files]
    if missing:
        raise UserError(
            f"{step}: {missing[0]} is missing (the checkpoint was saved by {ranks} expert-parallel ranks, one "
            f"optimizer file each); restore it, or import the weights alone with --no-optim"
        )
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for ep_rank, path in enumerate(files):
        optimizer = load_pt(path, allow_pickle).get("optimizer") or {}
        if "state" not in optimizer or "param_groups" not in optimizer:
            return None, f"{path.name} holds DeepSpeed's fp16/bf16 optimizer wrapper (flat fp32 groups), not read"
        order = parameter_order(source, cfg, ep_rank, len(files))
        shapes = dict(order)
        for index, name in index_names(optimizer["param_groups"], order, path).items():
            state = optimizer["state"].get(index, {})
            for key, value in state.items():
                if key != "step" and value.shape != shapes[name]:
                    raise UserError(
                        f"{path}: state {key} of {name} has shape {tuple(value.shape)}, the parameter "
                        f"{tuple(shapes[name])}; import with --no-optim"
                    )
            moments.setdefault(name, {}).update(state)
    return moments, ""


def optimizer_tensors(
    step: Path, source: MDSTensors, cfg: ModelConfig, layout: str, allow_pickle: bool = False, ep_size: int = 1
):
    """(`<moetron parameter>.<key>` → tensor, or None; why not) for moetron's AdamW (exp_avg, exp_avg_sq, step)."""
    moments, why = read_moments(step, source, cfg, allow_pickle, ep_size)
    if moments is None:
        return None, why
    steps = [float(s["step"]) for s in moments.values() if "step" in s]
    if not steps:
        return None, "the optimizer state has no step count"
    out = {}
    for name, recipe in recipes(cfg, layout).items():
        for key in ("exp_avg", "exp_avg_sq"):

            def get(source_name: str, key=key) -> list[torch.Tensor]:
                state = moments.get(source_name, {})
                if key not in state:
                    raise UserError(
                        f"{step}: no {key} for {source_name} in the optimizer files; import with --no-optim"
                    )
                return [state[key]]

            out[f"{name}.{key}"] = recipe.build(get).float().contiguous()
        out[f"{name}.step"] = torch.tensor(max(steps), dtype=torch.float32)
    return out, ""
