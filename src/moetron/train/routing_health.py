"""Routing-health alarms: one log line (and a metrics field) when a MoE router goes wrong in one of three ways.

    health = RoutingHealth.from_config(cfg.train, model, device)
    health.observe_step(executor.moe_record)         # every step, on device: which experts got tokens
    extra = health.pack()                            # rides on the log interval's one all-reduce + host read
    fields, lines = health.check(reduced_extra, reduced_metrics, iteration)

- dead expert: an expert received no token for `--moe-dead-expert-steps` consecutive steps on any data-parallel
  rank (each rank counts its steps since the expert's last token on device; the interval's all-reduce averages the
  flags "idle for N steps": 1.0 means idle everywhere). Checked at every log interval.
- routing collapse: the entropy of the MEAN routing distribution (the router's probabilities averaged over the
  interval's tokens) below `--moe-collapse-entropy` × log E. Per-token entropy cannot tell a confident router from a
  collapsed one (both are low); the mean distribution's can: exp(H) is the effective number of experts the router
  spreads its mass over. The default 0.5 fires when that number falls below √E (under 3 of 8 experts, 8 of 64): a
  healthy router sits near log E even with the aux loss off (random init gives ≈ 0.99), and a router that uses
  fewer than √E experts' worth of probability has stopped training most of its experts.
- aux-loss hacking (Megatron-LM #1545): over the last `--moe-aux-hacking-window` steps the aux loss (before its
  coefficient, mean over MoE layers) fell by more than 1% while the expert load max/mean (max over layers) did not
  improve and is at least 1.5: the router lowers the balancing loss (e.g. by flattening its probabilities) without
  balancing the load. ("Did not improve" rather than "grew": a load already at its worst, every token on one expert,
  cannot grow.) The 1.5 floor keeps a balanced router's noise from raising it.

The interval's routes per expert ride along too, and the trainer writes them to `routing_counts.json` in the run
directory (`routing_counts_record`), for `moetron plan --routing-from RUN_DIR` (plan/routing_from.py).

Each alarm prints once when it starts (and again only after it has cleared), and is listed in the `routing_alarms`
field of every metrics record while it holds. With all three thresholds 0 the alarms are off and nothing is tracked:
no work per step, nothing added to the interval's all-reduce, and the health fields are empty lists (as for a dense
model) rather than numbers nobody measured. The step counters restart at a resume (they are not checkpointed), so
a dead expert is reported again at most `--moe-dead-expert-steps` steps after it.

Shape legend: E experts of a layer.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from moetron.model.moe.stats import MoEStepRecord

AUX_FALL = 0.01  # relative fall of the aux loss over the window that counts as "falling"
ROUTING_COUNTS_FILE = "routing_counts.json"  # in the run directory: the last interval's routes per expert
IMBALANCED = 1.5  # expert load max/mean from which a non-improving load is worth an alarm (noise stays below)


def routing_health_problems(dead_steps: int, collapse_entropy: float, hacking_window: int) -> list[str]:
    p = []
    if dead_steps < 0:
        p.append(f"--moe-dead-expert-steps must be >= 0 (0 turns the dead-expert alarm off), got {dead_steps}")
    if not 0.0 <= collapse_entropy <= 1.0:
        p.append(
            f"--moe-collapse-entropy must be in [0, 1] (a fraction of log E; 0 turns it off), got {collapse_entropy}"
        )
    if hacking_window < 0:
        p.append(f"--moe-aux-hacking-window must be >= 0 (steps; 0 turns the alarm off), got {hacking_window}")
    return p


class RoutingHealth:
    """The alarms' state: per MoE layer, steps since each expert's last token and the interval's mean routing
    distribution (device tensors), and the host history of the aux loss and the load imbalance."""

    def __init__(self, layers: list[tuple[int, int]], dead_steps: int, collapse_entropy: float, window: int, device):
        self.layers = layers  # (layer index, experts) of each MoE layer this rank holds
        self.dead_steps, self.collapse_entropy, self.window = dead_steps, collapse_entropy, window
        self.idle_E = [torch.zeros(e, dtype=torch.int64, device=device) for _, e in layers]
        self.probs_E = [torch.zeros(e, dtype=torch.float64, device=device) for _, e in layers]
        self.routes_E = [torch.zeros(e, dtype=torch.float64, device=device) for _, e in layers]
        self.interval_routes: list[list[float]] = []  # the last interval's routes per expert, mean over ranks
        self.history: deque[tuple[int, float, float]] = deque()  # (iteration, aux loss, imbalance)
        self.active: set[str] = set()
        self.dead_reported: list[set[int]] = [set() for _ in layers]

    @classmethod
    def from_config(cls, t, model, device) -> RoutingHealth:
        layers = [(moe.layer_index, moe.num_experts) for moe in model.moe_layers()]
        return cls(layers, t.moe_dead_expert_steps, t.moe_collapse_entropy, t.moe_aux_hacking_window, device)

    @property
    def enabled(self) -> bool:
        """Whether any alarm is on (a threshold not 0) in a model with MoE layers."""
        return bool(self.layers) and bool(self.dead_steps or self.collapse_entropy or self.window)

    # ------------------------------------------------------------ every step (device only)
    def observe_step(self, record: MoEStepRecord) -> None:
        """The step's routing (`record.routing_2E`: per MoE layer, routes per expert and mean router probabilities)."""
        if not self.enabled:
            return  # every alarm off: no device work, no host read (the step's routing stays unread)
        for i, (layer_index, _) in enumerate(self.layers):
            routing_2E = record.routing_2E.get(layer_index)
            if routing_2E is None:
                continue
            self.idle_E[i] = torch.where(routing_2E[0] > 0, 0, self.idle_E[i] + 1)
            self.probs_E[i] += routing_2E[1].double()
            self.routes_E[i] += routing_2E[0].double()

    # ------------------------------------------------------------ every log interval
    def pack(self) -> torch.Tensor | None:
        """fp64 [Σ 3E]: per layer the flags "idle for the dead-expert steps", then the summed mean probabilities,
        then the summed routes per expert (saved for `moetron plan --routing-from`, plan/routing_from.py)."""
        if not self.enabled:
            return None
        parts = [(idle >= max(self.dead_steps, 1)).double() for idle in self.idle_E] + self.probs_E + self.routes_E
        return torch.cat(parts)

    def check(self, reduced: torch.Tensor | None, metrics: dict, iteration: int) -> tuple[dict, list[str]]:
        """(metrics fields, alarm lines to print) from the interval's reduced `pack()` (on the host)."""
        fields = {"moe_dead_experts": [], "moe_routing_entropy": [], "routing_alarms": []}
        if reduced is None:
            return fields, []
        sizes = [e for _, e in self.layers]
        parts, n = reduced.split(sizes * 3), len(sizes)
        flags, probs, routes = parts[:n], parts[n : 2 * n], parts[2 * n :]
        self.interval_routes = [[round(float(v), 3) for v in r] for r in routes]
        now, lines = set(), []
        for i, ((layer, experts), flag_E, probs_E) in enumerate(zip(self.layers, flags, probs, strict=True)):
            dead = [e for e, f in enumerate(flag_E.tolist()) if f >= 1.0] if self.dead_steps else []
            fields["moe_dead_experts"].append(len(dead))
            new = sorted(set(dead) - self.dead_reported[i])
            self.dead_reported[i] = set(dead)
            if dead:
                now.add("dead_expert")
            if new:
                lines.append(
                    f"MoE layer {layer}: expert(s) {' '.join(map(str, new))} received no token for "
                    f"{self.dead_steps} steps (--moe-dead-expert-steps {self.dead_steps})"
                )
            entropy = mean_distribution_entropy(probs_E) / math.log(experts)
            fields["moe_routing_entropy"].append(round(entropy, 4))
            if self.collapse_entropy and entropy < self.collapse_entropy:
                now.add("routing_collapse")
                if "routing_collapse" not in self.active:
                    lines.append(
                        f"MoE layer {layer}: routing collapsed: the mean routing distribution's entropy is "
                        f"{entropy:.3f} × log {experts} (< --moe-collapse-entropy {self.collapse_entropy}: fewer "
                        f"than {math.exp(self.collapse_entropy * math.log(experts)):.1f} experts' worth)"
                    )
            self.probs_E[i].zero_()
            self.routes_E[i].zero_()
        hacking = self._hacking(metrics, iteration)
        if hacking:
            now.add("aux_loss_hacking")
            if "aux_loss_hacking" not in self.active:
                lines.append(hacking)
        self.active = now
        fields["routing_alarms"] = sorted(now)
        return fields, [f"warning: routing health at iteration {iteration}: {line}" for line in lines]

    def _hacking(self, metrics: dict, iteration: int) -> str | None:
        aux_losses, loads = metrics.get("moe_aux_loss") or [], metrics.get("expert_load_max_over_mean") or []
        if not self.window or not aux_losses:
            return None
        aux, load = sum(aux_losses) / len(aux_losses), max(loads)
        self.history.append((iteration, aux, load))
        while len(self.history) > 1 and self.history[1][0] <= iteration - self.window:
            self.history.popleft()  # keep the newest record at least `window` steps old
        then_it, then_aux, then_load = self.history[0]
        falling = aux < then_aux * (1 - AUX_FALL)
        if iteration - then_it < self.window or not falling or load < then_load or load < IMBALANCED:
            return None
        return (
            f"the aux loss fell {then_aux:.4f} → {aux:.4f} over iterations {then_it}–{iteration} while the expert "
            f"load max/mean did not improve ({then_load:.3f} → {load:.3f}; --moe-aux-hacking-window {self.window}): "
            f"the router lowers the balancing loss without balancing"
        )


def routing_counts_record(health: RoutingHealth, iteration: int, ep: int, replicas: int) -> dict | None:
    """What `routing_counts.json` in the run directory holds after a log interval (None: nothing measured): the
    interval's routes per expert of each MoE layer (before dropping, mean over the data-parallel ranks), and the
    run's expert-parallel size and replica slots. `moetron plan --routing-from RUN_DIR` sizes the hottest EP rank
    with them (plan/routing_from.py)."""
    if not health.interval_routes:
        return None
    layers = [
        {"layer": layer, "num_experts": experts, "routes_per_expert": routes}
        for (layer, experts), routes in zip(health.layers, health.interval_routes, strict=True)
    ]
    return {"iteration": iteration, "expert_parallel_size": ep, "expert_replicas": replicas, "layers": layers}


def mean_distribution_entropy(probs_sum_E: torch.Tensor) -> float:
    """Entropy (nats) of the distribution `probs_sum_E` is proportional to; log E when it holds nothing."""
    total = float(probs_sum_E.sum())
    if total <= 0:
        return math.log(probs_sum_E.numel())
    p = probs_sum_E.double() / total
    return float(-(p * p.clamp_min(1e-30).log()).sum())
