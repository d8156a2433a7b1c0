"""Neox-layout rotary embedding in Triton, in place, q and k of one token in one program.

For each head, the first half x1 and the second half x2 of the head's vector become
`x1 * cos - x2 * sin` and `x2 * cos + x1 * sin` (`specpcg.models.layers._rotate`), computed in
fp32 and rounded to q's dtype. cos and sin come from the table `RotaryEmbedding` builds:
`cos_sin[pos] = cat([cos, sin])`, head_dim / 2 each, fp32.

The launcher reads no tensor values on the host: capturable in a CUDA graph once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import pdl


@triton.jit
def _rotate_heads(row_ptr, cos, sin, offs_half, mask_half,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates NUM_HEADS packed heads starting at row_ptr; cos, sin: [1, BLOCK_HALF] fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & mask_half[None, :]
    x1_ptrs = row_ptr + offs_h[:, None] * HEAD_DIM + offs_half[None, :]  # [BLOCK_H, BLOCK_HALF]
    x2_ptrs = x1_ptrs + HEAD_DIM // 2
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
    # Both halves are loaded before either is stored: the rotation mixes them.
    tl.store(x1_ptrs, (x1 * cos - x2 * sin).to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(x2_ptrs, (x2 * cos + x1 * sin).to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_token(tok, positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
                  stride_q_tok, stride_k_tok, stride_cos_sin_pos,
                  NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Every q head and every k head of token `tok`, rotated in place."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HEAD_DIM // 2  # BLOCK_HALF is HEAD_DIM / 2 padded to a power of two
    table_row = cos_sin_ptr + pos * stride_cos_sin_pos
    cos = tl.load(table_row + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table_row + HEAD_DIM // 2 + offs_half, mask=mask_half,
                  other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + tok * stride_q_tok, cos, sin, offs_half, mask_half,
                  NUM_Q_HEADS, HEAD_DIM, BLOCK_HQ)
    _rotate_heads(k_ptr + tok * stride_k_tok, cos, sin, offs_half, mask_half,
                  NUM_K_HEADS, HEAD_DIM, BLOCK_HK)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_q_tok, stride_k_tok, stride_cos_sin_pos,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program: every q head and every k head of token `tok`."""
    _rotate_token(tl.program_id(0).to(tl.int64), positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
                  stride_q_tok, stride_k_tok, stride_cos_sin_pos, NUM_Q_HEADS, NUM_K_HEADS,
                  HEAD_DIM, BLOCK_HQ, BLOCK_HK, BLOCK_HALF)


def _launch_options(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> dict:
    """The constexprs and warps of a rotary launch over q and k's heads."""
    num_q_heads = q.shape[1:].numel() // head_dim
    num_k_heads = k.shape[1:].numel() // head_dim
    return dict(NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
                BLOCK_HQ=triton.next_power_of_2(num_q_heads),
                BLOCK_HK=triton.next_power_of_2(num_k_heads),
                BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
                num_warps=4 if num_q_heads * head_dim <= 4096 else 8)


def rotary_embedding_triton_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """positions: [T]; q: [T, Hq * D] (or [T, Hq, D]) and k: [T, Hk * D], heads packed inside a
    token (any token stride); cos_sin_cache: [max_pos, D]. Rotates q and k in place."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        **_launch_options(q, k, head_dim))


@triton.jit
def _rotary_store_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    stride_q_tok, stride_k_tok, stride_v_tok, stride_cos_sin_pos, stride_cache_slot,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_KV: tl.constexpr, PDL: tl.constexpr,
):
    """One program: token `tok`'s q and k heads rotated in place, then its k and v rows copied
    into the caches at its slot (k read back after the rotation: the same program wrote it).
    PDL: kernels/dispatch.pdl."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tok = tl.program_id(0).to(tl.int64)
    _rotate_token(tok, positions_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_q_tok, stride_k_tok,
                  stride_cos_sin_pos, NUM_Q_HEADS, NUM_K_HEADS, HEAD_DIM, BLOCK_HQ, BLOCK_HK,
                  BLOCK_HALF)
    tl.debug_barrier()  # the rotated k is in memory before any thread reads it back below
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK_KV)  # the token's k (and v) row, padded to a power of two
    mask = offs < NUM_K_HEADS * HEAD_DIM
    dst = slot * stride_cache_slot + offs
    k = tl.load(k_ptr + tok * stride_k_tok + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + offs, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_store_triton_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """rotary_embedding_triton_ on q and k, and k, v written to k_cache[slots], v_cache[slots]
    ([num_slots, Hk, D], contiguous), in one launch. v: [T, Hk * D], heads packed."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    _rotary_store_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, slots, k_cache, v_cache,
        q.stride(0), k.stride(0), v.stride(0), cos_sin_cache.stride(0), k_cache.stride(0),
        BLOCK_KV=triton.next_power_of_2(k.shape[1:].numel()), **_launch_options(q, k, head_dim),
        **pdl(q))
