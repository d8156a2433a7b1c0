"""A one-row qkv projection with the rotary embedding and the K/V cache write in its epilogue
(kernels/gemv.normed_qkv_rope): the RMSNorm before it, the matmul, the neox rotary of q and
k, and k and v copied to the caches at the token's slot, in one launch.

A batch-1 decode step of the default model otherwise runs a rotary-and-store kernel after
every qkv projection (30 a step, about 1.7 us each on an H200). Here program p computes the
two outputs a rotation pairs, n and n + D / 2 of one head (`_pair`), so it can rotate them
itself: the sums are the one-row kernel's (gemv_triton.one_row_sums), rounded to the output
dtype, then rotated in fp32 and rounded as kernels/rotary.py does. v's pairs are stored as
they are. The position and the slot are read after PDL's wait: the step's own kernels write
them. The launcher reads no tensor values on the host: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import pdl
from kernels.gemv_triton import ONE_ROW_BLOCK_K, one_row_sums


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


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor, norm: tuple, rope: tuple) -> torch.Tensor:
    """x [1, K] (K <= ONE_ROW_BLOCK_K), weight [(Hq + 2 Hk) D, K] (q, k, v rows), out [1, that].
    norm: (residual or None, norm weight [K], eps, residual_out or None), as gemv_triton.gemv's.
    rope: (positions [1], cos_sin [max_pos, D] fp32, slots [1], k_cache, v_cache ([slots, Hk,
    D], contiguous), Hq, Hk, D). Writes out (q and k rotated), the caches at the slot, and
    residual_out; returns out."""
    positions, cos_sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim = rope
    k = x.shape[1]
    if x.shape[0] != 1 or k > ONE_ROW_BLOCK_K or head_dim % 2:
        raise ValueError(f"the rotary GEMV takes one row of depth <= {ONE_ROW_BLOCK_K} and an "
                         f"even head dim, got x {tuple(x.shape)}, head_dim {head_dim}")
    q_out, kv_out = num_q_heads * head_dim, num_kv_heads * head_dim
    if out.shape[-1] != q_out + 2 * kv_out or weight.shape[0] != out.shape[-1]:
        raise ValueError(f"a qkv weight of {q_out} + 2 x {kv_out} rows, got {tuple(weight.shape)}"
                         f" and out {tuple(out.shape)}")
    residual, norm_weight, eps, residual_out = norm
    has_residual = residual is not None
    residual, residual_out = (residual, residual_out) if has_residual else (x, x)
    _gemv_rope_kernel[(out.shape[-1] // 2,)](
        x, weight, bias if bias is not None else weight, out, residual, norm_weight,
        residual_out, eps, k, weight.stride(0), positions, cos_sin, cos_sin.stride(0), slots,
        k_cache, v_cache, k_cache.stride(0), HAS_BIAS=bias is not None,
        HAS_RESIDUAL=has_residual, Q_OUT=q_out, KV_OUT=kv_out, HALF=head_dim // 2,
        BLOCK_K=ONE_ROW_BLOCK_K, num_warps=4, num_stages=4, **pdl(x))
    return out
