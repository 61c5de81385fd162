"""Behaviours that need a process of their own: what a fresh interpreter imports, a child's own peak memory, and a
preprocess run stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_helpers import CORPUS, make_tiny_tokenizer, write_jsonl
from test_data_faults import one_error_line, preprocess_argv


@pytest.fixture
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_training_does_not_import_the_eval_package():
    code = (
        "import sys, moetron.train.trainer, moetron.train.executor, moetron.train.pipeline_executor;"
        "print(sorted(m for m in sys.modules if m.startswith('moetron.eval')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's /proc")
def test_a_child_reports_its_own_peak_not_its_launchers():
    """Linux copies `ru_maxrss` into a child at fork and keeps it until the child exceeds it, so a small run started
    from a large process (a test runner late in the suite) reported its launcher's peak; VmHWM starts afresh at exec."""
    launcher = bytearray(400 * 2**20)
    launcher[::4096] = b"\1" * len(launcher[::4096])  # touch every page: 400 MiB resident here
    code = "import resource; from moetron.process_memory import peak_rss_bytes; "
    code += "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_rss_bytes())"
    inherited, own = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())  # fmt: skip
    assert inherited >= len(launcher) > 4 * own  # the child's ru_maxrss is the launcher's; its own peak is small
    del launcher


def test_sigterm_cleans_up_and_exits_non_zero_with_one_line(tmp_path, tok_dir):
    source = write_jsonl(tmp_path / "in.jsonl", [" ".join(CORPUS) * 20] * 20000)
    argv = [sys.executable, "-m", "moetron", *preprocess_argv(tok_dir, [source], tmp_path / "out")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out_text_document.bin.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until it is writing
    assert proc.poll() is None, "preprocess finished before it could be interrupted; make the input larger"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    line = one_error_line(err)
    assert "stopped by SIGTERM" in line and "nothing was written" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
