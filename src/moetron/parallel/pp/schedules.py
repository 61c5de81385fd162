"""torch.distributed.pipelining's stages and schedules over moetron's stage modules (imported only when pp > 1:
the pipelining package takes seconds to import).

    stages = pipeline_stages(parts, device, micro_batch_size, seq, logits_dtype, forward_context)
    schedule = build_schedule(parts.layout.schedule, stages, num_micro, loss_fn)
    schedule.step(tokens, target=labels, return_outputs=False)   # one optimizer step's micro-batches

Which schedule runs `--pipeline-schedule`:
  1f1b              Schedule1F1B (one stage per rank; needs at least pp micro-batches)
  gpipe             ScheduleGPipe (all forwards, then all backwards: more activation memory, any micro-batch count)
  interleaved-1f1b  ScheduleInterleaved1F1B (v stages per rank, `--num-layers-per-virtual-pipeline-stage`)
  zero-bubble       ScheduleInterleavedZeroBubble (ZB1P: the backward split into input and weight gradients, the
                    weight half filling the bubbles; one or several stages per rank)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed import pipelining

from moetron.parallel.dp.replicate import DataParallel
from moetron.parallel.pp.split import PipelineParts
from moetron.parallel.pp.weight_groups import exact_param_groups

ForwardContext = Callable[[int], contextlib.AbstractContextManager]  # micro-batch index → its context


class MoetronStage(pipelining.PipelineStage):
    """torch's `PipelineStage`, plus what moetron needs around each micro-batch:

    forward    inside `forward_context(micro-batch index)`: the layout-free random streams keyed by that
               micro-batch's first sample (so every schedule order reproduces the one-process draws) and autocast;
    backward   the expert-gradient reducer armed for the stage's last backward (torch's stage already runs DDP's
               `no_sync` for the others and prepares DDP's reduction for the last); zero bubble's input half
               groups the parameters with `merged_param_groups` (`weight_groups.py`: torch's can split one).
    """

    def __init__(
        self,
        data_parallel: DataParallel,
        forward_context: ForwardContext,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        input_args: torch.Tensor,
        output_args: torch.Tensor,
        group,
    ):
        super().__init__(
            data_parallel.module, stage_index, num_stages, device, input_args=input_args, output_args=output_args,
            group=group,
        )  # fmt: skip
        self.data_parallel, self.forward_context = data_parallel, forward_context

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        with self.forward_context(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        groups = exact_param_groups() if backward_type == "input" else contextlib.nullcontext()  # zero bubble
        with self.data_parallel.micro_batch(last_backward), groups:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def pipeline_stages(
    parts: PipelineParts,
    device: torch.device,
    micro_batch_size: int,
    seq_length: int,
    logits_dtype: torch.dtype,
    forward_context: ForwardContext,
) -> list[MoetronStage]:
    """One stage per local stage module. Shapes are given (static metadata), so torch runs no trial forward:
    one would count routing statistics, touch the expert-bias loads and run DDP's forward outside a step."""
    model = parts.modules[0]._model[0]
    # context parallelism: a rank runs its seq / cp tokens of every sequence (two zigzag chunks), end to end
    B, T, cfg = micro_batch_size, seq_length // parts.mesh.size("cp"), model.cfg
    tokens = torch.empty(B, T, dtype=torch.long, device="meta")
    # the fp32 residual stream; requires_grad: gradients flow back across the boundary. Sequence parallelism sends
    # each tensor-parallel rank's sequence shard to its peer of the next stage (same tp coordinate)
    shard_T = T // parts.mesh.size("tp") if parts.mesh.dims.sp else T
    hidden = torch.empty(B, shard_T, cfg.hidden_size, dtype=torch.float32, device="meta", requires_grad=True)
    logits = torch.empty(B, T, cfg.padded_vocab_size(), dtype=logits_dtype, device="meta", requires_grad=True)
    if any(m.last and m.emit_hidden for m in parts.modules):  # the last stage feeds the fused head + loss
        logits = torch.empty(B, T, cfg.hidden_size, dtype=torch.float32, device="meta", requires_grad=True)
    last, stages = parts.layout.num_stages - 1, []
    for index, dp in zip(parts.stage_indices, parts.data_parallel, strict=True):
        stage = MoetronStage(
            dp, forward_context, index, parts.layout.num_stages, device,
            input_args=tokens if index == 0 else hidden, output_args=logits if index == last else hidden,
            group=parts.mesh.group("pp"),
        )  # fmt: skip
        stages.append(stage)
    return stages


def build_schedule(name: str, stages: list[MoetronStage], num_micro: int, loss_fn: Callable):
    """The torch schedule for `--pipeline-schedule name` over this rank's stages.

    `scale_grads=False`: the executor already multiplies each micro-batch's loss (and, through the MoE layers'
    `aux_loss_grad_scale`, the aux losses) by loss_scale / num_micro, exactly as the one-process executor does."""
    if name in ("1f1b", "gpipe"):
        cls = pipelining.Schedule1F1B if name == "1f1b" else pipelining.ScheduleGPipe
        return cls(stages[0], num_micro, loss_fn=loss_fn, scale_grads=False)
    cls = pipelining.ScheduleInterleaved1F1B if name == "interleaved-1f1b" else pipelining.ScheduleInterleavedZeroBubble
    return cls(stages, num_micro, loss_fn=loss_fn, scale_grads=False)
