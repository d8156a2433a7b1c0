"""A qkv projection of a few rows with the rotary embedding and the K/V cache write in its
epilogue (kernels/gemv.normed_qkv_rope): the RMSNorm before it, the matmul, the neox rotary
of q and k, and k and v copied to the caches at each token's slot, in one launch.

A batch-1 decode step of the default model otherwise runs a rotary-and-store kernel after
every qkv projection (30 a step, about 1.8 us each on an H200), and a batch-1 verify the same
after an RMSNorm and its 8-row matmul. At one row (`_gemv_rope_kernel`) program p computes
the two outputs a rotation pairs, n and n + D / 2 of one head (`_pair`), so it can rotate
them itself: the sums are the one-row kernel's (gemv_triton.one_row_sums), rounded to the
output dtype, then rotated in fp32 and rounded as kernels/rotary.py does. From 2 rows
(`_rows_rope_kernel`) a program takes 8 outputs of a head's first half and the 8 they pair
with as one 16-wide tensor-core tile (gemv_triton.rows_weights, rows_sums). v's pairs are
stored as they are.
Positions and slots are read after PDL's wait: the step's own kernels write them. The
launcher reads no tensor values on the host: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import pdl
from kernels.gemv_triton import ONE_ROW_BLOCK_K, one_row_sums, rows_sums, rows_weights


@triton.jit
def _pair(pid, HALF: tl.constexpr):
    """Program pid's two outputs: n and n + HALF of head pid // HALF."""
    first = (pid // HALF) * (2 * HALF) + pid % HALF
    return first + tl.arange(0, 2) * HALF


@triton.jit
def _rotate_pair(y, cos, sin):
    """[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (kernels/rotary.py's arithmetic)."""
    which = tl.arange(0, 2)
    x1 = tl.sum(tl.where(which == 0, y, 0.0), 0)
    x2 = tl.sum(tl.where(which == 1, y, 0.0), 0)
    return tl.where(which == 0, x1 * cos - x2 * sin, x2 * cos + x1 * sin)


@triton.jit
def _gemv_rope_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, eps, K, stride_wn,
                      pos_ptr, cos_sin_ptr, stride_cs, slot_ptr, k_cache_ptr, v_cache_ptr,
                      stride_cache, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      Q_OUT: tl.constexpr, KV_OUT: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program pid: outputs `_pair(pid)` of q (rotated), k (rotated, and to k_cache) or v (to
    v_cache). Outputs: q's Q_OUT, then k's and v's KV_OUT each."""
    pid = tl.program_id(0)
    offs_n = _pair(pid, HALF)
    dtype = y_ptr.dtype.element_ty
    y = one_row_sums(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, eps, offs_n,
                     offs_n < Q_OUT + 2 * KV_OUT, K, 0, stride_wn, HAS_BIAS, False, True,
                     HAS_RESIDUAL, BLOCK_K, PDL)
    y = y.to(dtype).to(tl.float32)
    first = pid // HALF * (2 * HALF)  # the head's first output
    if first < Q_OUT + KV_OUT:  # q or k: rotated at the token's position
        pos = tl.load(pos_ptr).to(tl.int64)
        table = cos_sin_ptr + pos * stride_cs + pid % HALF
        y = _rotate_pair(y, tl.load(table).to(tl.float32), tl.load(table + HALF).to(tl.float32))
    out = y.to(dtype)
    tl.store(y_ptr + offs_n, out)
    if first >= Q_OUT:
        slot = tl.load(slot_ptr).to(tl.int64)
        if first < Q_OUT + KV_OUT:
            tl.store(k_cache_ptr + slot * stride_cache + offs_n - Q_OUT,
                     out.to(k_cache_ptr.dtype.element_ty))
        else:
            tl.store(v_cache_ptr + slot * stride_cache + offs_n - Q_OUT - KV_OUT,
                     out.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _rows_rope_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, stride_rm,
                      stride_rom, eps, M, K, stride_xm, stride_wn, stride_ym, pos_ptr,
                      cos_sin_ptr, stride_cs, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cache,
                      HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, Q_OUT: tl.constexpr,
                      KV_OUT: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """2 or more rows, 16 a program (program (tile, b): rows 16 b to 16 b + 15): 8 outputs of
    a head's first half and the 8 they pair with in its second, as one 16-wide tensor-core
    tile in one step (gemv_triton.rows_weights, rows_sums), then each row rotated at its own
    position and, for k and v, stored at its own slot. A tile of each half (16 and 16: half as
    many programs, each holding twice the weights) ran a batch-1 verify 5% slower on an H200.
    The positions, the cos/sin rows and the slots are read right after the wait, beside the
    activations, not after the sums: their reads then wait on nothing but the dot.
    NOTE: the kernel after this one (the attention) may start once the sums are done, not at
    once as after the linear kernels: signalled at the start, the attention started early and
    a batch-1 verify ran 10-12% slower on an H200; after the sums, with the reads above, 1.5%
    faster than with neither (docs/PERFORMANCE.md, "A batch-1 verify's qkv launch and its
    inputs")."""
    tile = tl.program_id(0)
    first = tile // (HALF // 8) * (2 * HALF)  # the head's first output
    lane = tl.arange(0, 16)
    offs_n = first + tile % (HALF // 8) * 8 + lane % 8 + lane // 8 * HALF
    offs_m = tl.program_id(1) * 16 + tl.arange(0, 16)
    mask_m = offs_m < M
    cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    offs_1 = first + tile % (HALF // 8) * 8 + tl.arange(0, 8)  # the first half's outputs
    w, _, nw = rows_weights(cols, cols, nw_ptr, offs_n < Q_OUT + 2 * KV_OUT, 0, K, False, True,
                            BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # every program reads them (v's too, unused): a branch would put the reads after the dot
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    table = cos_sin_ptr + pos[:, None] * stride_cs + (offs_1 - first)[None, :]
    cos, sin = tl.load(table).to(tl.float32), tl.load(table + HALF).to(tl.float32)
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    acc, _ = rows_sums(x_ptr, w, w, nw, r_ptr, r_out_ptr, stride_xm, stride_rm, stride_rom, eps,
                       offs_m, mask_m, 0, K, K, tile == 0, False, True, HAS_RESIDUAL, 16,
                       BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    # [16 rows, (half, 8)] -> two [16, 8]: the outputs a rotation pairs, side by side
    x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), [16, 2, 8]),
                                 (0, 2, 1)))
    if first < Q_OUT + KV_OUT:  # q or k: each row rotated at its position
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    y1, y2 = x1.to(dtype), x2.to(dtype)
    out = y_ptr + offs_m[:, None] * stride_ym + offs_1[None, :]
    tl.store(out, y1, mask=mask_m[:, None])
    tl.store(out + HALF, y2, mask=mask_m[:, None])
    if first >= Q_OUT:
        if first < Q_OUT + KV_OUT:
            dst = k_cache_ptr + slot[:, None] * stride_cache + (offs_1 - Q_OUT)[None, :]
        else:
            dst = v_cache_ptr + slot[:, None] * stride_cache + (offs_1 - Q_OUT - KV_OUT)[None, :]
        tl.store(dst, y1.to(dst.dtype.element_ty), mask=mask_m[:, None])
        tl.store(dst + HALF, y2.to(dst.dtype.element_ty), mask=mask_m[:, None])


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor, norm: tuple, rope: tuple) -> torch.Tensor:
    """x [M, K] (K one step deep: <= ONE_ROW_BLOCK_K), weight [(Hq + 2 Hk) D, K] (q, k, v rows),
    out [M, that]. norm: (residual or None, norm weight [K], eps, residual_out or None), as
    gemv_triton.gemv's. rope: (positions [>= M], cos_sin [max_pos, D] fp32, slots [>= M],
    k_cache, v_cache ([slots, Hk, D], contiguous), Hq, Hk, D). Writes out (q and k rotated),
    the caches at the slots, and residual_out; returns out. From 2 rows D / 2 must be a
    multiple of 8 (8 of each half make a tensor-core tile)."""
    positions, cos_sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim = rope
    m, k = x.shape
    if k > ONE_ROW_BLOCK_K or head_dim % 2 or (m > 1 and head_dim // 2 % 8):
        raise ValueError(f"the rotary GEMV takes a depth <= {ONE_ROW_BLOCK_K} and an even head "
                         f"dim (from 2 rows, halves of 8s), got x {tuple(x.shape)}, head_dim "
                         f"{head_dim}")
    q_out, kv_out = num_q_heads * head_dim, num_kv_heads * head_dim
    if out.shape[-1] != q_out + 2 * kv_out or weight.shape[0] != out.shape[-1]:
        raise ValueError(f"a qkv weight of {q_out} + 2 x {kv_out} rows, got {tuple(weight.shape)}"
                         f" and out {tuple(out.shape)}")
    residual, norm_weight, eps, residual_out = norm
    has_residual = residual is not None
    residual, residual_out = (residual, residual_out) if has_residual else (x, x)
    head = (x, weight, bias if bias is not None else weight, out, residual, norm_weight,
            residual_out)
    rotary = (positions, cos_sin, cos_sin.stride(0), slots, k_cache, v_cache, k_cache.stride(0))
    flags = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=has_residual, Q_OUT=q_out,
                 KV_OUT=kv_out, HALF=head_dim // 2, num_warps=4, **pdl(x))
    if m == 1:
        _gemv_rope_kernel[(out.shape[-1] // 2,)](
            *head, eps, k, weight.stride(0), *rotary, BLOCK_K=ONE_ROW_BLOCK_K, num_stages=4,
            **flags)
        return out
    _rows_rope_kernel[(out.shape[-1] // 16, triton.cdiv(m, 16))](
        *head, residual.stride(0), residual_out.stride(0), eps, m, k, x.stride(0),
        weight.stride(0), out.stride(0), *rotary,
        BLOCK_K=max(16, triton.next_power_of_2(k)), num_stages=1, **flags)
    return out
