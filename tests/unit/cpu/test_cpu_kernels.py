"""moetron's C++ CPU kernels (`compiled_kernels.py`): the SwiGLU engine is bitwise the Python loop, the router's
first_max_column is max/argmax's column, and every way of not getting them (turned off, no build, a differing
build) leaves the Python code running."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moetron.cpu import compiled_kernels
from moetron.cpu import experts as cpu_kernels


@pytest.fixture
def engine(swiglu_cpp_engine):
    return swiglu_cpp_engine


@pytest.fixture
def fresh_load():
    """The kernel and the engine are decided again (their per-process caches cleared before and after)."""
    for cached in (compiled_kernels.compiled_cpu_kernels, cpu_kernels.compiled_engine):
        cached.cache_clear()
    yield
    for cached in (compiled_kernels.compiled_cpu_kernels, cpu_kernels.compiled_engine):
        cached.cache_clear()


def _problem(counts: list[int], hidden: int, ffn: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts) + 3, hidden, generator=g) * scale
    w1, w3 = (torch.randn(len(counts), hidden, ffn, generator=g) * hidden**-0.5 for _ in range(2))
    w2 = torch.randn(len(counts), ffn, hidden, generator=g) * ffn**-0.5
    return torch.randn(x.shape[0], hidden, generator=g), x, w1, w3, w2


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_compiled_engine_is_bitwise_the_python_loop(engine, threads):
    """Tails of the vector loop (F = 257), an expert without rows, a dropped-route tail, saturated exps (scale 40),
    and the one-row, one-column and width-1 GEMMs whose BLAS arguments at::mm picks by their own rule — the kernel at
    one, two and three threads (each expert on one thread, the experts spread over them) against the Python loop at
    one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [([300, 0, 17, 64], 16, 257, 1.0), ([5, 9, 2], 8, 40, 40.0)]
        cases += [([1, 1, 3], 1, 1, 1.0), ([3, 1], 16, 1, 1.0), ([2, 1], 1, 5, 1.0)]  # BLAS layouts of size-1 dims
        for counts, hidden, ffn, scale in cases:
            grad, *operands = _problem(counts, hidden, ffn, scale, seed=ffn)
            with torch.no_grad():
                ours = cpu_kernels.run_swiglu(engine, grad, *operands, counts)
                with cpu_kernels.python_loop_on_one_thread():
                    reference = cpu_kernels.run_swiglu(cpu_kernels.PYTHON_LOOP, grad, *operands, counts)
            for a, b in zip(ours, reference, strict=True):
                assert torch.equal(a, b)
            assert torch.equal(ours[0][sum(counts) :], torch.zeros(3, hidden))  # the tail: zero out, zero grad
            assert torch.equal(ours[1][sum(counts) :], torch.zeros(3, hidden))
            # token order: the rows read and written in place through a permutation give the same rows
            rows = sum(counts)
            tokens = torch.randperm(rows, generator=torch.Generator().manual_seed(rows))
            x, *weights = operands
            with torch.no_grad():
                in_place = cpu_kernels.run_swiglu(engine, grad[:rows], x[:rows], *weights, counts, tokens)
                with cpu_kernels.python_loop_on_one_thread():
                    python = cpu_kernels.PYTHON_LOOP
                    loop = cpu_kernels.run_swiglu(python, grad[:rows], x[:rows], *weights, counts, tokens)
            inverse = torch.argsort(tokens)
            for a, b in zip(in_place, loop, strict=True):
                assert torch.equal(a, b)
            y_token_order, grad_x_token_order = in_place[0], in_place[1]
            # the same values as the sorted run whose rows were x[tokens] (row r of it is token tokens[r])
            sorted_run = cpu_kernels.run_swiglu(engine, grad[:rows][tokens], x[:rows][tokens], *weights, counts)
            assert torch.equal(y_token_order, sorted_run[0][inverse])
            assert torch.equal(grad_x_token_order, sorted_run[1][inverse])
            for a, b in zip(in_place[2:], sorted_run[2:], strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def test_engine_choice_by_dtype_and_layout(engine):
    x, w = torch.zeros(4, 8), torch.zeros(2, 8, 8)
    assert cpu_kernels.swiglu_engine(x, w, w, w) is engine
    bf16 = (t.bfloat16() for t in (x, w, w, w))
    assert cpu_kernels.swiglu_engine(*bf16) is cpu_kernels.PYTHON_LOOP
    assert cpu_kernels.swiglu_engine(x, w.transpose(1, 2), w, w) is cpu_kernels.PYTHON_LOOP


def test_turned_off_by_the_environment(monkeypatch, fresh_load):
    monkeypatch.setenv("MOETRON_CPU_KERNELS", "0")
    assert compiled_kernels.unavailable_reason() == "MOETRON_CPU_KERNELS=0"
    assert compiled_kernels.compiled_cpu_kernels() is None and cpu_kernels.compiled_engine() is None
    x, w = torch.zeros(4, 8), torch.zeros(2, 8, 8)
    assert cpu_kernels.swiglu_engine(x, w, w, w) is cpu_kernels.PYTHON_LOOP


def test_without_the_sources_the_kernels_are_off_and_the_python_code_runs(monkeypatch, fresh_load, tmp_path):
    """Installed without its csrc/ (package data left out) the kernels are simply unavailable: the experts' Python
    loop and ATen's index_add_ run."""
    monkeypatch.setattr(compiled_kernels, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(compiled_kernels, "SOURCES", [tmp_path / "csrc" / "module.cpp"])
    assert compiled_kernels.unavailable_reason() == f"the kernel sources are not in {tmp_path / 'csrc'}"
    assert compiled_kernels.compiled_cpu_kernels() is None
    out = compiled_kernels.index_add_rows(torch.zeros(2, 3), torch.tensor([1, 1]), torch.ones(2, 3))
    assert torch.equal(out, torch.tensor([[0.0] * 3, [2.0] * 3]))


def test_a_failed_build_warns_once_and_the_python_code_runs(monkeypatch, fresh_load, tmp_path):
    if compiled_kernels.unavailable_reason():
        pytest.skip(compiled_kernels.unavailable_reason())
    monkeypatch.setenv("MOETRON_KERNEL_CACHE", str(tmp_path))  # nothing cached there

    def failing_build(name, flags):
        raise RuntimeError("Error building extension 'moetron_swiglu'\nsecond line")

    monkeypatch.setattr(compiled_kernels, "_build", failing_build)
    with pytest.warns(
        UserWarning, match=r"did not build \(Error building extension 'moetron_swiglu'\); using the Python code"
    ):
        assert compiled_kernels.compiled_cpu_kernels() is None
    assert compiled_kernels.compiled_cpu_kernels() is None  # decided once per process: no second warning


def test_a_build_that_differs_by_one_bit_is_refused(engine, monkeypatch, fresh_load):
    module = engine.module

    class OffByOneUlp:
        swiglu_backward = staticmethod(module.swiglu_backward)

        @staticmethod
        def swiglu_forward(*args):
            y, *rest = module.swiglu_forward(*args)
            return (torch.nextafter(y, torch.full_like(y, float("inf"))), *rest)

    assert cpu_kernels.matches_the_python_loop(engine)
    assert not cpu_kernels.matches_the_python_loop(cpu_kernels.CompiledLoop(OffByOneUlp))
    monkeypatch.setattr(cpu_kernels, "compiled_cpu_kernels", lambda: OffByOneUlp)
    with pytest.warns(UserWarning, match="differs from the Python loop here; using the Python loop"):
        assert cpu_kernels.compiled_engine() is None


def test_another_process_loads_the_cached_build_without_compiling(engine):
    code = (
        "from moetron.cpu.compiled_kernels import compiled_cpu_kernels as k, cache_dir;"
        "m = k(); print(m is not None, str(cache_dir()) in m.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "True"]
    assert "compiling" not in done.stderr


@pytest.mark.parametrize("num_experts", [1, 2, 7, 16, 64, 129])
def test_first_max_column_is_max_and_argmax_with_ties_nan_zeros_and_infinities(engine, num_experts):
    g = torch.Generator().manual_seed(num_experts)
    x_TE = (torch.randint(0, 3, (700, num_experts), generator=g).float() - 1) / 3  # many ties
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0])
    picks = torch.randint(0, 700 * num_experts, (300,), generator=g)
    x_TE.view(-1)[picks] = specials[torch.randint(0, 5, (300,), generator=g)]
    x_TE[0] = float("nan")  # an all-NaN row
    x_TE[1] = -0.0
    if num_experts > 1:
        x_TE[1, 1] = 0.0  # -0.0 and +0.0 tie: the first
    picked_T = compiled_kernels.first_max_column(x_TE)
    assert torch.equal(picked_T, x_TE.max(dim=1).indices)
    assert torch.equal(picked_T, torch.argmax(x_TE, dim=1))
    assert torch.equal(compiled_kernels.first_max_column(x_TE.t().contiguous().t()), picked_T)  # any layout
    assert compiled_kernels.first_max_column(x_TE.double()) is None  # other dtypes: the caller's own code


def test_the_top1_pick_compiles_without_a_graph_break():
    """Under torch.compile the router's pick is `max` again (an extension call would break the graph)."""
    from moetron.model.moe.routing.deepspeed_gating import first_argmax
    from moetron.model.moe.routing.generic_gating import top_experts

    x_TE = torch.randn(32, 64)
    for pick, expected in (
        (lambda x: top_experts(x, 1), x_TE.max(dim=1, keepdim=True).indices),
        (first_argmax, x_TE.argmax(1)),
    ):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(pick, fullgraph=True, backend="eager")(x_TE), expected)


