"""The training loop: accumulation, mixed precision, clipping, skip-on-NaN, evaluation, checkpoints, metrics.

One optimizer step ("iteration") consumes a global batch = micro batch × accumulation steps × DP ranks:

    executor: for each micro-batch  lm_loss · loss_scale / num_micro → backward   (MoE aux losses attached in
              the layers; gradients reduced over data parallelism in the last micro-batch)
    unscale gradients → clip by the global norm → finite? optimizer step + expert-bias update : skip and count
    advance the LR schedule by the consumed samples/tokens (Megatron: only after successful steps)

There is one host read per step: the gradient norm, read together with the all-ranks stop flag (a signal on any
rank, agreed on by an asynchronous MAX all-reduce started with the step). Losses and routing statistics stay on
device and are reduced once per log interval. A step is "skipped" when its gradient norm is not finite. In fp16
that is the loss scaler's job while the scale can still go down; every other skip counts towards
`--max-skipped-steps` consecutive skips, after which the run stops with its last checkpoint intact.

Coordinates (data-parallel rank, groups) come from the `ParallelMesh`, never from the global rank; the global
rank is used only to print on rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moetron.checkpoint import GlobalView, load_checkpoint, save_checkpoint
from moetron.checkpoint.async_save import AsyncCheckpointer
from moetron.config import RunConfig
from moetron.errors import UserError
from moetron.fileio import describe_os_error, write_atomic
from moetron.model.flops import flops_per_token, megatron_tflops, mfu, peak_tflops
from moetron.model.rng import STREAMS
from moetron.parallel.env import DistEnv
from moetron.parallel.ep.static_buffers import StepGuard
from moetron.parallel.expert_bias import update_expert_biases
from moetron.parallel.parallelize import ParallelModel
from moetron.train.executor import MicroBatch, build_executor
from moetron.train.failures import collective_failures, rank_failures
from moetron.train.metrics import IntervalMetrics, RunLogger, StepSums
from moetron.train.optim import build_optimizer, clip_gradients, local_grads
from moetron.train.peak_memory import GIB, MemorySnapshots, peak_memory
from moetron.train.precision import autocast_context, build_loss_scaler
from moetron.train.reduce import mean_over
from moetron.train.routing_health import ROUTING_COUNTS_FILE, RoutingHealth, routing_counts_record
from moetron.train.schedule import LRScheduler, build_schedule_spec, finished_schedule_warning
from moetron.train.signals import StopFlag, StopSignal


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
    cpu_s: float = 0.0  # the step's CPU time, all threads (`time.process_time`): the metrics log wall-clock rates only


class Trainer:
    """Drives one run. `train_loader` yields `[mbs, seq+1]` micro-batches; `make_valid_loader()` a fresh one.

    `parallel` is this rank's model in its parallel form, from `parallel.parallelize.build(cfg, mesh, device)`: the
    trainer reads its mesh, pipeline layout and LM head + loss from it."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        parallel: ParallelModel,
        train_loader,
        make_valid_loader: Callable[[], object] | None = None,
        config_yaml: str = "",
        on_step: Callable[[StepResult], None] | None = None,
    ):
        """`on_step`: called with every optimizer step's result in `train()` (`plan --measure`'s worker notes each
        step's CPU time)."""
        self.cfg, self.env = cfg, env
        self.on_step = on_step
        self.dims = cfg.dims(env.world_size)
        self.mesh = parallel.mesh
        self.gbs = cfg.global_batch(self.dims.dp)
        self.num_micro = cfg.num_micro_batches(self.dims.dp)
        self.seq = cfg.model.seq_length
        self.total_iters = cfg.total_iters(self.dims.dp)
        self.train_loader, self.make_valid_loader = train_loader, make_valid_loader
        self.config_yaml = config_yaml
        STREAMS.configure(cfg.train.seed)
        self.parallel = parallel
        self.model = self.parallel.model
        self.executor = build_executor(self.parallel, self.autocast, cfg)  # the pipeline's when split into stages
        self.ep_guard = StepGuard.from_model(self.model)  # --moe-ep-dispatch static: its one check per step
        stepped = self.parallel.optimizer_parameters()  # the weights, or at ZeRO-1 this rank's shards of them
        self.optimizer = build_optimizer(self.model, self.parallel.registry, cfg.train, env.device, stepped, self.mesh)
        self.parallel.attach_optimizer(self.optimizer)
        self.params = [p for _, p in stepped]
        spec = build_schedule_spec(cfg.train, self.gbs, self.seq, self.total_iters)
        self.scheduler = LRScheduler(self.optimizer, spec)
        self.scaler = build_loss_scaler(cfg.train)
        self.progress = Progress()
        self.metrics = IntervalMetrics(env.device)
        self.health = RoutingHealth.from_config(cfg.train, self.model, env.device)  # routing alarms (on device)
        self.reduce_mean = mean_over(self.mesh, "dp_cp")  # context-parallel peers' losses are of other tokens
        self.run_dir = cfg.run_dir()
        self.last_saved_iteration: int | None = None
        self.async_saver = AsyncCheckpointer(env) if cfg.train.async_save and cfg.train.save else None
        self.logger: RunLogger | None = None
        self.routing_counts_failed = False  # said once (`_save_routing_counts`)
        self.stop: StopSignal | None = None  # set while train() runs
        self.stop_agreed = False  # every rank's verdict after the last step: some rank got a signal
        self.planned_memory_bytes: float | None = None  # `moetron plan`'s peak for this layout (set by run.py)
        self.baseline_memory_bytes: float | None = None  # CPU: peak RSS before the model was built (set by run.py)
        self.snapshots: MemorySnapshots | None = None  # --memory-snapshot-steps (set while train() runs)
        self.step_threads = self._step_threads()  # CPU: the steps' ops outside moetron's kernels on one thread?
        self.on_step_threads = self._step_threads_scope()

    # ------------------------------------------------------------------ one optimizer step
    def autocast(self):
        return autocast_context(self.env.device, self.cfg.train.fp16, self.cfg.train.bf16)

    def next_micro_batch(self) -> MicroBatch:
        return MicroBatch.from_loader(self.train_loader, self.env.device)

    def _step_threads(self) -> int:
        """Intra-op threads for a CPU step's ops outside moetron's kernels (moetron/cpu/threads.py); every thread on
        a GPU, or with --compile (a compiled block bakes its thread count in when it is built). With fewer, the
        layers whose GEMMs split well still run on every thread."""
        threads = torch.get_num_threads()
        if self.env.device.type != "cpu" or self.cfg.train.compile:
            return threads
        from moetron.cpu.step_threads import fence_step_threads  # here: only a CPU run loads the CPU package

        rows = self.cfg.train.micro_batch_size * self.seq // self.dims.cp
        return fence_step_threads(self.model, rows, self.cfg.model.hidden_size)

    def _step_threads_scope(self) -> Callable[[], contextlib.AbstractContextManager]:
        """What a step and an evaluation run inside: `step_threads` intra-op threads (a GPU's: nothing to change)."""
        if self.env.device.type != "cpu":
            return contextlib.nullcontext
        from moetron.cpu.threads import body_threads

        return functools.partial(body_threads, self.step_threads)

    def train_step(self) -> StepResult:
        cpu_start = time.process_time()
        with self.on_step_threads():
            result = self._train_step()
        result.cpu_s = time.process_time() - cpu_start
        return result

    def _train_step(self) -> StepResult:
        scale = self.scaler.scale
        stop_flag = StopFlag.start(self.stop, self.mesh, self.env.device)
        lm_loss = self._forward_backward(scale)
        m = self.cfg.model
        sums = StepSums(lm_loss, self.executor.moe_step_stats(), m.moe_loss_coeff, m.moe_z_loss_coeff)
        sums.add_mtp_loss(self.executor.last_mtp_loss)
        self.health.observe_step(self.executor.moe_record)
        grads = local_grads(self.params)
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)  # a power of two: exact
        norm = clip_gradients(self.params, self.cfg.train.clip_grad, self.parallel.grad_norm_sq)
        grad_norm, self.stop_agreed = stop_flag.read_with(norm)  # the one host read of a step
        if self.stop_agreed and self.stop is not None and not self.stop.requested:
            self.stop.requested = "received a stop request on another rank"
        ok = grad_norm == grad_norm and grad_norm != float("inf")
        if self.async_saver is not None:  # the first writes to saved tensors since a save: its copy must be done
            self.async_saver.before_update()
        if ok:
            self.optimizer.step()
        update_expert_biases(self.model, step_applied=ok, mesh=self.mesh)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(found_overflow=not ok)
        return StepResult(ok, grad_norm, sums)

    def _forward_backward(self, scale: float) -> torch.Tensor:
        """The step's micro-batches forward and backward, gradients reduced; with --moe-ep-dispatch static, checked
        once for an overflowed expert-parallel buffer and then re-run exactly (`parallel/ep/static_buffers.py`)."""

        def run_once(next_micro_batch) -> torch.Tensor:
            lm_loss = self.executor.forward_backward(next_micro_batch, self.num_micro, scale)
            self.parallel.finish_gradients()
            return lm_loss

        if self.ep_guard is None:
            return run_once(self.next_micro_batch)
        return self.ep_guard.run_exact(self.model, self.next_micro_batch, run_once, self._discard_attempt)

    def _discard_attempt(self) -> None:
        """Forget an overflowed attempt of the step: its gradients and the routing statistics it reported."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.executor.moe_record.reset()

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
        self.logger.moe_layers = self.cfg.model.routed_layer_indices()
        self.logger.forget_after(self.progress.iteration)  # a resumed run redoes what came after its checkpoint
        self._write_run_config()
        self.model.train()
        self.snapshots = MemorySnapshots(t.memory_snapshot_steps, self.env.device, self.run_dir, self.env.rank)
        if self.snapshots.note:
            self.logger.print(self.snapshots.note)
        try:
            with StopSignal() as stop, rank_failures(self.mesh, self.env.rank):
                return self._loop_then_wait_for_saves(stop)
        finally:
            self.logger.close()

    def _loop_then_wait_for_saves(self, stop: StopSignal) -> int:
        """The loop; then (--async-save) the write in flight ends before the run does, a SIGTERM's final save too."""
        if self.async_saver is None:
            return self._loop(stop)
        try:
            code = self._loop(stop)
        except BaseException:
            self.async_saver.close()  # the checkpoint being written still completes; the loop's error is the one said
            raise
        self.async_saver.wait()
        return code

    def _loop(self, stop: StopSignal) -> int:
        t = self.cfg.train
        self.stop = stop
        started = interval_start = time.perf_counter()
        interval_iters = 0
        while not self.done():
            result = self.train_step()
            if self.on_step is not None:
                self.on_step(result)
            self._account(result)
            interval_iters += 1
            it = self.progress.iteration
            self.logger.progress(it)
            if it % t.log_interval == 0 or self.done():
                self._log(time.perf_counter() - interval_start, interval_iters)
                interval_start, interval_iters = time.perf_counter(), 0
            if self.progress.consecutive_skips >= max(t.max_skipped_steps, 1):
                self._stop_on_skips()
            paused = time.perf_counter()  # evaluation, saving and snapshots stay out of the throughput numbers
            snapshot = self.snapshots.after_step(it)
            if snapshot is not None:
                self.logger.print(f" wrote the allocator snapshot {snapshot}")
            if t.eval_interval and it % t.eval_interval == 0 and not self.done():
                self.run_evaluation()
            if t.save and t.save_interval and it % t.save_interval == 0 and not self.progress.consecutive_skips:
                self.periodic_save()  # never in the middle of a NaN streak: the last checkpoint stays a good one
            interval_start += time.perf_counter() - paused
            reason = self._stop_reason(stop)
            if reason:  # without --save there is nothing to save to: stop, as Megatron does, and say so
                action = "saving at iteration" if t.save else "stopping without a checkpoint (no --save) at iteration"
                self.logger.print(f" {reason}: {action} {it} and exiting")
                if t.save and self.last_saved_iteration != it:
                    self.save()
                return 0
            if t.exit_duration_in_mins and time.perf_counter() - started > 60 * t.exit_duration_in_mins:
                stop.request(f"reached --exit-duration-in-mins {t.exit_duration_in_mins}")  # agreed on next step
        self.run_evaluation()
        if t.save and self.last_saved_iteration != self.progress.iteration:
            self.save()
        return 0

    def _stop_reason(self, stop: StopSignal) -> str | None:
        """Why to stop after this step, the same on every rank (None: go on). `--exit-interval` is decided by the
        iteration alone. A signal or the wall-clock limit: one process reads its own flag; several decide on the
        flag all-reduced during the step (`StopFlag`), so every rank stops after the same step (at most one step
        after the request reached any of them)."""
        interval, it = self.cfg.train.exit_interval, self.progress.iteration
        if interval and it % interval == 0:
            return f"reached --exit-interval {interval}"
        if (stop.requested is not None) if not self.env.distributed else self.stop_agreed:
            return stop.requested
        return None

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
        reduced = self.metrics.reduce(self.reduce_mean, self.health.pack())
        health_fields, alarms = self.health.check(reduced.pop("extra"), reduced, p.iteration)
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
            **peak_memory(self.env.device),  # allocator counters on the host: no device sync
            "planned_memory_gib": None if self.planned_memory_bytes is None else self.planned_memory_bytes / GIB,
            "baseline_memory_gib": None if self.baseline_memory_bytes is None else self.baseline_memory_bytes / GIB,
            "skipped_steps": p.skipped_steps,
            **reduced,
            **health_fields,
        }
        self.logger.log_train(record, eta_s=(self.total_iters - p.iteration) * iter_time)
        for line in alarms:
            self.logger.print(line)
        self._save_routing_counts(p.iteration)

    def _save_routing_counts(self, iteration: int) -> None:
        """The last interval's routes per expert in the run directory (a few numbers per MoE layer, overwritten each
        interval), for `moetron plan --routing-from RUN_DIR`. A convenience, not the run's record: a write that fails
        (a full disk) is said once and training goes on; the metrics log and the checkpoints decide about stopping."""
        par = self.cfg.parallel
        record = routing_counts_record(self.health, iteration, par.moe_expert_parallel_size, par.moe_expert_replicas)
        if record is None or not self.env.is_main or not self.run_dir:
            return
        path = Path(self.run_dir) / ROUTING_COUNTS_FILE
        try:
            write_atomic(path, json.dumps(record) + "\n")
        except OSError as err:
            if not self.routing_counts_failed:
                self.logger_print(f" warning: cannot write {path} ({describe_os_error(err, path.parent)}); it keeps "
                                  "the last routes written, and training goes on")  # fmt: skip
            self.routing_counts_failed = True

    def run_evaluation(self) -> dict | None:
        t = self.cfg.train
        if self.make_valid_loader is None or t.eval_iters == 0:
            return None
        # repeatable: each micro-batch's routing draws are keyed by its samples, and training's RNG is untouched
        with self.on_step_threads():
            result = self.executor.evaluate(self.make_valid_loader(), t.eval_iters * self.num_micro, self.reduce_mean)
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
            write_atomic(Path(self.run_dir) / "config.yaml", self.config_yaml)

    def trainer_state(self) -> dict:
        return {
            **dataclasses.asdict(self.progress),
            "scheduler": self.scheduler.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "train_loader": self.train_loader.state_dict(),
            "world_size": self.env.world_size,
            "global_batch_size": self.gbs,
        }

    def checkpoint_view(self) -> GlobalView:
        return GlobalView(self.model, self.parallel.registry, self.mesh, self.parallel.optimizer_parameters())

    def periodic_save(self) -> None:
        """A save of --save-interval. One that fails (a full disk: one line, its temporaries removed, the previous
        checkpoint intact) stops the run, unless --continue-on-save-failure asked to train on; then the failure is
        said and the next save tries again. With --async-save the failure of a write surfaces at the next save."""
        try:
            self.save()
        except UserError as err:
            if not self.cfg.train.continue_on_save_failure or getattr(err, "quiet", False):
                raise
            self.logger_print(f" warning: {err}; training goes on (--continue-on-save-failure)")

    def save(self) -> Path:
        t = self.cfg.train
        save = save_checkpoint if self.async_saver is None else self.async_saver.save
        path = save(
            t.save,
            self.progress.iteration,
            self.checkpoint_view(),
            self.optimizer,
            self.trainer_state(),
            self.config_yaml,
            self.env,
            t.keep_last_n,
        )
        self.last_saved_iteration = self.progress.iteration
        if self.logger is not None:
            done = "saved checkpoint" if self.async_saver is None else "saving checkpoint (in the background)"
            self.logger.print(f" {done} {path}")
        return path

    def load(self, path: Path) -> None:
        """Resume from `path`; with --finetune only the weights (iteration, data and schedule start at 0)."""
        with collective_failures(self.mesh, self.env.rank):  # a stalled or dead peer during the load: one line
            self._load(path)

    def _load(self, path: Path) -> None:
        t = self.cfg.train
        if t.finetune:
            load_checkpoint(path, self.checkpoint_view(), None, load_rng=False, rank=self.env.rank, env=self.env)
            return
        optimizer = None if t.no_load_optim else self.optimizer
        view = self.checkpoint_view()
        state = load_checkpoint(path, view, optimizer, load_rng=not t.no_load_rng, rank=self.env.rank, env=self.env)
        self.progress = Progress(**{f.name: int(state[f.name]) for f in dataclasses.fields(Progress)})
        flags = self.scheduler.spec
        note = self.scheduler.load_state_dict(state["scheduler"], override=t.override_opt_param_scheduler)
        s = self.scheduler  # a finished schedule kept for more iterations: the warning says what to pass instead
        it = self.progress.iteration
        note = finished_schedule_warning(s.spec, flags, s.num_steps, s.num_tokens, it, self.total_iters) or note
        if note:
            self.logger_print(f" {note}")
        self.scaler.load_state_dict(state["loss_scaler"])
        self.train_loader.load_state_dict(state["train_loader"])
        self.last_saved_iteration = self.progress.iteration
