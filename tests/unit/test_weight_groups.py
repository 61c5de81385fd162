"""`merged_param_groups`: zero bubble's parameter groups with each parameter in exactly one group."""

from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph

from moetron.parallel.pp.weight_groups import merged_param_groups


def test_weights_meeting_the_input_path_at_shared_nodes_form_one_group():
    # like expert replicas: a and b each meet the input path at their own node and at a shared one (the join)
    x = torch.randn(3, 4, requires_grad=True)
    a, b, c = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    joint = torch.cat([a, b]).sum()  # both weights feed one buffer, like the replica all-to-all's
    out = (x @ a).sum() + (x @ b).sum() + x.sum() * joint + (x @ c).sum()
    params = [_get_grad_fn_or_grad_acc(p) for p in (a, b, c)]
    groups = merged_param_groups([_get_grad_fn_or_grad_acc(x)], params, construct_reverse_graph([out.grad_fn]))
    assert [g["params"] for g in groups] == [params[:2], params[2:]]  # first parameter's order, once each
    assert len(groups[0]["intermediates"]) == 3 and len(groups[1]["intermediates"]) == 1
    assert all(isinstance(g["intermediates"], list) for g in groups)  # discovery order, the same every run