def test_tensor_subclasses_and_bad_shapes_never_reach_a_pointer(engine):
    """A tensor subclass has no data of its own (a DTensor is a wrapper): the Python loop, which dispatches, runs it.
    Shapes or counts that do not fit are an error from the kernel, never a write past a buffer."""

    class Wrapped(torch.Tensor):
        pass

    x, w = torch.zeros(4, 8), torch.zeros(2, 8, 8)
    assert cpu_kernels.swiglu_engine(x.as_subclass(Wrapped), w, w, w) is cpu_kernels.PYTHON_LOOP
    assert compiled_kernels.first_max_column(torch.zeros(4, 16).as_subclass(Wrapped)) is None
    module = engine.module
    with pytest.raises(RuntimeError, match="counts sum to 5 rows, x has 4"):
        module.swiglu_forward(x, w, w, w, [2, 3], None)
    with pytest.raises(RuntimeError, match="a negative count"):
        module.swiglu_forward(x, w, w, w, [5, -1], None)
    with pytest.raises(RuntimeError, match="w2 must be a contiguous CPU float32 tensor of shape"):
        module.swiglu_forward(x, w, w, torch.zeros(2, 4, 8), [2, 2], None)
    # token order: a permutation of x's rows, covered by the counts, or an error before any row is read
    for tokens, message in [
        (torch.tensor([0, 1, 1, 3]), "not a permutation of 0..3 \\(row 2 names 1\\)"),
        (torch.tensor([0, 1, 2, 9]), "not a permutation of 0..3 \\(row 3 names 9\\)"),
        (torch.tensor([0, -1, 2, 3]), "not a permutation"),
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), "tokens must be a contiguous CPU int64 tensor of 4 rows"),
        (torch.tensor([0, 1, 2]), "tokens must be a contiguous CPU int64 tensor of 4 rows"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            module.swiglu_forward(x, w, w, w, [2, 2], tokens)
    with pytest.raises(RuntimeError, match="the counts must cover every row \\(3 of 4\\)"):
        module.swiglu_forward(x, w, w, w, [2, 1], torch.arange(4))
    y, a, b, d = module.swiglu_forward(x, w, w, w, [2, 2], None)
    grads = [torch.zeros(4, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 8)]
    with pytest.raises(RuntimeError, match="grad must be a contiguous CPU float32 tensor of shape"):
        module.swiglu_backward(torch.zeros(3, 8), x, w, w, w, [2, 2], a, b, d, [], [], [], *grads, False, None)
    with pytest.raises(RuntimeError, match="of every expert"):
        module.swiglu_backward(torch.zeros(4, 8), x, w, w, w, [2, 2], a[:1], b, d, [], [], [], *grads, False, None)
    with pytest.raises(RuntimeError, match="not a permutation"):
        module.swiglu_backward(
            torch.zeros(4, 8), x, w, w, w, [2, 2], a, b, d, [], [], [], *grads, False, torch.zeros(4).long()
        )


@pytest.mark.parametrize("threads", [1, 2])
def test_index_add_rows_is_bitwise_index_add(threads):
    """The MoE combine's row adds on one thread (`csrc/add_rows.cpp`): index_add_'s bits (repeated destinations added
    in row order, vector tails at D = 33), an out-of-range index refused with its row, other dtypes left to ATen."""
    if compiled_kernels.compiled_cpu_kernels() is None:
        pytest.skip(f"the CPU kernels are not available here: {compiled_kernels.unavailable_reason()}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, targets, width in ((1536, 768, 128), (100, 3, 33), (0, 4, 8)):
            g = torch.Generator().manual_seed(rows)
            out, src = torch.randn(targets, width, generator=g), torch.randn(rows, width, generator=g) * 100
            index = torch.randint(0, targets, (rows,), generator=g)
            expected = out.clone().index_add_(0, index, src)
            assert torch.equal(compiled_kernels.index_add_rows(out, index, src), expected)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="index 4 of row 1 is outside 4 rows"):
        compiled_kernels.index_add_rows(torch.zeros(4, 2), torch.tensor([0, 4]), torch.ones(2, 2))
    doubles = torch.zeros(3, 2, dtype=torch.float64)
    assert torch.equal(
        compiled_kernels.index_add_rows(doubles, torch.tensor([1, 1]), torch.ones(2, 2).double()),
        torch.tensor([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]], dtype=torch.float64),
    )


