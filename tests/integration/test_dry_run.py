"""`moetron dry-run` end to end: tiny configs as one rank of 8 in every layout, planted GPU-path defects, the CLI.

The layouts share one process (tests/support/dry_run_driver.py: start-up and imports are most of a tiny rank's
time), the one-process runs and the planted defects another, and the CLI runs once. Each asserts what the GPU
path must show: the step runs, the host reads are the documented ones (moetron/dryrun/README section and
`benchmarks/host_syncs.py`), no GEMM runs in fp32 outside the router under bf16, the attention takes flash (or the
efficient kernel where the mask demands it), and the measured peak is the plan's within 10%.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moetron
from moetron.config_cli import config_from_flags
from moetron.dryrun import shim

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "support" / "dry_run_driver.py"

pytestmark = pytest.mark.skipif(
    shim.needs_shim() and shim.compiler() is None, reason="the dry run's fake-CUDA shim needs a C++ compiler"
)

TINY = (
    "--config gpt-1.3B-moe128 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
    " --num-experts 8 --vocab-size 512 --num-layers 4 --micro-batch-size 2 --bf16 --no-fp16 --train-iters 10"
    " --lr-warmup-iters 0 --eval-iters 0 --no-checkpoint-activations"
)
EP = " --moe-expert-parallel-size 4"
LAYOUTS = {  # one rank (5) of 8; two MoE layers (1 and 3) in every model
    "ep": TINY + EP + " --global-batch-size 16",
    "ep_static": TINY + EP + " --global-batch-size 16 --moe-ep-dispatch static",
    "tp_sp": TINY + EP + " --global-batch-size 8 --tensor-model-parallel-size 2 --sequence-parallel",
    "cp": TINY + EP + " --global-batch-size 8 --context-parallel-size 2",
    "cp4_gqa": TINY + EP + " --global-batch-size 8 --context-parallel-size 4 --num-key-value-heads 2",
    "cp_ring_gqa": TINY + EP + " --global-batch-size 8 --context-parallel-size 2 --num-key-value-heads 2"
    " --cp-comm-type p2p --attention-dropout 0",
    "cp_ulysses": TINY + EP + " --global-batch-size 8 --context-parallel-size 2 --cp-comm-type a2a",
    "pp": TINY + EP + " --global-batch-size 16 --pipeline-model-parallel-size 2",  # rank 5: the last stage
    "zero1": TINY + EP + " --global-batch-size 16 --zero-stage 1",
    "zero3": TINY + EP + " --global-batch-size 16 --zero-stage 3",
}
REFUSED = TINY + EP + " --global-batch-size 8 --tensor-model-parallel-size 2 --moe-ep-dispatch static"
LOCAL = TINY + " --moe-expert-parallel-size 1 --global-batch-size 2"
ONE_PROCESS = {  # world size 1; the plants are undone after their run
    "local": "none|" + LOCAL,
    "local_batched_dropless": "none|" + LOCAL + " --moe-expert-backend batched --no-moe-token-dropping",
    "local_fp16": "none|" + LOCAL.replace("--bf16 --no-fp16", "--fp16 --no-bf16"),
    "local_fp32": "none|" + LOCAL.replace("--bf16 --no-fp16", "--no-bf16 --no-fp16"),
    "planted_cpu_tensor": "cpu_tensor|" + LOCAL,
    "planted_item": "item|" + LOCAL,
}


def site(path: str, text: str) -> str:
    """`path:line` of the first line of moetron's `path` holding `text`: the documented host reads and GEMMs, found
    in the source rather than written as numbers that any edit above them would shift."""
    source = (Path(moetron.__file__).parent / path.removeprefix("moetron/")).read_text().splitlines()
    return f"{path}:{next(i for i, line in enumerate(source, 1) if text in line)}"


ALL_TO_ALL = site("moetron/parallel/ep/all_to_all.py", "sizes = torch.cat([counts_RL.sum(1), recv_RL.sum(1)]).tolist()")
STATIC_CHECK = site("moetron/parallel/ep/static_buffers.py", "in zip(self.dispatchers, shares.tolist(), strict=True)")
STEP_READ = site("moetron/train/signals.py", "return float(norm), False")  # one process
STEP_READ_DISTRIBUTED = site("moetron/train/signals.py", "norm_value, flag_value = torch.stack(")
ROUTER = site("moetron/model/moe/routing/router.py", "return F.linear(x_TD, self.weight.float())")
BATCHED_READ = site("moetron/model/moe/experts/backends.py", "capacity = int(counts_E.max()) if num_experts else 0")


def run_driver(tmp: Path, world_size: int, rank: int, specs: list[str]) -> list[dict]:
    out = tmp / "records.json"
    env = {**os.environ, shim.SHIM_ENV: str(shim.built_shim() or "")}
    command = [sys.executable, str(DRIVER), str(out), str(world_size), str(rank), *specs]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


QUICK_LAYOUTS = ("ep", "cp4_gqa", "pp")  # in the quick subset; the others run with the full suite (one driver each)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict]:
    specs = [f"none|{LAYOUTS[name]}" for name in QUICK_LAYOUTS] + [f"none|{REFUSED}"]
    records = run_driver(tmp_path_factory.mktemp("layouts"), 8, 5, specs)
    return dict(zip([*QUICK_LAYOUTS, "refused"], records, strict=True))


@pytest.fixture(scope="module")
def more_layouts(tmp_path_factory) -> dict[str, dict]:
    names = [name for name in LAYOUTS if name not in QUICK_LAYOUTS]
    records = run_driver(tmp_path_factory.mktemp("more"), 8, 5, [f"none|{LAYOUTS[name]}" for name in names])
    return dict(zip(names, records, strict=True))


def layout_record(request, name: str) -> dict:
    return request.getfixturevalue("layouts" if name in QUICK_LAYOUTS else "more_layouts")[name]


def layout_params(*extra: str) -> list:
    """Every layout name (and `extra` ones first), the ones outside the quick subset marked slow."""
    quick = (*extra, *QUICK_LAYOUTS)
    return [pytest.param(name, marks=[] if name in quick else [pytest.mark.slow]) for name in (*extra, *LAYOUTS)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, dict]:
    records = run_driver(tmp_path_factory.mktemp("one"), 1, 0, list(ONE_PROCESS.values()))
    return dict(zip(ONE_PROCESS, records, strict=True))


def per_step_moe_reads(record: dict) -> int:
    return record["local_moe_layers"] * record["micro_batches"]


def expected_reads(name: str, record: dict) -> dict[str, int]:
    """The documented host reads of a step: one for the step (the gradient norm and stop flag), plus the default
    EP dispatcher's split sizes once per MoE layer and micro-batch, or the static dispatcher's one check."""
    if name == "ep_static":
        return {STATIC_CHECK: 1, STEP_READ_DISTRIBUTED: 1}
    return {ALL_TO_ALL: per_step_moe_reads(record), STEP_READ_DISTRIBUTED: 1}


def assert_gpu_path_is_clean(record: dict) -> None:
    assert "error" not in record, record
    gemm_sites = {at.removeprefix("backward of ") for _, at, _ in record["fp32_gemms"]}
    assert gemm_sites <= {ROUTER}, record["fp32_gemms"]  # bf16 everywhere but the fp32 gate
    assert record["cpu_ops"] == [], record["cpu_ops"]


def test_a_layout_train_refuses_is_refused_before_anything_is_built(layouts):
    record = layouts["refused"]
    assert record["error"].startswith("ConfigError: ") and "static" in record["error"]


@pytest.mark.parametrize("name", layout_params())
def test_each_layout_runs_as_one_rank_of_eight(request, name):
    record = layout_record(request, name)
    assert_gpu_path_is_clean(record)
    assert record["local_moe_layers"] == (1 if name == "pp" else 2)
    assert record["host_reads"] == expected_reads(name, record)
    kernels = record["attention_kernels"]
    attention_layers = 2 if name == "pp" else 4
    # all-gather CP: a bottom-right causal flash call per zigzag chunk; ring: one per K/V block (2 ranks)
    calls = 2 if name in ("cp", "cp4_gqa", "cp_ring_gqa") else 1
    flash = calls * attention_layers * record["micro_batches"]
    assert kernels == {"flash": flash, "efficient": 0, "cudnn": 0, "math": 0}  # no mask reaches a kernel
    assert record["peak_bytes"] > 0 and record["step_seconds"] and len(record["step_seconds"]) == 2


@pytest.mark.slow  # every layout's driver
def test_layouts_send_their_collectives(request, layouts):
    ops = {name: {c[0] for c in layout_record(request, name)["collectives"]} for name in LAYOUTS}
    assert "c10d.alltoall_base_.default" in ops["ep"]
    assert {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"} <= ops["zero3"]
    assert "_c10d_functional.reduce_scatter_tensor.default" in ops["tp_sp"]
    assert {"c10d.send.default", "c10d.recv_.default"} & ops["pp"]
    combine = [c for c in layouts["ep"]["collectives"] if c[0] == "c10d.alltoall_base_.default" and c[1] == "bfloat16"]
    assert combine, "the experts' outputs go back in the compute dtype"


@pytest.mark.parametrize("name", layout_params("local"))
def test_the_measured_peak_is_the_plans_within_ten_percent(request, one_process, name):
    from moetron.plan.memory import planned_peak_bytes

    if name == "local":
        record, flags, world = one_process[name], LOCAL, 1
    else:
        record, flags, world = layout_record(request, name), LAYOUTS[name], 8
    planned = planned_peak_bytes(config_from_flags(flags.split())[0], world, "cuda")
    assert abs(record["peak_bytes"] / planned - 1) < 0.10, (record["peak_bytes"], planned, record["peak_at"])


def test_one_process_reads_once_per_step(one_process):
    record = one_process["local"]
    assert_gpu_path_is_clean(record)
    assert record["host_reads"] == {STEP_READ: 1}
    assert record["attention_kernels"]["flash"] == 4


def test_fp16_runs_on_the_gpu_path_and_fp32_takes_the_efficient_kernel(one_process):
    fp16, fp32 = one_process["local_fp16"], one_process["local_fp32"]
    assert_gpu_path_is_clean(fp16)
    assert fp16["host_reads"] == {STEP_READ: 1} and fp16["attention_kernels"]["flash"] == 4
    assert "error" not in fp32 and fp32["host_reads"] == {STEP_READ: 1}
    assert fp32["attention_kernels"] == {"flash": 0, "efficient": 4, "cudnn": 0, "math": 0}  # flash: fp16/bf16 only


def test_batched_experts_read_the_largest_load_once_per_moe_layer(one_process):
    record = one_process["local_batched_dropless"]
    assert_gpu_path_is_clean(record)
    assert record["host_reads"] == {STEP_READ: 1, BATCHED_READ: 2}
    assert record["moe_layer_reads_per_step"] == 2


def test_a_cpu_tensor_inside_a_layer_is_a_defect_named_with_its_line(one_process):
    record = one_process["planted_cpu_tensor"]
    assert record["op"] == "aten.add.Tensor"
    assert record["where"] == f"{DRIVER}:{record['planted_line']}"
    assert "CPU tensor [64]" in record["error"]


def test_an_item_inside_a_moe_layer_is_an_extra_host_read_per_layer(one_process):
    record = one_process["planted_item"]
    assert_gpu_path_is_clean(record)
    planted = f"{DRIVER}:{record['planted_line']}"
    assert record["host_reads"] == {STEP_READ: 1, planted: 2}
    assert record["moe_layer_reads_per_step"] == 2


@pytest.mark.slow  # a CLI process of its own (the quick subset runs the layouts in one)
def test_the_command_prints_writes_json_and_exits_1_when_it_does_not_fit(tmp_path):
    out = tmp_path / "dry.json"
    flags = [*LAYOUTS["ep"].split(), "--gpus", "8", "--gpu-memory", "1MB", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "moetron", "dry-run", *flags], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "verdict: does NOT fit" in proc.stdout
    report = json.loads(out.read_text())
    keys = {"device", "world_size", "ranks", "peak_bytes", "planned_peak_bytes", "peak_by_category"}
    keys |= {"host_reads_per_step", "host_reads_per_moe_layer", "host_reads", "collectives", "attention_kernels"}
    assert keys <= set(report)
    assert (report["device"], report["world_size"], report["ranks"]) == ("cuda", 8, [0])
    assert report["host_reads_per_step"] == 3 and report["host_reads_per_moe_layer"] == 1
    assert {c["op"] for c in report["collectives"]} >= {"c10d.alltoall_base_.default"}
    assert set(report["attention_kernels"]) == {"flash", "efficient", "cudnn", "math"}


@pytest.mark.slow  # a CLI process of its own (the quick subset runs the layouts in one)
def test_plan_dry_run_prints_both_peaks_and_the_measured_verdict_decides():
    """`plan --dry-run`: the exit status is the dry run's verdict; with --json its report is under "dry_run" (the
    side-by-side text: tests/unit/test_dry_run_parts.py)."""
    flags = [*LAYOUTS["ep"].split(), "--gpus", "8", "--gpu-memory", "1GB", "--dry-run"]
    proc = subprocess.run([sys.executable, "-m", "moetron", "plan", *flags, "--json"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # a tiny step plus the 1 GiB CUDA context does not fit 1 GiB
    plan = json.loads(proc.stdout)
    dry = plan["dry_run"]
    assert dry["ranks"] == [0] and dry["fits"] is False and dry["planned_peak_bytes"] == plan["memory"]["peak"]
    assert abs(dry["peak_bytes"] / dry["planned_peak_bytes"] - 1) < 0.10


@pytest.mark.slow  # a CLI process of its own (the quick subset runs the layouts in one)
def test_measured_routing_sizes_the_hottest_ranks_buffers(tmp_path):
    """--routing-from: experts 0-1 (EP rank 0's) take most routes; rank 0 is simulated, receives more rows than
    under balanced routing, and its peak is within 10% of what `plan --routing-from` says for that rank."""
    routes = {"iteration": 10, "expert_parallel_size": 4, "expert_replicas": 0, "layers": [
        {"routes_per_expert": [40, 40, 10, 10, 10, 10, 5, 5]}, {"routes_per_expert": [30, 30, 20, 20, 10, 10, 5, 5]},
    ]}  # fmt: skip
    (tmp_path / "routing_counts.json").write_text(json.dumps(routes))
    out = tmp_path / "dry.json"
    flags = [*LAYOUTS["ep"].split(), "--no-moe-token-dropping", "--gpus", "8", "--routing-from", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "moetron", "dry-run", *flags, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["ranks"] == [0]
    received = max(c["bytes"] for c in report["collectives"] if c["op"] == "c10d.alltoall_base_.default")
    balanced = 2 * 64 * 1 * 64 * 2  # T·K rows (mbs 2 × seq 64 × top-1) of hidden 64 in bf16, sent or received
    assert received > balanced
    assert abs(report["peak_bytes"] / report["planned_peak_bytes"] - 1) < 0.10


@pytest.mark.slow  # a CLI process of its own (the quick subset runs the layouts in one)
def test_gpu_smoke_puts_the_dry_run_of_its_slice_beside_the_real_peak(monkeypatch):
    """On a GPU, benchmarks/gpu_smoke.py checks the dry run itself: its slice (bf16, grouped_mm; eager, as the dry
    run runs) on fake CUDA devices, the measured peak beside the real one."""
    monkeypatch.syspath_prepend(REPO / "benchmarks")  # the benchmark under test, not a helper
    import gpu_smoke

    args = gpu_smoke.parse_args(["--tiny"])
    cfg = gpu_smoke.slice_config(args, 2, "cuda", precise=False)
    line = gpu_smoke.dry_run_line(cfg, measured=64 * 2**20)
    pattern = r"dry run peak (\d+\.\d\d) MiB \(fake cuda, same slice\); real / dry run (\d+\.\d\d)(.*)"
    match = re.fullmatch(pattern, line)
    assert match, line  # a tiny slice's peak: some MiB
    assert float(match[2]) == pytest.approx(64 / float(match[1]), rel=0.01)
    assert match[3] == " (the real run compiled; the dry run is eager)" and cfg.train.compile
