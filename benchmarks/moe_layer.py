"""MoE layer forward+backward time and peak memory, as ratios to a floor measured side by side in one process.

    python benchmarks/moe_layer.py                 # all three shapes
    python benchmarks/moe_layer.py --shapes 0 --reps 5 --threads 0 --clock wall   # all cores, elapsed time
    python benchmarks/moe_layer.py --shapes 1 --phases   # where moetron's step goes, phase by phase, / floor

Implementations (all SwiGLU experts without biases, the same weights and router weight; fp32; CPU):
  floor                 the expert GEMMs alone on a perfectly balanced, pre-sorted batch of T·k rows (bmm on
                        [E, T·k/E, D] views): no router, no permutation, no imbalance.
  moetron dropless      MoELayer, Mixtral routing (softmax, top-k, renormalised), no capacity: the fair peer of
                        HF Mixtral (also dropless). Outputs are checked against HF's (max |diff| printed).
  hf eager / grouped_mm transformers' MixtralSparseMoeBlock with experts_implementation "eager" / "grouped_mm"
                        (skipped with a message when transformers is not installed).
  moetron capacity      MoELayer, DeepSpeed routing, capacity factor 1.0, token dropping: the fair peer of
  deepspeed             deepspeed.moe.layer.MoE with the same settings (skipped when deepspeed is missing).
Time: median over --reps runs of forward+backward (parameter grads and input grad; process CPU time on one
thread by default), after --warmup runs, implementations interleaved in a rotating order within every rep.
Memory: peak bytes live in torch's CPU allocator between the start of forward and the end of backward
(torch.profiler's allocation events, profile_memory=True, summed in time order), minus what was live at
the start: saved activations, temporaries and gradients, the same accounting for every implementation.
Gradients are set to None before every step (zero_grad(set_to_none=True)), as in training.
Page faults: median minor faults per step (getrusage). Their system time is in the CPU clock, and whether a step
faults depends on the heap's state (glibc trims freed blocks off the top of the heap or unmaps large ones, and the
next step faults them back in), so it can differ between processes of the same code: at E=64 the floor faulted
0 pages per step in one process and ~5000 (~7 ms, its ratio 1.30× → 1.16×) in the next. Read a ratio beside the
floor's fault count.
--phases: instead, moetron's two layers split into phases (forward: router, permute, experts, combine + aux;
backward: combine, experts, permute, router + input-gradient sum), each a median over --reps steps as a
fraction of the floor measured alternately with them; clock marks come from module hooks in the forward and
tensor gradient hooks in the backward, so the layer runs its own code.
--kernel: instead, moetron dropless and capacity stepped alternately with the experts' C++ engine and with their
Python loop (`ExpertByExpertSwiGLU`'s two engines, moetron/cpu/experts.py), outputs and
gradients checked bitwise equal; prints the median step times and the median of the per-rep ratios.
--fast-paths: instead, moetron dropless stepped alternately with and without its router/combine fast paths (k = 1
top-k by `max`, the combine in L2-sized chunks; "without" = topk and one pass), outputs and gradients checked
bitwise equal; prints the median step times and the median of the per-rep ratios.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

try:
    import resource
except ImportError:  # not Unix: no fault counts
    resource = None

from memory_peak import peak_cpu_bytes
from moetron.cpu import use_cpu_backends
from moetron.model.config import ModelConfig
from moetron.model.moe.layer import MoELayer


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int

    def __str__(self) -> str:
        return f"T={self.tokens} D={self.hidden} F={self.ffn} E={self.experts} k={self.topk}"


# Process CPU time by default: on a shared machine wall time mostly measures the other jobs (one step of
# the same code varied 3x in wall time here under load). With one thread it is the work done by this step.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
CLOCK_HELP = "cpu: process CPU time (robust on a shared machine; use with --threads 1), wall: elapsed time"
SHAPES = [Shape(4096, 512, 1024, 8, 2), Shape(8192, 128, 256, 64, 1), Shape(8192, 256, 512, 128, 1)]


@dataclass
class Step:
    """One forward+backward (returns the output, for the cross-checks) and the leaves it writes .grad to."""

    run: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    reseed: bool = False  # the step draws random routing choices: the same ones every call (`reset`)

    def __call__(self) -> torch.Tensor:
        return self.run()

    def reset(self) -> None:
        """Before every step, outside its timing: optimizer.zero_grad(set_to_none=True), as in training (no
        accumulation work), and `torch.manual_seed(1)` for a step that draws random routing choices (RTS, the 2nd
        expert's sampling), so every implementation and every call draws the same ones. Not timed: the seed call
        (~0.1 ms, CUDA/XPU/MTIA lazy-init bookkeeping included) is no part of a layer, and the floor makes none."""
        for leaf in self.leaves:
            leaf.grad = None
        if self.reseed:
            torch.manual_seed(1)


@dataclass
class Weights:
    w1_EDF: torch.Tensor  # gate projection (activation applied)
    w3_EDF: torch.Tensor  # up projection
    w2_EFD: torch.Tensor
    router_ED: torch.Tensor


def make_weights(s: Shape) -> Weights:
    g = torch.Generator().manual_seed(0)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    d, f, e = s.hidden, s.ffn, s.experts
    return Weights(
        normal(e, d, f, std=d**-0.5), normal(e, d, f, std=d**-0.5), normal(e, f, d, std=f**-0.5), normal(e, d, std=0.02)
    )


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


# ---------------------------------------------------------------- implementations
def floor_step(s: Shape, w: Weights) -> Step:
    rows = s.tokens * s.topk
    x_ECD = _leaf(torch.randn(s.experts, rows // s.experts, s.hidden))
    grad_ECD = torch.randn(x_ECD.shape)
    w1, w3, w2 = _leaf(w.w1_EDF), _leaf(w.w3_EDF), _leaf(w.w2_EFD)

    def step() -> torch.Tensor:
        h_ECF = nn.functional.silu(torch.bmm(x_ECD, w1)) * torch.bmm(x_ECD, w3)
        y_ECD = torch.bmm(h_ECF, w2)
        y_ECD.backward(grad_ECD)
        return y_ECD

    return Step(step, [x_ECD, w1, w3, w2])


def _moetron_cfg(s: Shape, dropless: bool) -> ModelConfig:
    cfg = ModelConfig(hidden_size=s.hidden, num_attention_heads=1, ffn_hidden_size=s.ffn, swiglu=True)
    cfg.add_bias_linear, cfg.num_experts, cfg.topk = False, [s.experts], s.topk
    if dropless:  # Mixtral: softmax over all experts, top-k, renormalise; no capacity
        cfg.moe_token_dropping, cfg.moe_router_topk_renorm = False, True
    else:  # DeepSpeed's MoE defaults at capacity factor 1.0
        cfg.moe_train_capacity_factor, cfg.moe_min_capacity = 1.0, 4
    return cfg


def moetron_layer(s: Shape, w: Weights, dropless: bool) -> MoELayer:
    layer = MoELayer(_moetron_cfg(s, dropless), s.experts, layer_index=0)
    with torch.no_grad():
        layer.experts.w1_EDF.copy_(w.w1_EDF)
        layer.experts.w3_EDF.copy_(w.w3_EDF)
        layer.experts.w2_EFD.copy_(w.w2_EFD)
        layer.router.weight.copy_(w.router_ED)
    return layer


def module_step(module: nn.Module, s: Shape, x_BTD: torch.Tensor, grad_BTD: torch.Tensor) -> Step:
    def step() -> torch.Tensor:
        out = module(x_BTD)
        y_BTD = out[0] if isinstance(out, tuple) else out
        y_BTD.backward(grad_BTD)
        return y_BTD

    return Step(step, [x_BTD, *module.parameters()], reseed=True)


def hf_block(s: Shape, w: Weights, implementation: str) -> nn.Module | None:
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    config = MixtralConfig(
        hidden_size=s.hidden,
        intermediate_size=s.ffn,
        num_local_experts=s.experts,
        num_experts_per_tok=s.topk,
        router_jitter_noise=0.0,
    )
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():  # gate_up_proj [E, 2F, D] = [gate | up] (act on gate); down_proj [E, D, F]
        block.experts.gate_up_proj.copy_(torch.cat([w.w1_EDF, w.w3_EDF], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(w.w2_EFD.transpose(1, 2))
        block.gate.weight.copy_(w.router_ED)
    return block


class SwiGLUExpert(nn.Module):
    """The expert module handed to DeepSpeed (it deep-copies it E times)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def deepspeed_moe(s: Shape, w: Weights) -> nn.Module | None:
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except Exception:  # ImportError, or a broken CPU install
        return None
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=False, init_method="tcp://127.0.0.1:29591", rank=0, world_size=1
        )
    moe = MoE(
        s.hidden,
        SwiGLUExpert(s.hidden, s.ffn),
        num_experts=s.experts,
        ep_size=1,
        k=s.topk,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=4,
        drop_tokens=True,
        use_rts=True,
    )
    with torch.no_grad():
        for e, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            expert.w1.weight.copy_(w.w1_EDF[e].T)
            expert.w3.weight.copy_(w.w3_EDF[e].T)
            expert.w2.weight.copy_(w.w2_EFD[e].T)
        moe.deepspeed_moe.gate.wg.weight.copy_(w.router_ED)
    return moe


