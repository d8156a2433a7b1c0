"""A one-step tile of the few-row GEMV (kernels/gemv_triton._rows_kernel and
kernels/gemv_rope_triton._rows_rope_kernel): a program reads its whole depth in one step, its
weights before PDL's wait, and sums 16 rows on tensor cores.

A step whose depth is not a power of two runs as two pieces (`step_pieces`): the largest power
of two within it and the rest, padded to a power of two. The default model's 576-deep layers
then dot over 512 + 64 columns, not 1,024: each warp's chain of dependent tensor-core steps is
36 long, not 64, and the tiles take about half the shared memory. The pieces are summed in
order, so the dot's bits are those of one padded step; the RMSNorm's sum of squares adds the
two pieces' sums.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# SPECPCG_GEMV_PIECES=0: one padded power-of-two step, as before pieces (benchmarks compare)
PIECES = os.environ.get("SPECPCG_GEMV_PIECES", "1") != "0"


def step_pieces(depth: int) -> tuple:
    """(BLOCK_K, TAIL) of a one-step tile `depth` deep: BLOCK_K the largest power of two within
    it, TAIL the rest padded to a power of two (>= 16), or 0 where none is left or the two
    would cover no less than one padded step."""
    whole = max(16, triton.next_power_of_2(depth))
    if not PIECES or depth <= 16:
        return whole, 0
    head = whole if whole == depth else whole // 2
    tail = 0 if head >= depth else max(16, triton.next_power_of_2(depth - head))
    return (whole, 0) if head + tail >= whole else (head, tail)


@triton.jit
def _piece(cols, up_cols, nw_ptr, mask_n, k0, k_hi, UP: tl.constexpr, NORM: tl.constexpr,
           WIDTH: tl.constexpr):
    """The weight tile (and up's, UP; the norm's weight, NORM) of columns k0 .. k0 + WIDTH."""
    offs_k = k0 + tl.arange(0, WIDTH)
    mask_k = offs_k < k_hi
    mask = mask_k[:, None] & mask_n[None, :]
    w = tl.load(cols + offs_k[:, None], mask=mask, other=0.0)
    up = w
    if UP:
        up = tl.load(up_cols + offs_k[:, None], mask=mask, other=0.0)
    nw = w
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)[None, :]
    return w, up, nw


@triton.jit
def rows_weights(cols, up_cols, nw_ptr, mask_n, k_lo, k_hi, UP: tl.constexpr,
                 NORM: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr):
    """A one-step tile's reads that depend on no kernel before it, made before PDL's wait: the
    weight tiles (up's, UP) and the norm's weight (NORM), each the first where not asked for;
    with TAIL the same of the tail piece (else the head's again, unused)."""
    w, up, nw = _piece(cols, up_cols, nw_ptr, mask_n, k_lo, k_hi, UP, NORM, BLOCK_K)
    w2, up2, nw2 = w, up, nw
    if TAIL > 0:
        w2, up2, nw2 = _piece(cols, up_cols, nw_ptr, mask_n, k_lo + BLOCK_K, k_hi, UP, NORM,
                              TAIL)
    return w, up, nw, w2, up2, nw2


@triton.jit
def _with_residual(x, r_ptrs, r_out_ptrs, mask, WRITER, HAS_RESIDUAL: tl.constexpr):
    """x + residual rounded to x's dtype (stored to r_out by the WRITER program alone: the
    others still read the residual), or x."""
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if WRITER:
            tl.store(r_out_ptrs, x, mask=mask)
    return x


@triton.jit
def _scaled(x, inv_rms, nw):
    """kernels/norm.py's rounding: normalised, rounded, scaled by nw, rounded."""
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
    return (normed * nw.to(tl.float32)).to(x.dtype)


@triton.jit
def norm_rows(x, r_ptrs, r_out_ptrs, nw, mask, K, eps, WRITER, HAS_RESIDUAL: tl.constexpr,
              AXIS: tl.constexpr):
    """RMSNorm of the rows of x (along AXIS, whole in this step) with kernels/norm.py's
    rounding, the residual added first (`_with_residual`)."""
    x = _with_residual(x, r_ptrs, r_out_ptrs, mask, WRITER, HAS_RESIDUAL)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=AXIS, keep_dims=True) / K + eps)
    return _scaled(x, inv_rms, nw)


@triton.jit
def _load_rows(x_ptr, stride_xm, offs_m, mask_m, k0, k_hi, WIDTH: tl.constexpr):
    """Rows offs_m of x at columns k0 .. k0 + WIDTH (zeros past k_hi) and their mask."""
    offs_k = k0 + tl.arange(0, WIDTH)
    mask = mask_m[:, None] & (offs_k < k_hi)[None, :]
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask,
                   other=0.0), offs_k, mask


@triton.jit
def rows_sums(x_ptr, weights, r_ptr, r_out_ptr, stride_xm, stride_rm, stride_rom, eps, offs_m,
              mask_m, k_lo, k_hi, K, WRITER, UP: tl.constexpr, NORM: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              TAIL: tl.constexpr):
    """[16, BLOCK_N] fp32 sums of rows offs_m over depth k_lo..k_hi (one step) against the
    tiles of `rows_weights` (and, UP, up's: else acc_up is zeros), after the wait: the rows
    read and, NORM, RMSNorm'd (the WRITER program storing the residual)."""
    w, up, nw, w2, up2, nw2 = weights
    x, offs_k, x_mask = _load_rows(x_ptr, stride_xm, offs_m, mask_m, k_lo, k_hi, BLOCK_K)
    r_rows = r_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
    r_out_rows = r_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if TAIL == 0:
        if NORM:
            x = norm_rows(x, r_rows, r_out_rows, nw, x_mask, K, eps, WRITER, HAS_RESIDUAL, 1)
        acc = tl.dot(x, w, acc)
        if UP:
            acc_up = tl.dot(x, up, acc_up)
    else:
        x2, offs_2, mask_2 = _load_rows(x_ptr, stride_xm, offs_m, mask_m, k_lo + BLOCK_K, k_hi,
                                        TAIL)
        if NORM:
            x = _with_residual(x, r_rows, r_out_rows, x_mask, WRITER, HAS_RESIDUAL)
            x2 = _with_residual(x2, r_ptr + offs_m[:, None] * stride_rm + offs_2[None, :],
                                r_out_ptr + offs_m[:, None] * stride_rom + offs_2[None, :],
                                mask_2, WRITER, HAS_RESIDUAL)
            a, b = x.to(tl.float32), x2.to(tl.float32)
            squares = tl.sum(a * a, axis=1, keep_dims=True) + tl.sum(b * b, axis=1,
                                                                     keep_dims=True)
            inv_rms = tl.rsqrt(squares / K + eps)
            x, x2 = _scaled(x, inv_rms, nw), _scaled(x2, inv_rms, nw2)
        acc = tl.dot(x2, w2, tl.dot(x, w, acc))
        if UP:
            acc_up = tl.dot(x2, up2, tl.dot(x, up, acc_up))
    return acc, acc_up
