"""Training metrics: accumulated on device every step, reduced and written once per log interval.

`IntervalMetrics` keeps running sums as tensors (no host sync per micro-batch or per step); `reduce()` does
the single all-reduce and host transfer of an interval. `RunLogger` writes what the reduction gives:

- `metrics.jsonl`: one object per log interval (keys in `METRIC_KEYS`; the MoE entries are lists, one per
  MoE layer);
- `eval.jsonl`: one object per evaluation (`EVAL_KEYS`);
- a Megatron-like console line on rank 0, a tqdm bar only when stdout is a terminal;
- TensorBoard scalars under Megatron's tag names when `--tensorboard-dir` is given and tensorboard is installed.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

from moetron.fileio import write_atomic, write_errors_named
from moetron.model.moe.stats import MoEStats
from moetron.train.peak_memory import memory_text

METRIC_KEYS = (
    "iteration",
    "consumed_tokens",
    "lr",
    "lm_loss",
    "moe_loss",
    "grad_norm",
    "loss_scale",
    "tokens_per_sec",
    "tflops",
    "mfu",
    "peak_memory_gib",  # this rank's device: CUDA max allocated, CPU peak RSS (train/peak_memory.py)
    "reserved_memory_gib",  # CUDA max reserved; None on CPU
    "planned_memory_gib",  # what `moetron plan` predicts for this layout (None: no estimate)
    "baseline_memory_gib",  # CPU: the peak RSS before the model was built, not in the plan; None on CUDA
    "skipped_steps",
    "expert_load_max_over_mean",
    "dropped_fraction",
    "moe_ep_load_routed",
    "moe_ep_load_computed",
    "moe_dead_experts",
    "moe_routing_entropy",
    "routing_alarms",
)
OPTIONAL_METRIC_KEYS = ("mtp_loss",)  # only in runs that have them (--mtp-num-layers)
EVAL_KEYS = ("iteration", "consumed_tokens", "valid_loss", "valid_ppl")


def mfu_text(value: float | None) -> str:
    """An unknown peak (a GPU missing from the table, no --peak-tflops) gives no number rather than a wrong one."""
    return "MFU n/a (--peak-tflops)" if value is None else f"MFU {100 * value:.2f}%"


class StepSums:
    """One optimizer step's mean losses and routing stats over its micro-batches, on device (no host sync)."""

    def __init__(self, lm_loss: torch.Tensor, moe_stats: MoEStats | None, moe_loss_coeff: float, z_coeff: float):
        moe_loss = torch.zeros((), dtype=torch.float64, device=lm_loss.device)
        if moe_stats is not None:
            moe_loss = moe_stats.moe_loss(moe_loss_coeff, z_coeff)
        self.losses = torch.stack([lm_loss.double(), moe_loss])  # lm loss, moe loss (means over micro-batches)
        self.moe_stats = moe_stats  # [L_moe]
        self.mtp_loss: torch.Tensor | None = None  # the MTP modules' mean loss (--mtp-num-layers), fp64 on device

    def add_mtp_loss(self, mtp_loss: torch.Tensor | None) -> None:
        self.mtp_loss = None if mtp_loss is None else mtp_loss.double()


