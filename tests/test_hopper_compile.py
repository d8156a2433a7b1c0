"""Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one
(tests/hopper_compile.py, in a process of its own with the interpreter off): the interpreter
checks what a kernel computes, this that Triton's compiler takes it, ptxas included."""

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton")


def _run(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "tests.hopper_compile", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_the_greedy_pick_and_the_ring_write_compile_for_hopper():
    """Every variant the engine launches: the pick with no ring, with a ring of three sources
    over 24 chunks and of one over a single chunk, a tree's top-k with log-probabilities, and
    the ring's own write."""
    out = _run()
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    names = Counter(line["kernel"].rsplit(".", 1)[1] for line in lines)
    assert names == {"_chunk_kernel": 4, "_merge_kernel": 2, "_write_ring_kernel": 1}, names
    assert all(line["cubin"] and line["ptx_bytes"] > 0 for line in lines)
    chunks = [line["constexprs"] for line in lines if line["kernel"].endswith("_chunk_kernel")]
    assert sorted((c["SOURCES"], c["FINAL"], c["LOG_SOFTMAX"]) for c in chunks) == [
        (0, False, False), (0, False, True), (1, True, False), (3, False, False)]


def test_a_kernel_the_compiler_refuses_fails_the_run():
    out = _run("--case", "refused")
    assert out.returncode != 0 and "arange's range must be a power of 2" in out.stderr
