"""Eager GEMMs at bucketed row counts (kernels/gemv.bucketed_rows): a draft's catch-up meets a
new row count nearly every time, and cuBLAS's first call at one costs milliseconds of host time.
Inside the context the rows are padded to a bucket and the padding dropped; outside nothing
changes."""

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv
from specpcg.models.layers import BucketedLinear, GatedMLP, Linear


@pytest.fixture
def gemm_rows(monkeypatch):
    """The row counts F.linear is called with from kernels/gemv.py, in order."""
    seen, real = [], F.linear

    def recorded(x, w, b=None):
        seen.append(x.shape[0])
        return real(x, w, b)
    monkeypatch.setattr(gemv.F, "linear", recorded)
    return seen


def test_a_bucket_holds_the_rows_within_half_again():
    buckets = set()
    for rows in range(1, 5000):
        b = gemv.row_bucket(rows)
        assert b >= rows and (rows < 16 or b <= rows * 3 // 2)
        buckets.add(b)
    # 16 * 2^k and 24 * 2^k: 18 row counts cover 1 to 4999, so each is met (and warmed) once.
    assert sorted(buckets)[:6] == [16, 24, 32, 48, 64, 96] and len(buckets) == 18


@pytest.mark.parametrize("rows", [9, 17, 100, 503])
def test_padded_gemms_give_the_unpadded_outputs(gemm_rows, rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 64), torch.randn(96, 64), torch.randn(96)
    plain, plain_mul = gemv.linear(x, w, b), gemv.linear_silu_mul(x, w)
    assert gemm_rows == [rows, rows]
    with gemv.bucketed_rows():
        padded, padded_mul = gemv.linear(x, w, b), gemv.linear_silu_mul(x, w)
    assert gemm_rows[2:] == [gemv.row_bucket(rows)] * 2
    assert padded.shape == plain.shape and padded_mul.shape == plain_mul.shape
    # The same rows: on CPU only the GEMM's blocking may round differently.
    torch.testing.assert_close(padded, plain, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(padded_mul, plain_mul, atol=1e-4, rtol=1e-5)


def test_only_inside_an_enabled_context_and_only_matrices(gemm_rows):
    x, w = torch.randn(100, 32), torch.randn(8, 32)
    with gemv.bucketed_rows(enabled=False):  # what a CPU catch-up asks for
        gemv.linear(x, w)
    with gemv.bucketed_rows():
        with gemv.bucketed_rows(enabled=False):  # nested: the outer one still pads
            gemv.linear(x, w)
        gemv.linear(x[:8], w)  # a few rows: the GEMV kernel's side, never padded
        gemv.linear(torch.randn(2, 50, 32), w)  # not a matrix
        gemv.linear(torch.randn(128, 32), w)  # already a bucket
    gemv.linear(x, w)  # after the context
    assert gemm_rows == [100, 128, 8, 2, 128, 100]


def test_the_model_layers_pad_inside_the_context(gemm_rows):
    """The target's Linear (an MLP's) and a head's BucketedLinear (EAGLE3's fc) both pad."""
    torch.manual_seed(1)
    mlp, fc = GatedMLP(32, 48), BucketedLinear(64, 32)
    x, h = torch.randn(40, 32), torch.randn(40, 64)
    plain = mlp(x), fc(h)
    assert isinstance(Linear(4, 4), BucketedLinear)
    gemm_rows.clear()
    with gemv.bucketed_rows():
        out = mlp(x), fc(h)
    assert gemm_rows == [48, 48, 48]  # gate_up, down, fc
    for a, b in zip(out, plain):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_warming_calls_each_shape_once_per_bucket(gemm_rows):
    a, b = torch.randn(96, 64), torch.randn(32, 96)
    gemv.warm_row_buckets([a, b, torch.randn(96, 64)], 100)  # the third repeats a's shape
    assert gemm_rows == [r for r in (16, 24, 32, 48, 64, 96, 128) for _ in (a, b)]