class IntervalMetrics:
    """Running sums over one log interval; only `reduce()` talks to the host and the other ranks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # lm loss, moe loss
        self.moe_stats: MoEStats | None = None  # [L_moe] means per step, summed
        self.steps = 0  # successful steps (a skipped step's NaN would poison the mean)
        self.grad_norm_sum = 0.0
        self.mtp_sum: torch.Tensor | None = None  # Σ of the steps' MTP losses (only with --mtp-num-layers)

    def add_step(self, step: StepSums, grad_norm: float) -> None:
        self.steps += 1
        self.sums += step.losses
        self.grad_norm_sum += grad_norm
        if step.moe_stats is not None:
            self.moe_stats = step.moe_stats if self.moe_stats is None else self.moe_stats + step.moe_stats
        if step.mtp_loss is not None:
            self.mtp_sum = step.mtp_loss if self.mtp_sum is None else self.mtp_sum + step.mtp_loss

    def reduce(self, all_reduce_mean, extra: torch.Tensor | None = None) -> dict:
        """Interval means over steps and data-parallel ranks (one collective, one host transfer). `extra` (fp64,
        e.g. the routing-health flags) rides along: its mean over the ranks, not divided by the steps, is
        returned as `out["extra"]` (None without it)."""
        n_layers = 0 if self.moe_stats is None else self.moe_stats.values.shape[0]
        packed = [self.sums]
        if n_layers:
            packed.append(self.moe_stats.values.double().flatten())
        mtp = self.mtp_sum is not None
        if mtp:  # last, so that the MoE statistics keep their place
            packed.append(self.mtp_sum.reshape(1))
        n_extra = 0 if extra is None else extra.numel()
        if n_extra:
            packed.append(extra.to(self.device, torch.float64))
        flat = all_reduce_mean(torch.cat(packed)).cpu()
        reduced_extra = flat[flat.numel() - n_extra :] if n_extra else None
        flat = flat[: flat.numel() - n_extra]
        steps = self.steps or float("nan")
        flat = flat / steps
        mtp_loss = float(flat[-1]) if mtp else None
        flat = flat[:-1] if mtp else flat
        out = {
            "lm_loss": float(flat[0]),
            "moe_loss": float(flat[1]),
            "grad_norm": self.grad_norm_sum / steps,
            "expert_load_max_over_mean": [],
            "dropped_fraction": [],
            "moe_aux_loss": [],  # before moe_loss_coeff: read by the aux-loss-hacking alarm, not written
            "extra": reduced_extra,
        }
        if n_layers:
            stats = MoEStats.from_flat(flat[2:])
            out["expert_load_max_over_mean"] = [round(float(v), 4) for v in stats.load_max_over_mean]
            out["dropped_fraction"] = [round(float(v), 4) for v in stats.dropped_fraction]
            out["moe_aux_loss"] = [float(v) for v in stats.aux_loss]
        out.update(ep_load_fields(stats if n_layers else None))
        if mtp_loss is not None:
            out["mtp_loss"] = mtp_loss
        self.reset()
        return out


def ep_load_fields(stats: MoEStats | None) -> dict:
    """`moe_ep_load_routed` / `moe_ep_load_computed`: rows per expert-parallel rank max/mean (by the experts'
    owners / after `--moe-expert-replicas`), interval means, max over MoE layers; None for a dense model."""
    if stats is None:
        return {"moe_ep_load_routed": None, "moe_ep_load_computed": None}
    return {
        "moe_ep_load_routed": round(float(stats.ep_load_routed.max()), 4),
        "moe_ep_load_computed": round(float(stats.ep_load_computed.max()), 4),
    }


def _iteration_of(line: str) -> float:
    """The iteration of one JSONL record; a torn last line (a crash mid-write) counts as after everything."""
    try:
        return json.loads(line)["iteration"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def per_layer(values: list[float], layers: list[int] | None, digits: int) -> str:
    """`1:1.86,3:2.82`: each MoE layer's value after its 0-based layer index, the numbering of the routing report,
    TensorBoard's tags and the alarms (bare values when the indices are not known)."""
    if layers is None or len(layers) != len(values):
        return ",".join(f"{v:.{digits}f}" for v in values)
    return ",".join(f"{layer}:{v:.{digits}f}" for layer, v in zip(layers, values, strict=True))


def console_line(m: dict, total_iters: int, eta_s: float, moe_layers: list[int] | None = None) -> str:
    parts = [
        f" iteration {m['iteration']:>7d}/{total_iters}",
        f"consumed tokens {m['consumed_tokens']}",
        f"lm loss {m['lm_loss']:.4E}",
        f"moe loss {m['moe_loss']:.4E}",
        *([f"mtp loss {m['mtp_loss']:.4E}"] if "mtp_loss" in m else []),
        f"lr {m['lr']:.4E}",
        f"grad norm {m['grad_norm']:.3f}",
    ]
    if m.get("loss_scale", 1.0) != 1.0:
        parts.append(f"loss scale {m['loss_scale']:.1f}")
    parts += [f"tokens/s {m['tokens_per_sec']:.0f}", f"TFLOPs {m['tflops']:.2f}", mfu_text(m["mfu"])]
    if "peak_memory_gib" in m:
        parts.append(memory_text(m))
    if m["expert_load_max_over_mean"]:
        parts.append("load max/mean " + per_layer(m["expert_load_max_over_mean"], moe_layers, 2))
        parts.append("dropped " + per_layer(m["dropped_fraction"], moe_layers, 3))
    parts += [f"skipped {m['skipped_steps']}", f"ETA {format_eta(eta_s)}"]
    return " | ".join(parts)


