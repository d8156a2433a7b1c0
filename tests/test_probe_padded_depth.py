"""benchmarks/probe_padded_depth.py: its chain of launches is the model's linear layers in turn
(run in the Triton interpreter on CPU; the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest
import torch
from test_gemv import needs_interpreter  # sets TRITON_INTERPRET first on CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_padded_depth  # noqa: E402

from kernels import gemv  # noqa: E402


@needs_interpreter
@pytest.mark.parametrize("normed", [False, True])
def test_the_chain_is_each_launch_on_the_one_before(normed):
    torch.manual_seed(0)
    depth, rows = 48, 3
    weights = [torch.randn(depth, depth) * depth ** -0.5 for _ in range(3)]
    x, residual, gain = torch.randn(rows, depth), torch.randn(rows, depth), torch.rand(depth) + 0.5
    bufs = (torch.empty(rows, depth), torch.empty(rows, depth))
    norm = (residual, gain, torch.empty(rows, depth)) if normed else None
    got = probe_padded_depth.chain(weights, x, bufs, norm)
    want = x
    for w in weights:
        want = (gemv.normed_linear_torch(want, residual, gain, 1e-5, w)[0] if normed
                else gemv.linear_torch(want, w))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if normed:  # the launch writes x + residual of its rows (the last call's here)
        torch.testing.assert_close(norm[2], bufs[1] + residual)
