"""The paged extend kernel in Triton: prefill on top of a cached prefix (causal), through
`req_to_token` as the decode kernel reads it (triton_kernels.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpcg.attention.triton_kernels import (LOG2_E, _check_shapes, _dot_precision,
                                              _padded_head_dim)


@triton.jit
def _extend_attn_kernel(
    q_ptr, k_buf_ptr, v_buf_ptr, out_ptr,
    req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr, extend_lens_ptr, q_starts_ptr,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_out_tok, stride_out_head, stride_req_row,
    scale_log2,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M queries of one request and one query head, over that request's keys.

    NOTE: query blocks sit at fixed positions (multiples of BLOCK_M), as key blocks do: a query
    is computed in the same row of the same block, over the same key blocks, however its prompt
    was cut into chunks, so chunked prefill gives bitwise the same attention as a whole one.
    Key blocks that every query of the block sees skip the causal mask: where it keeps every
    score the result is the same bits, and only the blocks on the diagonal pay for it."""
    req = tl.program_id(0)
    # The last query blocks see the most keys: launched first, they do not trail the grid.
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    head = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - extend_len
    block_pos = prefix_len // BLOCK_M * BLOCK_M + q_block * BLOCK_M  # its first row's position
    # Requests shorter than the longest one have no work in their trailing query blocks.
    if block_pos >= seq_len:
        return
    q_start = tl.load(q_starts_ptr + req).to(tl.int64)
    row_ptr = req_to_token_ptr + tl.load(req_pool_indices_ptr + req).to(tl.int64) * stride_req_row
    k_ptr = k_buf_ptr + (head // GROUP_SIZE) * stride_k_head
    v_ptr = v_buf_ptr + (head // GROUP_SIZE) * stride_v_head

    offs_m = block_pos - prefix_len + tl.arange(0, BLOCK_M)  # query index within the extend
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (offs_m >= 0) & (offs_m < extend_len)
    mask_d = offs_d < HEAD_DIM  # BLOCK_D is HEAD_DIM padded to a power of two
    q_offs = (q_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]

    # Query j sits at position prefix_len + j and sees keys 0..prefix_len + j (causal): keys up
    # to block_pos are seen by every row (rows before the extend are never stored).
    q_pos = prefix_len + offs_m
    kv_end = tl.minimum(seq_len, block_pos + BLOCK_M)
    seen_by_all = (block_pos + 1) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, seen_by_all, BLOCK_N):
        acc, m_i, l_i = _extend_keys(q, acc, m_i, l_i, start_n, kv_end, q_pos, row_ptr, k_ptr,
                                     v_ptr, stride_k_slot, stride_v_slot, offs_d, mask_d,
                                     scale_log2, DOT_PRECISION, BLOCK_N, False)
    for start_n in range(seen_by_all, kv_end, BLOCK_N):
        acc, m_i, l_i = _extend_keys(q, acc, m_i, l_i, start_n, kv_end, q_pos, row_ptr, k_ptr,
                                     v_ptr, stride_k_slot, stride_v_slot, offs_d, mask_d,
                                     scale_log2, DOT_PRECISION, BLOCK_N, True)

    out = acc / l_i[:, None]
    out_offs = ((q_start + offs_m)[:, None] * stride_out_tok + head * stride_out_head
                + offs_d[None, :])
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _extend_keys(q, acc, m_i, l_i, start_n, kv_end, q_pos, row_ptr, k_ptr, v_ptr,
                 stride_k_slot, stride_v_slot, offs_d, mask_d, scale_log2,
                 DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The online softmax over keys start_n .. start_n + BLOCK_N - 1; CAUSAL masks the keys
    past each query's position and past kv_end (else every one is seen)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if CAUSAL:
        mask_n = offs_n < kv_end
        # Masked positions read slot 0 (the sink), which is always a valid address.
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        slots = tl.load(row_ptr + offs_n).to(tl.int64)
        kv_mask = mask_d[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_k_slot + offs_d[None, :], mask=kv_mask,
                other=0.0)  # [N, D]
    v = tl.load(v_ptr + slots[:, None] * stride_v_slot + offs_d[None, :], mask=kv_mask,
                other=0.0)  # [N, D]
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    if CAUSAL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))  # [M, N]
    # Key 0 is visible to every row, so m_new is finite from the first block on.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def extend_config(head_dim: int, device: torch.device) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the extend kernel: a function of the model
    and the device alone, never of the batch (query and key blocks set a row's sums)."""
    if device.type == "cpu":  # small blocks keep the interpreter's numpy work small
        return 16, 16, 4, 1
    # NOTE: on an H200 (benchmarks/probe_extend_attn.py) 64 x 64 blocks suit 64-dim heads
    # (128-key blocks were faster for one prompt, slower for 8), and 128 x 64 in 8 warps the
    # 128-dim heads: 20 / 110 / 155 us a call at 1 x 512, 8 x 512 and 1 x 2048 tokens, against
    # 28 / 142 / 250 in the 64 x 32 blocks before.
    return (64, 64, 4, 2) if _padded_head_dim(head_dim) <= 64 else (128, 64, 8, 2)


def extend_attention(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, extend_lens,
                     q_starts, max_extend_len: int, num_reqs: int, scale: float,
                     config: tuple | None = None) -> None:
    """Writes attention of each request's new queries over its whole KV row into `out`.

    q, out: [num_tokens, num_heads, head_dim]; rows past sum(extend_lens) are not touched.
    req_pool_indices, seq_lens, extend_lens, q_starts: int32 [>= num_reqs] on q's device.
    config: extend_config's tuple, to try others (benchmarks/probe_extend_attn.py).
    """
    _check_shapes(q, k_buf, out)
    if num_reqs == 0 or max_extend_len == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_m, block_n, num_warps, num_stages = config or extend_config(head_dim, q.device)
    # One more query block than the longest extend needs: blocks start at multiples of block_m,
    # so an extend that starts mid-block spans one more.
    grid = (num_reqs, triton.cdiv(max_extend_len, block_m) + 1, num_heads)
    _extend_attn_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, extend_lens, q_starts,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        scale * LOG2_E,
        HEAD_DIM=head_dim, GROUP_SIZE=num_heads // k_buf.shape[1],
        DOT_PRECISION=_dot_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_padded_head_dim(head_dim),
        num_warps=num_warps, num_stages=num_stages,
    )