def test_the_kernel_cache_is_keyed_by_the_isa_level():
    """A build for one ATEN_CPU_CAPABILITY is never loaded under another: each level's flags (its ISA and the macros
    that select its Vectorized<float>) are part of the cached module's name."""
    names = {
        level: compiled_kernels._module_name(compiled_kernels.build_flags(level))
        for level in ("DEFAULT", "AVX2", "AVX512")
    }
    assert len(set(names.values())) == 3
    assert "-DCPU_CAPABILITY_AVX2" in compiled_kernels.build_flags("AVX2")
    # built for the level ATen dispatches to in this process (ATEN_CPU_CAPABILITY included), not the CPU's best
    own = torch.backends.cpu.get_cpu_capability()
    assert compiled_kernels._capability() == (own if own in names else "DEFAULT")


def test_the_kernel_cache_key_is_the_sources_content_not_their_place(tmp_path, monkeypatch):
    """A clone elsewhere (or a new session) finds the build of unchanged sources; an edited source is built anew."""
    flags = compiled_kernels.build_flags("DEFAULT")
    here = compiled_kernels._module_name(flags)
    copy = tmp_path / "elsewhere" / "csrc"
    copy.mkdir(parents=True)
    for path in compiled_kernels.CSRC.iterdir():
        if path.suffix in (".cpp", ".h"):
            (copy / path.name).write_text(path.read_text())
    monkeypatch.setattr(compiled_kernels, "CSRC", copy)
    assert compiled_kernels._module_name(flags) == here
    (copy / "add_rows.cpp").write_text((copy / "add_rows.cpp").read_text() + "\n// edited\n")
    assert compiled_kernels._module_name(flags) != here
