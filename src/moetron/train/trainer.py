"""The training loop: accumulation, mixed precision, clipping, skip-on-NaN, evaluation, checkpoints, metrics.

One optimizer step ("iteration") consumes a global batch = micro batch × accumulation steps × DP ranks:

    for each micro-batch:  loss = (lm_loss + moe_loss) / num_micro · loss_scale ; backward   (DDP syncs on the last)
    unscale gradients → clip by the global norm → finite? optimizer step + expert-bias update : skip and count
    advance the LR schedule by the consumed samples/tokens (Megatron: only after successful steps)

There is one host sync per step (is the gradient norm finite?); losses and routing statistics stay on device
and are reduced once per log interval. A step is "skipped" when its gradient norm is not finite. In fp16 that
is the loss scaler's job while the scale can still go down; every other skip counts towards
`--max-skipped-steps` consecutive skips, after which the run stops with its last checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moetron.config import RunConfig
from moetron.errors import UserError
from moetron.eval.perplexity import evaluate, evaluation_rng
from moetron.model.flops import flops_per_token, megatron_tflops, mfu, peak_tflops
from moetron.parallel.data_parallel import accumulation_context, all_reduce_mean, sync_router_loads
from moetron.parallel.env import DistEnv
from moetron.parallel.parallelize import parallelize
from moetron.train.checkpoint_state import load_checkpoint, save_checkpoint
from moetron.train.metrics import IntervalMetrics, RunLogger, StepSums
from moetron.train.optim import build_optimizer, clip_gradients
from moetron.train.precision import autocast_context, build_loss_scaler
from moetron.train.schedule import LRScheduler, build_schedule_spec
from moetron.train.signals import StopSignal


def inject_fault(iteration: int, rank: int) -> None:
    """Test-only hook: with MOETRON_FAULT_AT_ITER=N, rank 1 dies (os._exit(1), no cleanup) as iteration N starts,
    on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT=0), so `--max-restarts 1` can resume the run."""
    fault_at = os.environ.get("MOETRON_FAULT_AT_ITER")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if fault_at and int(fault_at) == iteration and rank == 1 and first_attempt:
        os._exit(1)


@dataclasses.dataclass
class Progress:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0


@dataclasses.dataclass
class StepResult:
    ok: bool
    grad_norm: float
    sums: StepSums


class Trainer:
    """Drives one run. `train_loader` yields `[mbs, seq+1]` micro-batches; `make_valid_loader()` a fresh one."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        model: torch.nn.Module,
        train_loader,
        make_valid_loader: Callable[[], object] | None = None,
        config_yaml: str = "",
    ):
        self.cfg, self.env, self.model = cfg, env, model
        self.dims = cfg.dims(env.world_size)
        self.gbs = cfg.global_batch(self.dims.dp)
        self.num_micro = cfg.num_micro_batches(self.dims.dp)
        self.seq = cfg.model.seq_length
        self.total_iters = cfg.total_iters(self.dims.dp)
        self.train_loader, self.make_valid_loader = train_loader, make_valid_loader
        self.config_yaml = config_yaml
        self.parallel = parallelize(model, env, self.dims)  # EP: keeps this rank's experts; DDP for the rest
        self.ddp = self.parallel.module
        self.optimizer = build_optimizer(model, cfg.train, env.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        spec = build_schedule_spec(cfg.train, self.gbs, self.seq, self.total_iters)
        self.scheduler = LRScheduler(self.optimizer, spec)
        self.scaler = build_loss_scaler(cfg.train)
        self.progress = Progress()
        self.metrics = IntervalMetrics(env.device)
        self.reduce_mean = all_reduce_mean(env)
        self.run_dir = cfg.run_dir()
        self.last_saved_iteration: int | None = None
        self.logger: RunLogger | None = None

    # ------------------------------------------------------------------ one optimizer step
    def autocast(self):
        return autocast_context(self.env.device, self.cfg.train.fp16, self.cfg.train.bf16)

    def train_step(self) -> StepResult:
        sums, scale = StepSums(self.env.device), self.scaler.scale
        for i in range(self.num_micro):
            batch = self.train_loader.next_micro_batch().to(self.env.device, non_blocking=True)
            with accumulation_context(self.ddp, last_micro_batch=i == self.num_micro - 1):
                with self.autocast():
                    out = self.ddp(batch[:, :-1], labels_BT=batch[:, 1:])
                ((out.lm_loss + out.moe_loss) * (scale / self.num_micro)).backward()
            sums.add(out.lm_loss, out.moe_loss, out.moe_aux, 1.0 / self.num_micro)
        self.parallel.finish_gradients()
        grads = [p.grad for p in self.params if p.grad is not None]
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)  # a power of two: exact
        norm = clip_gradients(self.params, self.cfg.train.clip_grad, self.parallel.grad_norm_sq)
        grad_norm = float(norm)  # the one host sync of a step
        ok = grad_norm == grad_norm and grad_norm != float("inf")
        if ok:
            self.optimizer.step()
            sync_router_loads(self.model, self.env)
            self.model.update_expert_biases()
        else:
            self._forget_router_loads()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(found_overflow=not ok)
        return StepResult(ok, grad_norm, sums)

    def _forget_router_loads(self) -> None:
        for moe in self.model.moe_layers():
            moe.router.load_since_update_E.zero_()

    def _account(self, result: StepResult) -> None:
        p, t = self.progress, self.cfg.train
        p.iteration += 1
        p.consumed_samples += self.gbs
        p.consumed_tokens += self.gbs * self.seq
        if result.ok:
            self.scheduler.step(self.gbs, p.consumed_tokens)
            self.metrics.add_step(result.sums, result.grad_norm)
            p.consecutive_skips = 0
            return
        p.skipped_steps += 1
        scaler_is_adjusting = t.fp16 and not self.scaler.at_minimum
        if not scaler_is_adjusting:
            p.consecutive_skips += 1

    # ------------------------------------------------------------------ the loop
    def done(self) -> bool:
        p, t = self.progress, self.cfg.train
        return (
            (t.train_iters is not None and p.iteration >= t.train_iters)
            or (t.train_samples is not None and p.consumed_samples >= t.train_samples)
            or (t.train_tokens is not None and p.consumed_tokens >= t.train_tokens)
        )

    def train(self) -> int:
        """Run to the stopping criterion (or a signal); returns the process exit code."""
        t = self.cfg.train
        self.logger = RunLogger(self.run_dir, t.tensorboard_dir, self.env.is_main, self.total_iters)
        self._write_run_config()
        self.model.train()
        try:
            with StopSignal() as stop:
                return self._loop(stop)
        finally:
            self.logger.close()

    def _loop(self, stop: StopSignal) -> int:
        t = self.cfg.train
        interval_start, interval_iters = time.perf_counter(), 0
        while not self.done():
            inject_fault(self.progress.iteration + 1, self.env.rank)
            result = self.train_step()
            self._account(result)
            interval_iters += 1
            it = self.progress.iteration
            self.logger.progress(it)
            if it % t.log_interval == 0 or self.done():
                self._log(time.perf_counter() - interval_start, interval_iters)
                interval_start, interval_iters = time.perf_counter(), 0
            if self.progress.consecutive_skips >= max(t.max_skipped_steps, 1):
                self._stop_on_skips()
            paused = time.perf_counter()  # evaluation and saving stay out of the throughput numbers
            if t.eval_interval and it % t.eval_interval == 0 and not self.done():
                self.run_evaluation()
            if t.save and t.save_interval and it % t.save_interval == 0 and not self.progress.consecutive_skips:
                self.save()  # never in the middle of a NaN streak: the last checkpoint stays a good one
            interval_start += time.perf_counter() - paused
            if self._stop_requested(stop):
                self.logger.print(f" received {stop.requested}: saving at iteration {it} and exiting")
                if t.save:
                    self.save()
                return 0
        self.run_evaluation()
        if t.save and self.last_saved_iteration != self.progress.iteration:
            self.save()
        return 0

    def _stop_requested(self, stop: StopSignal) -> bool:
        if not self.env.distributed:
            return stop.requested is not None
        flag = torch.tensor([1.0 if stop.requested else 0.0], device=self.env.device)
        self.env.all_reduce_(flag, op=torch.distributed.ReduceOp.MAX)  # every rank stops after the same step
        if flag.item() and not stop.requested:
            stop.requested = "a signal on another rank"
        return bool(flag.item())

    def _stop_on_skips(self) -> None:
        p, t = self.progress, self.cfg.train
        last = self.last_saved_iteration
        where = f"the last checkpoint (iteration {last}) in {t.save} is intact" if last else "no checkpoint was saved"
        raise UserError(
            f"stopping at iteration {p.iteration}: {p.consecutive_skips} consecutive steps had NaN/Inf loss or "
            f"gradients (--max-skipped-steps {t.max_skipped_steps}); {where}. Lower --lr, raise --clip-grad "
            f"strictness, or use --bf16 instead of --fp16"
        )

    # ------------------------------------------------------------------ metrics and evaluation
    def _log(self, elapsed: float, iters: int) -> None:
        p, cfg = self.progress, self.cfg
        reduced = self.metrics.reduce(self.reduce_mean)
        iter_time = elapsed / max(iters, 1)
        tokens_per_sec = self.gbs * self.seq / iter_time
        tflops = megatron_tflops(
            cfg.model, self.gbs, self.seq, iter_time, self.env.world_size, cfg.model.checkpoint_activations
        )
        achieved = flops_per_token(cfg.model, self.seq) * tokens_per_sec / self.env.world_size / 1e12
        peak = peak_tflops(override=cfg.train.peak_tflops)
        record = {
            "iteration": p.iteration,
            "consumed_samples": p.consumed_samples,  # TensorBoard's "vs samples" axis (not in metrics.jsonl)
            "consumed_tokens": p.consumed_tokens,
            "lr": self.scheduler.get_lr(),
            "loss_scale": self.scaler.scale,
            "tokens_per_sec": tokens_per_sec,
            "tflops": tflops,
            "mfu": mfu(achieved, peak),
            "skipped_steps": p.skipped_steps,
            **reduced,
        }
        self.logger.log_train(record, eta_s=(self.total_iters - p.iteration) * iter_time)

    def run_evaluation(self) -> dict | None:
        t = self.cfg.train
        if self.make_valid_loader is None or t.eval_iters == 0:
            return None
        with evaluation_rng(t.seed, self.env.rank, self.env.device):  # repeatable, and training's RNG is kept
            result = evaluate(
                self.model, self.make_valid_loader(), t.eval_iters * self.num_micro, self.autocast, self.reduce_mean
            )
        p = self.progress
        record = {
            "iteration": p.iteration,
            "consumed_samples": p.consumed_samples,  # TensorBoard's "vs samples" axis (not in eval.jsonl)
            "consumed_tokens": p.consumed_tokens,
            **result,
        }
        self.logger.log_eval(record)
        return record

    # ------------------------------------------------------------------ checkpoints
    def logger_print(self, line: str) -> None:
        """Print on rank 0 (through the progress bar once training runs)."""
        if self.logger is not None:
            self.logger.print(line)
        elif self.env.is_main:
            print(line, flush=True)

    def _write_run_config(self) -> None:
        if self.env.is_main and self.run_dir:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.run_dir) / "config.yaml").write_text(self.config_yaml)

    def trainer_state(self) -> dict:
        return {
            **dataclasses.asdict(self.progress),
            "scheduler": self.scheduler.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "train_loader": self.train_loader.state_dict(),
            "world_size": self.env.world_size,
            "global_batch_size": self.gbs,
        }

    def save(self) -> Path:
        t = self.cfg.train
        path = save_checkpoint(
            t.save,
            self.progress.iteration,
            self.model,
            self.optimizer,
            self.trainer_state(),
            self.config_yaml,
            self.env,
            t.keep_last_n,
        )
        self.last_saved_iteration = self.progress.iteration
        if self.logger is not None:
            self.logger.print(f" saved checkpoint {path}")
        return path

    def load(self, path: Path) -> None:
        """Resume from `path`; with --finetune only the weights (iteration, data and schedule start at 0)."""
        t = self.cfg.train
        if t.finetune:
            load_checkpoint(path, self.model, None, load_rng=False, rank=self.env.rank)
            return
        optimizer = None if t.no_load_optim else self.optimizer
        state = load_checkpoint(path, self.model, optimizer, load_rng=not t.no_load_rng, rank=self.env.rank)
        self.progress = Progress(**{f.name: int(state[f.name]) for f in dataclasses.fields(Progress)})
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["loss_scaler"])
        self.train_loader.load_state_dict(state["train_loader"])
        self.last_saved_iteration = self.progress.iteration