def build_steps(s: Shape) -> tuple[dict[str, Step], list[str]]:
    w = make_weights(s)
    x_BTD = _leaf(torch.randn(1, s.tokens, s.hidden))
    grad_BTD = torch.randn(x_BTD.shape)
    steps: dict[str, Step] = {"floor": floor_step(s, w)}
    notes: list[str] = []
    steps["moetron dropless"] = module_step(moetron_layer(s, w, dropless=True), s, x_BTD, grad_BTD)
    for impl in ("eager", "grouped_mm"):
        block = hf_block(s, w, impl)
        if block is None:
            notes.append("transformers not installed: HF Mixtral rows skipped (pip install transformers)")
            break
        steps[f"hf {impl}"] = module_step(block, s, x_BTD, grad_BTD)
    steps["moetron capacity"] = module_step(moetron_layer(s, w, dropless=False), s, x_BTD, grad_BTD)
    ds = deepspeed_moe(s, w)
    if ds is None:
        notes.append("deepspeed not importable: DeepSpeed row skipped (DS_BUILD_OPS=0 pip install deepspeed)")
    else:
        steps["deepspeed"] = module_step(ds, s, x_BTD, grad_BTD)
    return steps, notes


# ---------------------------------------------------------------- measurement
def peak_bytes(step: Step) -> int:
    """Peak of (bytes live in torch's CPU allocator) during one step, relative to the start."""
    step.reset()
    return peak_cpu_bytes(step)


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where `resource` is missing: not Unix)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def median_times(
    steps: dict[str, Step], reps: int, warmup: int, clock: Callable[[], float]
) -> tuple[dict[str, float], dict[str, float]]:
    """(median step time, median minor page faults per step) of each implementation."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        rotated = names[rep % len(names) :] + names[: rep % len(names)]
        for name in rotated:
            steps[name].reset()
            faults_before, start = minor_faults(), clock()
            steps[name]()
            elapsed, faulted = clock() - start, minor_faults() - faults_before
            if rep >= warmup:
                times[name].append(elapsed)
                faults[name].append(faulted)
    return {n: statistics.median(t) for n, t in times.items()}, {n: statistics.median(f) for n, f in faults.items()}


def cross_checks(steps: dict[str, Step]) -> list[str]:
    """Same weights and routing rule ⇒ same outputs: a benchmark of a wrong layer would be meaningless."""
    lines = []
    pairs = [("moetron dropless", "hf eager"), ("moetron dropless", "hf grouped_mm"), ("moetron capacity", "deepspeed")]
    for ours, theirs in pairs:
        if theirs in steps:
            outputs = []
            for name in (ours, theirs):
                steps[name].reset()
                outputs.append(steps[name]().detach())
            diff = (outputs[0] - outputs[1]).abs().max().item()
            lines.append(f"max |{ours} − {theirs}| = {diff:.2e}")
    return lines


def run_shape(s: Shape, reps: int, warmup: int, clock: Callable[[], float]) -> list[str]:
    steps, notes = build_steps(s)
    checks = cross_checks(steps)
    seconds, faults = median_times(steps, reps, warmup, clock)
    memory = {name: peak_bytes(step) for name, step in steps.items()}
    rows = [
        f"| {s} | {name} | {seconds[name] / seconds['floor']:.2f}× | {memory[name] / memory['floor']:.2f}× "
        f"| {faults[name]:.0f} |"
        for name in steps
    ]
    return rows + [f"<!-- {line} -->" for line in notes + checks]


# ---------------------------------------------------------------- phases
def phase_step(layer: MoELayer, x_BTD: torch.Tensor, grad_BTD: torch.Tensor, clock: Callable[[], float]):
    """(step, marks): one forward+backward of `layer` that appends (phase boundary, clock) to `marks`."""
    marks: list[tuple[str, float]] = []

    def mark(name: str) -> None:
        marks.append((name, clock()))

    def on_grad(name: str) -> Callable[[torch.Tensor], None]:
        return lambda _grad: mark(name)

    last = {"name": "backward: router + input-gradient sum"}

    def after_router(_module, _inputs, routing) -> None:
        mark("router")
        if routing.unit_weights:  # the combine leaves the weights out of the graph: no mark between the two
            last["name"] = "backward: permute + router + input-gradient sum"
        elif routing.weights_TK.requires_grad:
            routing.weights_TK.register_hook(on_grad("backward: permute"))  # reached after the experts' backward

    def before_experts(_module, _inputs) -> None:
        mark("permute")

    def after_experts(_module, _inputs, y_ND) -> None:
        mark("experts")
        y_ND.register_hook(on_grad("backward: combine"))
        # after the experts' backward node has run (their input in token order is the layer's own input, whose
        # gradient is only complete after the router's backward: a hook on it would mark too late)
        y_ND.grad_fn.register_hook(lambda _grad_inputs, _grad_outputs: mark("backward: experts"))

    layer.router.register_forward_hook(after_router)
    layer.experts.register_forward_pre_hook(before_experts)
    layer.experts.register_forward_hook(after_experts)

    def step() -> torch.Tensor:
        marks.clear()
        torch.manual_seed(1)
        mark("start")
        y_BTD, _aux = layer(x_BTD)
        mark("combine + aux")
        y_BTD.backward(grad_BTD)
        mark(last["name"])
        return y_BTD

    return Step(step, [x_BTD, *layer.parameters()]), marks


def run_phases(s: Shape, reps: int, warmup: int, clock: Callable[[], float]) -> list[str]:
    w = make_weights(s)
    x_BTD = _leaf(torch.randn(1, s.tokens, s.hidden))
    grad_BTD = torch.randn(x_BTD.shape)
    floor = floor_step(s, w)
    rows = []
    for dropless in (True, False):
        step, marks = phase_step(moetron_layer(s, w, dropless), x_BTD, grad_BTD, clock)
        floor_times, phases = [], {}
        for rep in range(warmup + reps):
            floor.reset()
            start = clock()
            floor()
            floor_time = clock() - start
            step.reset()
            step()
            if rep < warmup:
                continue
            floor_times.append(floor_time)
            for (_, before), (name, after) in itertools.pairwise(marks):
                phases.setdefault(name, []).append(after - before)
            phases.setdefault("total", []).append(marks[-1][1] - marks[0][1])
        floor_median = statistics.median(floor_times)
        kind = "moetron dropless" if dropless else "moetron capacity"
        rows += [f"| {s} | {kind} | {name} | {statistics.median(t) / floor_median:.3f} |" for name, t in phases.items()]
    return rows


# ---------------------------------------------------------------- fast paths A/B
def alternate(
    step: Step, use: Callable[[bool], None], reps: int, warmup: int, clock: Callable[[], float]
) -> tuple[float, float, float, bool]:
    """`step` run alternately with `use(True)` and `use(False)` (the order alternates per rep): (median time with,
    median time without, median of the per-rep ratios with / without, outputs and gradients bitwise equal)."""

    def timed(flag: bool) -> tuple[float, list[torch.Tensor]]:
        use(flag)
        step.reset()
        start = clock()
        y = step()
        elapsed = clock() - start
        return elapsed, [y.detach(), *(leaf.grad for leaf in step.leaves if leaf.grad is not None)]

    try:
        (_, on), (_, off) = timed(True), timed(False)
        equal = len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(warmup + reps):
            for flag in (True, False) if rep % 2 else (False, True):
                elapsed = timed(flag)[0]
                if rep >= warmup:
                    times[flag].append(elapsed)
    finally:
        use(True)
    ratio = statistics.median(a / b for a, b in zip(times[True], times[False], strict=True))
    return statistics.median(times[True]), statistics.median(times[False]), ratio, equal


def run_fast_paths(s: Shape, reps: int, warmup: int, clock: Callable[[], float]) -> list[str]:
    """moetron dropless with its router/combine fast paths on and off, interleaved (order alternates per rep)."""
    from moetron.model.moe import dispatch
    from moetron.model.moe.routing import generic_gating

    w = make_weights(s)
    x_BTD = _leaf(torch.randn(1, s.tokens, s.hidden))
    step = module_step(moetron_layer(s, w, dropless=True), s, x_BTD, torch.randn(x_BTD.shape))
    fast = (generic_gating.top_experts, dispatch.CHUNK_BYTES)
    slow = (lambda select_TE, k: torch.topk(select_TE, k=k, dim=1).indices, 1 << 62)  # one chunk: one pass

    def use(on: bool) -> None:
        generic_gating.top_experts, dispatch.CHUNK_BYTES = fast if on else slow

    on, off, ratio, equal = alternate(step, use, reps, warmup, clock)
    return [f"| {s} | {off * 1e3:.1f} ms | {on * 1e3:.1f} ms | {ratio:.3f} | {equal} |"]


def run_kernel(s: Shape, reps: int, warmup: int, clock: Callable[[], float]) -> list[str]:
    """moetron dropless and capacity with the experts' C++ engine and with their Python loop, interleaved."""
    from moetron.cpu import experts as cpu_kernels

    if cpu_kernels.compiled_engine() is None:
        from moetron.cpu.compiled_kernels import unavailable_reason

        return [f"<!-- the C++ engine is not available here: {unavailable_reason() or 'it did not build'} -->"]
    chosen = cpu_kernels.swiglu_engine

    def use(compiled: bool) -> None:
        cpu_kernels.swiglu_engine = chosen if compiled else (lambda *tensors: cpu_kernels.PYTHON_LOOP)

    w = make_weights(s)
    x_BTD = _leaf(torch.randn(1, s.tokens, s.hidden))
    rows = []
    for dropless in (True, False):
        step = module_step(moetron_layer(s, w, dropless), s, x_BTD, torch.randn(x_BTD.shape))
        on, off, ratio, equal = alternate(step, use, reps, warmup, clock)
        kind = "dropless" if dropless else "capacity"
        rows.append(f"| {s} | {kind} | {off * 1e3:.1f} ms | {on * 1e3:.1f} ms | {ratio:.3f} | {equal} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=int, nargs="*", default=list(range(len(SHAPES))), help="indices into SHAPES")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help=CLOCK_HELP)
    parser.add_argument("--phases", action="store_true", help="moetron's step split into phases, / floor")
    parser.add_argument("--fast-paths", action="store_true", help="A/B of the router/combine fast paths")
    parser.add_argument("--kernel", action="store_true", help="A/B of the experts' C++ engine and Python loop")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads, reps = torch.get_num_threads(), args.reps
    use_cpu_backends()  # moetron's layer as a CPU run computes it (`build` does the same)
    print(f"torch {torch.__version__}, {threads} thread(s), {args.clock} time, fp32 CPU, median of {reps} fwd+bwd\n")
    tables = {  # the other modes: a header and a row source per shape
        "phases": ("| shape | implementation | phase | time / floor |\n|---|---|---|---|", run_phases),
        "fast_paths": (
            "| shape | without | with | with / without (median of reps) | outputs and grads equal |\n"
            "|---|---|---|---|---|",
            run_fast_paths,
        ),
        "kernel": (
            "| shape | layer | Python loop | C++ engine | C++ / Python (median of reps) | outputs and grads equal |\n"
            "|---|---|---|---|---|---|",
            run_kernel,
        ),
    }
    for mode, (header, rows) in tables.items():
        if getattr(args, mode):
            print(header)
            for index in args.shapes:
                for line in rows(SHAPES[index], args.reps, args.warmup, CLOCKS[args.clock]):
                    print(line, flush=True)
            return
    print("| shape | implementation | time / floor | peak memory / floor | minor page faults / step |")
    print("|---|---|---|---|---|")
    for index in args.shapes:
        for line in run_shape(SHAPES[index], args.reps, args.warmup, CLOCKS[args.clock]):
            print(line, flush=True)


if __name__ == "__main__":
    main()
