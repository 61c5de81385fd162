"""The ISA-dependent tests (`-m isa_dependent`, tests/support/isa_dependent.py) once more at every ISA level
this CPU can run below its own: ATen and moetron's C++ kernels (built per level, their cache keyed by it) dispatch to
that level's vector code, whose last bits differ. The suite's own run covers the CPU's level; these cover the rest,
so a tolerance or a bitwise claim that holds on one kind of x86 machine only fails on whichever machine runs the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from isa_dependent import ISA_DEPENDENT_FILES

REPO = Path(__file__).resolve().parents[2]
LEVELS = ("DEFAULT", "AVX2", "AVX512")  # ATen's CPU capabilities on x86 (DEFAULT: no explicit vector ISA)
TIMEOUT_S = 1200  # two kernel builds (~1 min each) and ~10 s of tests, on a loaded 2-core machine


def _capability_under(level: str) -> str:
    """What ATen dispatches to in a process started with ATEN_CPU_CAPABILITY=level (a level this CPU lacks falls
    back to the CPU's own)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level.lower()}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("level", LEVELS)
def test_the_isa_dependent_tests_pass_at(level):
    if level == torch.backends.cpu.get_cpu_capability():
        pytest.skip(f"{level} is this process's own level: the suite's run of these tests covers it")
    if _capability_under(level).strip() != level:
        pytest.skip(f"this CPU cannot run ATen's {level} code")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level.lower()}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "isa_dependent"]
    command += ISA_DEPENDENT_FILES
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-30:])
    assert run.returncode == 0, f"ATEN_CPU_CAPABILITY={level.lower()}: the ISA-dependent tests failed:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
