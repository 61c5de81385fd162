"""The tests whose results depend on the ISA that ATen and moetron's C++ kernels dispatch to: the CPU kernels against
ATen and the Python loops, and the bit-exact claims (resume, one thread against several). tests/conftest.py marks
them `isa_dependent`; tests/integration/test_every_cpu_isa.py runs them once more per ISA level this CPU can run
below its own (ATEN_CPU_CAPABILITY), so a machine-dependent failure shows on whatever machine runs the suite."""

ISA_DEPENDENT_FILES = (
    "tests/unit/cpu/test_cpu_kernels.py",
    "tests/unit/cpu/test_cpu_head_loss.py",
    "tests/unit/cpu/test_expert_kernel_split_backward.py",
    "tests/unit/cpu/test_cpu_threads.py",
    "tests/unit/cpu/test_gradient_memory.py",
    "tests/unit/cpu/test_cpu_experts.py",
    "tests/unit/test_fused_cross_entropy.py",
    "tests/unit/test_moe_perf_paths.py",
    "tests/unit/test_plan_lm_head.py",
    "tests/unit/test_moe_layer_bench.py",
    "tests/unit/test_run_continuation.py",
    "tests/unit/test_trainer.py",
)
