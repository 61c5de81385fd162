"""The one registry of parameter kinds: which tensors are experts, which decay, how each is laid out.

Everything that treats parameters differently reads this registry — data parallelism (dense over dp, experts
over edp), gradient clipping (which groups a squared norm is summed over), weight decay, the expert-gradient
reduction and the checkpoint (experts stored by global expert id) — so no module finds "the experts" by a rule
of its own. It is built from the model's structure before any wrapping, keyed by parameter name (names never
change: layers are keyed by their global index, and the wrappers used keep names).

Kinds:
  dense   one copy per data-parallel replica (attention, dense MLPs, norms, embeddings, routers, shared experts,
          PR-MoE's residual MLP)
  expert  routed experts `[E_local, …]` of a MoE layer: dim 0 is the local expert, global id = offset + index;
          sharded over the expert-parallel group, replicated over the expert-data-parallel group
Optimizer roles: `matrix` marks the hidden weight matrices Muon orthogonalises (`--optimizer muon`): every
`nn.Linear` weight but the LM head's and the gates' (PR-MoE's coefficient, the shared-expert gate; the router owns
its weight outside any Linear), and every expert stack (`GroupedExperts`, routed or shared: each `[E, in, out]`
expert its own matrix). `qkv_heads` marks attention's fused `query_key_value` weight, whose rows are grouped by
key/value head (`model/attention.py`): Muon orthogonalises its Q, K and V rows as three matrices (`--muon-split-qkv`).
Embeddings, the head, gates, norms and biases stay with AdamW (Muon's rule: only the hidden layers' 2-D weights).
The layout along tensor parallelism (`tp_dim`, the dimension split over the TP ranks) is recorded by
`parallel.tp.apply_tp.record_tp_layouts`: None (replicated) until then. A split parameter holds 1 / tp of its tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

from torch import nn

from moetron.model.attention import SelfAttention
from moetron.model.moe.experts.grouped import GroupedExperts

NO_DECAY_NAME_PARTS = ("bias", "norm", "ln_", "layernorm")
# Linear layers that gate or mix branches rather than transform the hidden state: AdamW, like the router
GATE_LINEARS = ("coefficient", "shared_expert_gate")


@dataclass(frozen=True)
class ParamInfo:
    name: str
    kind: str  # "dense" | "expert"
    decay: bool  # weight decay applies (Megatron: matrices yes; biases, norms, 1-D tensors no)
    expert_offset: int = 0  # expert kind: global id of local expert 0
    num_local_experts: int = 0
    num_global_experts: int = 0
    tp_dim: int | None = None  # the dimension split over the tensor-parallel ranks (None: replicated over them)
    matrix: bool = False  # a hidden weight matrix (Muon orthogonalises it; see the module docstring)
    # attention's fused QKV weight: (query heads per key/value group, head dim), the row layout of one group
    qkv_heads: tuple[int, int] | None = None

    @property
    def is_expert(self) -> bool:
        return self.kind == "expert"

    def fan_out_in(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(outputs, inputs) of one matrix of a hidden matrix of this `shape`: a Linear weight is `[out, in]`, an
        expert stack (`GroupedExperts`: routed or shared) `[E, in, out]` (its experts compute `x · w`)."""
        return (shape[-1], shape[-2]) if len(shape) == 3 else (shape[-2], shape[-1])


def decays(name: str, ndim: int) -> bool:
    """Whether weight decay applies: matrices yes; biases, norms and any 1-D tensor no (Megatron's
    `get_param_groups`). Stacked expert biases `b1_EF`/`b2_ED` are 2-D but still biases: the name decides."""
    leaf = name.rsplit(".", 1)[-1].lower()
    if ndim < 2 or re.match(r"b\d", leaf):
        return False
    return not any(part in name.lower() for part in NO_DECAY_NAME_PARTS)


def expert_containers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every routed-expert container: a MoE layer's `experts` (knows its expert offset)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and hasattr(module, "expert_offset"):
            yield name, module


def fused_qkv_weights(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Name → (query heads per key/value group, head dim) of every fused `query_key_value` weight."""
    return {
        f"{prefix}.query_key_value.weight": (module.queries_per_group, module.head_dim)
        for prefix, module in model.named_modules()
        if isinstance(module, SelfAttention)
    }


def hidden_matrices(model: nn.Module) -> set[str]:
    """Names of the hidden weight matrices: Linear weights but the LM head's and the gates', and the weight stacks
    of every `GroupedExperts` (routed experts, shared experts, PR-MoE's residual MLP; 3-D: biases `[E, F]` are 2-D)."""
    head = getattr(model, "output_layer", None)
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head and prefix.rsplit(".", 1)[-1] not in GATE_LINEARS:
            names.add(f"{prefix}.weight")
        if isinstance(module, GroupedExperts):
            names |= {f"{prefix}.{leaf}" for leaf, p in module.named_parameters(recurse=False) if p.ndim == 3}
    return names


class ParamRegistry:
    """`ParamInfo` of every parameter of a model, by name."""

    def __init__(self, infos: dict[str, ParamInfo]):
        self.infos = infos

    @classmethod
    def from_model(cls, model: nn.Module) -> ParamRegistry:
        expert_of: dict[str, nn.Module] = {}
        for prefix, container in expert_containers(model):
            for leaf, _ in container.named_parameters():
                expert_of[f"{prefix}.{leaf}"] = container
        matrices, qkv = hidden_matrices(model), fused_qkv_weights(model)
        infos = {}
        for name, param in model.named_parameters():
            container = expert_of.get(name)
            if container is None:
                matrix = name in matrices
                infos[name] = ParamInfo(name, "dense", decays(name, param.ndim), matrix=matrix, qkv_heads=qkv.get(name))
            else:
                infos[name] = ParamInfo(
                    name,
                    "expert",
                    decays(name, param.ndim),
                    expert_offset=container.expert_offset,
                    num_local_experts=container.num_experts,
                    num_global_experts=container.num_global_experts,
                    matrix=name in matrices,
                )
        return cls(infos)

    def __getitem__(self, name: str) -> ParamInfo:
        return self.infos[name]

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self, kind: str | None = None) -> set[str]:
        return {n for n, info in self.infos.items() if kind is None or info.kind == kind}

    def named_parameters(self, model: nn.Module, kind: str | None = None) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of `model` of the given kind, in the model's order."""
        return [
            (n, p) for n, p in model.named_parameters() if n in self.infos and (kind is None or self[n].kind == kind)
        ]

    def set_tp_dim(self, name: str, dim: int) -> None:
        self.infos[name] = replace(self.infos[name], tp_dim=dim)
