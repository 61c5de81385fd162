"""Zero bubble's parameter groups, merged correctly (torch's `get_param_groups` can leave a parameter in two).

torch's `stage_backward_input` splits a stage's parameters into groups: the parameters whose paths meet the
input-gradient path at shared nodes ("intermediates"); `stage_backward_weight` later runs one `autograd.grad` per
group from the gradients captured at those nodes, freeing the graph behind them. torch builds the groups in one pass
over each parameter's intermediates, in set (hash) order: when a parameter first starts a group of its own at one
intermediate and then meets an earlier group at the next, it joins the earlier group but its own group stays
registered too. The parameter is then in two groups, and the weight pass walks their shared nodes twice: the second
walk finds them freed ("backward through the graph a second time"), or, retained, adds the gradient twice.

Plain models never hit it: each parameter meets the input path at one node. Expert replicas do
(`parallel/ep/replicas.py`): every expert weight feeds the one concatenated buffer of the replica all-to-all, so
each meets it at several nodes (its own experts' GEMM or bias add, the replicas', their join). Which group survives
there depends on hash order, so it differed between the EP ranks too, and the replica all-to-all's backward (in the
weight pass: its input is the weights only) ran once on one rank and twice on the other.

`merged_param_groups` is the same grouping as a union-find over the parameters, in the stages' parameter order:
each parameter in one group, the groups (and each group's intermediates) in an order that is the same on every rank
and every run, so a group's collective (the replica all-to-all's backward) runs in the same place on every EP rank.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

from torch.autograd.graph import Node
from torch.distributed.pipelining import _backward


def _closure(roots: list[Node], targets: set[Node], reverse_edges: dict) -> tuple[set[Node], list[Node]]:
    """torch's `reverse_closure` (nodes reachable from roots along reverse edges, stopping at targets), with the
    targets met in discovery order (a list), not a set's order."""
    closure: set[Node] = {n for n in roots if n is not None}
    queue = collections.deque(n for n in dict.fromkeys(roots) if n is not None)
    met: dict[Node, None] = {}
    while queue:
        for fn in reverse_edges[queue.popleft()]:
            if fn is None or fn in closure:
                continue
            if fn in targets:
                met[fn] = None
                continue
            closure.add(fn)
            queue.append(fn)
    return closure, list(met)


def merged_param_groups(inputs: list[Node], params: list[Node], reverse_edges: dict) -> list[dict[str, Any]]:
    """torch's `get_param_groups` (same arguments, same result shape), each parameter in exactly one group."""
    inputs_closure, _ = _closure(inputs, set(), reverse_edges)
    met = [_closure([param], inputs_closure, reverse_edges)[1] for param in params]
    parent = list(range(len(params)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_at: dict[Node, int] = {}
    for i, nodes in enumerate(met):
        for node in nodes:
            if node in first_at:
                a, b = root(first_at[node]), root(i)
                parent[max(a, b)] = min(a, b)  # the group keeps its first parameter's place
            else:
                first_at[node] = i
    groups: dict[int, dict[str, Any]] = {}
    for i, nodes in enumerate(met):
        if not nodes:  # meets the input path nowhere (torch leaves such a parameter out too)
            continue
        group = groups.setdefault(root(i), {"params": {}, "intermediates": {}})
        group["params"][params[i]] = None
        group["intermediates"].update(dict.fromkeys(nodes))
    # torch reads "params" as a collection of grad accumulators and turns "intermediates" into a list itself
    return [{"params": list(g["params"]), "intermediates": list(g["intermediates"])} for g in groups.values()]


@contextlib.contextmanager
def exact_param_groups() -> Iterator[None]:
    """`stage_backward_input` with `merged_param_groups` inside (it looks the function up in its module)."""
    saved = _backward.get_param_groups
    _backward.get_param_groups = merged_param_groups
    try:
        yield
    finally:
        _backward.get_param_groups = saved