class RunLogger:
    """Files, console and TensorBoard; every method is a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | None, tensorboard_dir: str | None, is_main: bool, total_iters: int):
        self.is_main = is_main
        self.total_iters = total_iters
        self.run_dir = Path(run_dir) if run_dir and is_main else None
        if self.run_dir:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tb = open_tensorboard(tensorboard_dir) if is_main and tensorboard_dir else None
        self.moe_layers: list[int] | None = None  # the MoE layers' indices, for TensorBoard's tags (set by the trainer)
        self.bar = None
        if is_main and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_iters, unit="it", dynamic_ncols=True, leave=False)

    def forget_after(self, iteration: int) -> None:
        """Drop the records of iterations after `iteration` from metrics.jsonl and eval.jsonl: a run resumed from
        that iteration's checkpoint (after a crash past it) logs them again, and each iteration appears once."""
        if not self.run_dir:
            return
        for name in ("metrics.jsonl", "eval.jsonl"):
            path = self.run_dir / name
            if not path.is_file():
                continue
            lines = path.read_text().splitlines()
            kept = [line for line in lines if _iteration_of(line) <= iteration]
            if len(kept) != len(lines):
                write_atomic(path, "".join(line + "\n" for line in kept))

    def _append(self, name: str, record: dict) -> None:
        if self.run_dir:
            with write_errors_named(f"the run's log {name}"), open(self.run_dir / name, "a") as f:
                f.write(json.dumps(record) + "\n")

    def progress(self, iteration: int) -> None:
        if self.bar is not None:
            self.bar.n = iteration
            self.bar.refresh()

    def log_train(self, record: dict, eta_s: float) -> None:
        if not self.is_main:
            return
        optional = {k: record[k] for k in OPTIONAL_METRIC_KEYS if k in record}
        self._append("metrics.jsonl", {**{k: record[k] for k in METRIC_KEYS}, **optional})
        self.print(console_line(record, self.total_iters, eta_s, self.moe_layers))
        if self.tb is not None:
            write_tensorboard_train(self.tb, record, self.moe_layers)

    def log_eval(self, record: dict) -> None:
        if not self.is_main:
            return
        self._append("eval.jsonl", {k: record[k] for k in EVAL_KEYS})
        self.print(
            f" validation at iteration {record['iteration']} | lm loss {record['valid_loss']:.4E} "
            f"| lm loss PPL {record['valid_ppl']:.4E}"
        )
        if self.tb is not None:
            for key, tag in (("valid_loss", "lm loss validation"), ("valid_ppl", "lm loss validation ppl")):
                add_scalar_vs(self.tb, f"lm-loss-validation/{tag}", record[key], record)

    def print(self, line: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def open_tensorboard(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(f"note: --tensorboard-dir {directory} ignored: tensorboard is not installed (pip install tensorboard)")
        return None
    return SummaryWriter(log_dir=directory, max_queue=1000)


def add_scalar_vs(tb, tag: str, value: float, record: dict) -> None:
    """Megatron's three x-axes for one value: iterations, `<tag> vs samples`, `<tag> vs tokens`."""
    tb.add_scalar(tag, value, record["iteration"])
    tb.add_scalar(f"{tag} vs samples", value, record["consumed_samples"])
    tb.add_scalar(f"{tag} vs tokens", value, record["consumed_tokens"])


def write_tensorboard_train(tb, m: dict, moe_layers: list[int] | None = None) -> None:
    """Megatron's tag names (reference §4.10): value vs iteration, and the `vs samples` / `vs tokens` variants.

    Per-MoE-layer tags name the transformer layer's index (`moe_layers`, 0-based), as the routing report, its plots
    and the routing alarms do — not the MoE layer's rank among MoE layers (layer 3 of `--expert-interval 2` is
    `layer 3`, not `layer 1`)."""
    it, tokens = m["iteration"], m["consumed_tokens"]
    scalars = {
        "learning-rate/learning-rate": m["lr"],
        "lm-loss-training/lm loss": m["lm_loss"],
        "lm-loss-training/moe loss": m["moe_loss"],
        "grad-norm/grad-norm": m["grad_norm"],
        "loss-scale/loss-scale": m["loss_scale"],
    }
    if "mtp_loss" in m:
        scalars["lm-loss-training/mtp loss"] = m["mtp_loss"]
    tb.add_scalar("steps-vs-samples/steps-vs-samples", it, m["consumed_samples"])
    tb.add_scalar("steps-vs-tokens/steps-vs-tokens", it, tokens)
    for tag, value in scalars.items():
        add_scalar_vs(tb, tag, value, m)
    tb.add_scalar("iteration-time/tokens-per-sec", m["tokens_per_sec"], it)
    if m.get("moe_ep_load_routed") is not None:
        tb.add_scalar("moe/ep-load-routed", m["moe_ep_load_routed"], it)
        tb.add_scalar("moe/ep-load-computed", m["moe_ep_load_computed"], it)
    loads = m["expert_load_max_over_mean"]
    names = moe_layers if moe_layers is not None and len(moe_layers) == len(loads) else range(len(loads))
    for layer, load, dropped in zip(names, loads, m["dropped_fraction"], strict=True):
        tb.add_scalar(f"moe/load-max-over-mean layer {layer}", load, it)
        tb.add_scalar(f"moe/dropped-fraction layer {layer}", dropped, it)
