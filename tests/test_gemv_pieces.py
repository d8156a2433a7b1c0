"""A one-step tile whose depth is short of a power of two runs as two pieces
(kernels/gemv_step_triton.step_pieces): the default model's 576-deep layers dot over 512 + 64
columns, not 1,024. Against the torch twins and the one padded step, in the interpreter on CPU
(fp32); on CUDA in bf16 against the padded step's bits.
"""

import torch
from test_gemv import _close_fp32, needs_interpreter  # sets TRITON_INTERPRET first on CPU

import pytest  # noqa: E402

from kernels import gemv, gemv_step_triton, gemv_triton  # noqa: E402


def test_the_pieces_of_a_depth():
    pieces = gemv_step_triton.step_pieces
    assert pieces(576) == (512, 64)  # the default model's hidden size
    assert pieces(1344) == (1024, 512)
    assert pieces(40) == (32, 16)
    for whole in (16, 64, 512, 1024):  # a power of two is one step
        assert pieces(whole) == (whole, 0)
    for depth, whole in ((8, 16), (100, 128), (960, 1024), (1000, 1024)):  # no columns saved
        assert pieces(depth) == (whole, 0)


def _one_step_tiles(monkeypatch):
    """The tiling a GPU with PDL gives shallow weights (one padded step a program), on CPU."""
    monkeypatch.setattr(gemv_triton, "tiling", lambda n, k, rows, one_step=True: (
        32, max(16, 1 << (k - 1).bit_length()), 4, 1, 1))


def _launches(x, residual, nw, w, bias):
    """The plain, SiLU-and-mul and normed launches of the rows kernel."""
    return [gemv.linear(x, w, bias, use_triton=True),
            gemv.linear_silu_mul(x, w, use_triton=True),
            *gemv.normed_linear(x, residual, nw, 1e-6, w, bias, False, use_triton=True),
            gemv.normed_linear(x, None, nw, 1e-6, w, None, True, use_triton=True)[0]]


@needs_interpreter
@pytest.mark.parametrize("k", [40, 576])
@pytest.mark.parametrize("rows", [2, 8])
def test_two_pieces_match_the_twins_and_the_padded_step(monkeypatch, k, rows):
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, k), torch.randn(rows, k)
    w, bias, nw = torch.randn(64, k) / k ** 0.5, torch.randn(64), torch.rand(k) + 0.5
    _one_step_tiles(monkeypatch)
    got = _launches(x, residual, nw, w, bias)
    want = [torch.nn.functional.linear(x, w, bias), gemv.linear_silu_mul_torch(x, w),
            *gemv.normed_linear_torch(x, residual, nw, 1e-6, w, bias),
            gemv.normed_linear_torch(x, None, nw, 1e-6, w, None, True)[0]]
    for a, b in zip(got, want):
        _close_fp32(a, b)
    monkeypatch.setattr(gemv_step_triton, "PIECES", False)
    for a, b in zip(got, _launches(x, residual, nw, w, bias)):
        _close_fp32(a, b)
    assert torch.equal(got[3], residual + x)  # the residual written across both pieces


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_cuda_two_pieces_have_the_padded_steps_bits(monkeypatch, rows):
    """bf16 at the default model's shapes: the dot sums the same columns in the same order, so
    a plain or SiLU-and-mul launch keeps the padded step's bits; a normed one's sum of squares
    adds two partial sums, a rounding apart at most."""
    torch.manual_seed(0)
    x, residual = (torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16) for _ in "xr")
    w = (torch.randn(3072, 576, device="cuda") / 24).to(torch.bfloat16)
    nw = (torch.rand(576, device="cuda") + 0.5).to(torch.bfloat16)
    got = _launches(x, residual, nw, w, None)
    monkeypatch.setattr(gemv_step_triton, "PIECES", False)
    padded = _launches(x, residual, nw, w, None)
    assert torch.equal(got[0], padded[0]) and torch.equal(got[1], padded[1])
    assert torch.equal(got[3], padded[3])
    for a, b in ((got[2], padded[2]), (got[4], padded[4])):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
