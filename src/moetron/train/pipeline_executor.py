"""The pipeline executor: `LocalExecutor.forward_backward`'s contract, run by a torch.distributed.pipelining schedule.

    executor = PipelineExecutor(parallel, autocast, micro_batch_size, seq, num_micro, dtype)
    lm_loss = executor.forward_backward(next_micro_batch, num_micro, loss_scale)   # the same value on every rank
    stats = executor.moe_step_stats()          # MoEStats [L_moe] of EVERY MoE layer, whichever stage holds it

Every rank reads all of the step's micro-batches from its loader (cheap memmap reads, and every stage's loader
keeps the same position for the checkpoint); the first stage feeds the tokens, the last the labels. Around each
micro-batch's forward, on every stage, the random streams are keyed by that micro-batch's first sample
(`STREAMS.micro_batch`), so dropout and random token selection draw exactly what the one-process run draws in
whatever order the schedule runs the micro-batches. The loss function (last stage: `parallel.head_loss`, on the
hidden states the last stage then emits when it is the fused head, else on its logits) multiplies each LM loss by
loss_scale / num_micro, the fused head is told that factor and the MoE aux losses' gradients are that factor in
their layers (`aux_loss_grad_scale`): the gradients are the one-process executor's, and the schedule rescales
nothing.

With --mtp-num-layers the last stage runs the MTP modules in its forward (`pp/split.py`) on the tokens and labels
of the micro-batch it is running (`_mtp_batch`, training only), and the loss function adds
--mtp-loss-scaling-factor × that micro-batch's MTP loss to its LM loss before the schedule's backward, as the
one-process executor does; the step's mean MTP loss joins the LM loss in the all-reduce below.

After the schedule one all-reduce over the pipeline group carries the LM loss (computed on the last stage) and
every MoE layer's statistics (each computed on its own stage, placed at its global MoE-layer row) to every rank,
so logs, NaN checks and `moe_loss` equal the one-process run's. Evaluation runs the same schedule forward-only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from moetron.model.moe.aux_loss import aux_loss_grad_scale
from moetron.model.moe.stats import MoEStats, MoEStepRecord
from moetron.model.rng import STREAMS
from moetron.parallel.diagnosis import Site
from moetron.parallel.parallelize import ParallelModel
from moetron.parallel.pp.schedules import build_schedule, pipeline_stages
from moetron.train.micro_batch import MicroBatch


class PipelineExecutor:
    """This rank's pipeline stages, driven micro-batch by micro-batch by torch's schedule."""

    def __init__(
        self,
        parallel: ParallelModel,
        autocast: Callable[[], contextlib.AbstractContextManager],
        micro_batch_size: int,
        seq_length: int,
        num_micro: int,
        logits_dtype: torch.dtype = torch.float32,
    ):
        self.parallel, self.autocast, self.head_loss = parallel, autocast, parallel.head_loss
        self.parts, self.model = parallel.pipeline, parallel.model
        self.num_micro = num_micro
        self.device = next(self.model.parameters()).device
        self._phase, self._first_samples = "train", []
        self._losses: list[torch.Tensor] = []  # this step's unscaled LM losses (last stage), in micro-batch order
        self._factor = 1.0  # this step's loss_scale / num_micro (1.0 in evaluation)
        self.last_mtp_loss: torch.Tensor | None = None  # the last step's mean MTP loss (--mtp-num-layers), fp64
        self._mtp_losses: list[torch.Tensor] = []  # this step's MTP losses (last stage), in micro-batch order
        self._batches: list[MicroBatch] = []
        self._running = 0  # the micro-batch whose forward runs now (the schedule's chunk id)
        self._mtp_stage = None  # the last stage module, when it runs the MTP modules
        for module in self.parts.modules:
            if module.last and self.model.mtp is not None:
                module.mtp_batch, module.mtp_head_loss, self._mtp_stage = self._mtp_batch, self.head_loss, module
        self._moe_stats: MoEStats | None = None
        self.moe_record = MoEStepRecord.attached_to(self.model.moe_layers())  # this rank's layers' routing reports
        moe_indices = self.model.cfg.routed_layer_indices()
        self._moe_rows = {layer: row for row, layer in enumerate(moe_indices)}  # global layer → MoE-layer row
        stages = pipeline_stages(
            self.parts, self.device, micro_batch_size, seq_length, logits_dtype, self._micro_batch_context
        )
        self.schedule = build_schedule(self.parts.layout.schedule, stages, num_micro, self._scaled_loss)
        pp_group, stage = self.parts.mesh.group("pp"), self.parts.mesh.coords.pp
        self._send_recv_site = Site(f"the pipeline send/recv of stage {stage}", pp_group, "pipeline")
        self._reduce_site = Site("the pipeline's loss all-reduce", pp_group, "pipeline")

    # ------------------------------------------------------------ per micro-batch (called by the schedule)
    @contextlib.contextmanager
    def _micro_batch_context(self, index: int) -> Iterator[None]:
        self._running = index
        with STREAMS.micro_batch(self._phase, self._first_samples[index]), self.autocast():
            yield

    def _mtp_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens, labels) of the running micro-batch for the last stage's MTP modules; None in evaluation."""
        if self._phase != "train":
            return None
        mb = self._batches[self._running]
        return mb.tokens_BT, mb.labels_BT

    def _scaled_loss(self, output: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        """The last stage's output (hidden states for the fused head, else logits) → the LM loss × the step's
        factor."""
        with self.autocast():
            if self.head_loss.fused:
                lm_loss = self.head_loss.with_grad_scale(self._factor)(self.model, output, labels_BT)
            else:
                lm_loss = self.head_loss.loss_fn(output, labels_BT)
        self._losses.append(lm_loss.detach())
        loss = lm_loss
        if self._mtp_stage is not None and self._mtp_stage.mtp_losses:  # this micro-batch's (forward, then loss)
            mtp_loss = self._mtp_stage.mtp_losses.pop(0)
            self._mtp_losses.append(mtp_loss.detach())
            loss = lm_loss + self.model.cfg.mtp_loss_scaling_factor * mtp_loss
        return loss * self._factor

    # ------------------------------------------------------------ one optimizer step
    def _feed(self, micro_batches: list[MicroBatch], phase: str) -> tuple[tuple, torch.Tensor | None]:
        """(schedule inputs, targets) of this rank: tokens for the first stage, labels for the last."""
        self._phase, self._first_samples, self._losses = phase, [mb.first_sample for mb in micro_batches], []
        self._batches, self._mtp_losses = micro_batches, []
        args = (torch.cat([mb.tokens_BT for mb in micro_batches]),) if self.parts.holds_first else ()
        target = torch.cat([mb.labels_BT for mb in micro_batches]) if self.parts.holds_last else None
        return args, target

    def _loss_sum(self, divide_by: int, losses: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Σ lm_loss (or `losses`) / divide_by over this step's micro-batches in order (fp64; 0 off the last
        stage)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in self._losses if losses is None else losses:
            total = total + loss.double() / divide_by
        return total

    def forward_backward(
        self, next_micro_batch: Callable[[], MicroBatch], num_micro: int, loss_scale: float
    ) -> torch.Tensor:
        if num_micro != self.num_micro:
            raise ValueError(f"the schedule was built for {self.num_micro} micro-batches, not {num_micro}")
        args, target = self._feed([next_micro_batch() for _ in range(num_micro)], "train")
        self._factor = loss_scale / num_micro
        self.moe_record.reset()
        if self._mtp_stage is not None:
            self._mtp_stage.mtp_head_loss = self.head_loss.with_grad_scale(self._factor)
        try:
            with aux_loss_grad_scale(self.model.moe_layers(), self._factor), self.parallel.loss_scope():
                with self._send_recv_site:
                    self.schedule.step(*args, target=target, return_outputs=False)
        finally:
            self._factor = 1.0
        mtp = self._loss_sum(num_micro, self._mtp_losses) if self.model.cfg.mtp_num_layers else None
        lm_loss, self._moe_stats, self.last_mtp_loss = self._over_stages(
            self._loss_sum(num_micro), self.moe_record.step_stats(self.model.moe_layers()), mtp
        )
        return lm_loss

    def moe_step_stats(self) -> MoEStats | None:
        """[L_moe] of the last step, every MoE layer of the model: each one's mean over the step's forwards."""
        stats, self._moe_stats = self._moe_stats, None
        return stats

    def _over_stages(self, lm_loss: torch.Tensor, local_stats: MoEStats | None, mtp_loss: torch.Tensor | None = None):
        """(lm loss, every MoE layer's stats, the MTP loss given one) on every rank: one SUM all-reduce over the
        pipeline group, each value non-zero on exactly one stage (adding zeros is exact). Device ops only: no host
        sync."""
        mine = {}
        if local_stats is not None:
            layers = [self._moe_rows[moe.layer_index] for moe in self.model.moe_layers()]
            mine = dict(zip(layers, local_stats.rows(), strict=True))
        zeros = MoEStats.zeros(self.device, torch.float64)
        rows = [(mine[r].to(torch.float64) if r in mine else zeros).values for r in range(len(self._moe_rows))]
        extra = [] if mtp_loss is None else [mtp_loss.reshape(1)]
        flat = torch.cat([lm_loss.reshape(1), *extra, *rows])
        with self._reduce_site:
            dist.all_reduce(flat, group=self.parts.mesh.group("pp"))
        stats = MoEStats.from_flat(flat[1 + len(extra) :].float()) if rows else None
        return flat[0], stats, (flat[1] if extra else None)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, loader, micro_batches: int, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """`train.validation.evaluate` over the pipeline: the schedule forward-only, the loss on every rank."""
        from moetron.train.validation import perplexity

        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for _ in range(micro_batches // self.num_micro):
                batches = [MicroBatch.from_loader(loader, self.device) for _ in range(self.num_micro)]
                args, target = self._feed(batches, "valid")
                with self.parallel.loss_scope(), self._send_recv_site:
                    self.schedule.eval(*args, target=target, return_outputs=False)
                total = total + self._loss_sum(1)
        finally:
            self.model.train(was_training)
        mean, _, _ = self._over_stages(total / micro_batches, None)
        loss = float(all_reduce_mean(mean))
        return {"valid_loss": loss, "valid_ppl": perplexity(loss), "micro_batches": micro_batches}
