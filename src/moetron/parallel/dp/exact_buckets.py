"""DDP's dense all-reduce in a summation order that does not depend on the step: resume bit-exact.

DDP reduces its first iteration in one bucket holding every parameter in registration order, then rebuilds its
buckets once, from that first iteration's gradient-ready order (about the reverse, with 1 and 25 MiB caps). A ring
all-reduce sums each element over the ranks in an order set by the element's place in the reduced buffer, so the
same gradients reduced in the two layouts differ in the last bit (measured: a third of the elements of a tiny
model, at 4 gloo ranks). An uninterrupted run reduces its step k in the rebuilt layout; a run resumed at step k
reduces the same step in the first-iteration layout: its weights after step k differ in the last bit, and the
difference grows (`--moe-expert-replicas` made it show in the loss at EP 4; without them the same gradients
differed while the logged losses happened to match).

The fix keeps DDP (its buckets, its overlap with the backward, `no_sync`) and replaces only what it does with a
ready bucket (`register_comm_hook`, PyTorch's documented seam): each parameter's gradient is all-reduced in its own
collective, launched asynchronously, so every element is summed in an order fixed by its parameter alone,
whatever bucket carries it on whatever step. The cost is more, smaller collectives per bucket (one per dense
tensor instead of one per bucket); they are still launched as each bucket becomes ready, inside the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _all_reduce_each_gradient(group, bucket):  # unannotated: DDP checks annotations, strings here
    """The bucket's mean over `group`, one all-reduce per parameter (`bucket.gradients()` are views of
    `bucket.buffer()`, so reducing them in place reduces the buffer DDP copies back)."""
    size = dist.get_world_size(group)
    futures = []
    for grad in bucket.gradients():
        grad.div_(size)  # DDP's own hook divides before the sum too: the same values, summed per parameter
        futures.append(dist.all_reduce(grad, group=group, async_op=True).get_future())
    buffer = bucket.buffer()
    return torch.futures.collect_all(futures).then(lambda _: buffer)


def reduce_in_a_fixed_order(ddp: DistributedDataParallel) -> None:
    """Install the per-parameter reduction on `ddp` (before its first forward)."""
    ddp.register_comm_hook(ddp.process_group, _all_reduce_each_gradient)
