"""Paged attention kernels in Triton: decode and verify (the extend kernel, prefill on top of a
cached prefix, is in triton_extend.py).

Both read K/V through `req_to_token`: key position `p` of request `i` lives in pool slot
`req_to_token[req_pool_indices[i], p]`. The new tokens' K/V are written to the pool before a
kernel runs, so the kernels only read the pool. Scores are computed in the exp2 domain (the scale
is pre-multiplied by log2(e)) with an online softmax and fp32 accumulation.

Only these modules and the backends import triton; `import specpcg` must work without it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.dispatch import pdl

LOG2_E = 1.4426950408889634


# NOTE (the split-K decode kernel below): split boundaries depend on nothing but key positions
# (not the batch, not the number of programs, not the mode), each split's partial result is
# stored on its own, and the merge reads them in position order: so a query's result is bitwise
# the same whatever it is batched with, and a verify node equals the decode query at its
# position. A key past a query's own length, read for a later node of the same program, scores
# -inf: it leaves the running max, sum and output exactly as they were, and a split with none of
# the query's keys stores lse = -inf and zeros, which the merge skips. A draft tree's node reads
# a row of its own (kernels.tree_rows) and runs with NODES = 1.
# Programs (c, kv head, p) cover every query head of one KV head (each key loaded once) for
# queries c * NODES .. c * NODES + NODES - 1 (one row: a chain's verify nodes, stacked in the
# dot's rows as (node, head); NODES = 1 is a decode), over the key splits p, p + NUM_PROGRAMS,
# ... of SPLIT_LEN keys at fixed positions. The last program of a (c, kv head) to finish merges
# its splits (`_merge_splits`).
@triton.jit
def _decode_split_kernel(
    q_ptr, k_buf_ptr, v_buf_ptr, mid_out_ptr, mid_lse_ptr, arrived_ptr, out_ptr,
    req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_out_tok, stride_out_head, stride_req_row,
    scale_log2,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr,
    NODES: tl.constexpr, NUM_PROGRAMS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    MAX_SPLITS: tl.constexpr, MERGE_UNROLL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Programs (c, kv head, p): the comment above says what each covers. PDL: dispatch.pdl."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    prog = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_H)  # BLOCK_H is NODES * GROUP_SIZE padded up for tl.dot
    mask_h = offs_r < NODES * GROUP_SIZE
    query = (prog * NODES + offs_r // GROUP_SIZE).to(tl.int64)  # [H]
    heads = kv_head * GROUP_SIZE + offs_r % GROUP_SIZE
    lens = tl.load(seq_lens_ptr + query, mask=mask_h, other=0)  # [H] each query's keys
    seq_len = tl.max(lens, 0)
    num_splits = tl.cdiv(seq_len, SPLIT_LEN)
    row_ptr = (req_to_token_ptr
               + tl.load(req_pool_indices_ptr + prog * NODES).to(tl.int64) * stride_req_row)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_offs = query[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [H, D]
    mid_rows = (query * NUM_HEADS + heads) * MAX_SPLITS  # [H]: split 0 of each row

    for split in range(tl.program_id(2), num_splits, NUM_PROGRAMS):
        split_start = split * SPLIT_LEN
        split_end = tl.minimum(split_start + SPLIT_LEN, seq_len)
        row_end = tl.minimum(split_start + SPLIT_LEN, lens)  # [H]
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_buf_ptr + slots[:, None] * stride_k_slot + kv_head * stride_k_head
                        + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(v_buf_ptr + slots[:, None] * stride_v_slot + kv_head * stride_v_head
                        + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
            s = tl.where(offs_n[None, :] < row_end[:, None], s, float("-inf"))  # [H, N]
            # A block of masked keys has max -inf: shift by 0 there, not by -inf (NaN).
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(s - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None],
                         input_precision=DOT_PRECISION)
            m_i = m_new
        # A split with no key reports lse = -inf: the merge skips it.
        has_keys = l_i > 0
        l_safe = tl.where(has_keys, l_i, 1.0)
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + mid_rows + split, lse, mask=mask_h)
        tl.store(mid_out_ptr + (mid_rows + split)[:, None] * HEAD_DIM + offs_d[None, :],
                 acc / l_safe[:, None], mask=mask_h[:, None] & mask_d[None, :])

    # NOTE: one kernel, not a split kernel and a merge kernel: the merge was a launch per layer
    # and step (36 of a batch-16 EAGLE3 step's 581 kernels on the H100, 67 of its 1,687 us).
    # The barrier orders every thread's stores before the counter's release; the last to
    # arrive (acquire) sees them all and sets the counter back to 0 for the next launch.
    tl.debug_barrier()
    counter = arrived_ptr + prog * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_PROGRAMS - 1:
        tl.store(counter, 0)
        _merge_splits(mid_out_ptr, mid_lse_ptr, mid_rows, num_splits, mask_h, offs_d, mask_d,
                      out_ptr + query * stride_out_tok + heads * stride_out_head,
                      HEAD_DIM, BLOCK_H, BLOCK_D, MERGE_UNROLL)


@triton.jit
def _merge_splits(mid_out_ptr, mid_lse_ptr, mid_rows, num_splits, mask_h, offs_d, mask_d,
                  out_rows_ptr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):
    """Merges each row's split results in split order (an online log-sum-exp merge), skipping
    empty splits, so the result depends only on the splits. Loads bypass L1 (".cg"): other
    programs wrote the splits, and an SM's L1 may hold the lines of an earlier launch.

    UNROLL splits a round: their loads go out together, not one L2 round trip a split. A
    split past the row's last reads as an empty one (lse -inf, zeros), which leaves the sums as
    they were, so the result is the plain loop's."""
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for first in range(0, num_splits, UNROLL):
        for j in tl.static_range(UNROLL):
            split = first + j
            # The split as a [H] tensor: the interpreter's loads take no scalar-made masks.
            there = mask_h & (tl.zeros([BLOCK_H], dtype=tl.int32) + split < num_splits)
            lse = tl.load(mid_lse_ptr + mid_rows + split, mask=there, other=float("-inf"),
                          cache_modifier=".cg")
            part = tl.load(mid_out_ptr + (mid_rows + split)[:, None] * HEAD_DIM
                           + offs_d[None, :], mask=there[:, None] & mask_d[None, :], other=0.0,
                           cache_modifier=".cg")
            seen = lse > float("-inf")
            m_new = tl.where(seen, tl.maximum(m, lse), m)
            # Where both are -inf (nothing seen yet, an empty split) the shift is 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp2(m - m_shift)
            w = tl.where(seen, tl.exp2(lse - m_shift), 0.0)
            acc = acc * scale[:, None] + w[:, None] * part
            total = total * scale + w
            m = m_new
    # seq_len 0 (a padded request) leaves no split: output zeros, not NaN.
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_rows_ptr[:, None] + offs_d[None, :],
             out.to(out_rows_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


def _padded_head_dim(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; non-power-of-two head dims are masked up to BLOCK_D.
    return max(16, triton.next_power_of_2(head_dim))


def _keys_a_block(head_dim: int, cpu: bool) -> int:
    """Keys a decode program loads at once. A function of the model alone, never of the batch:
    the blocks set the order of the softmax's sums, and a query keeps its bits in any batch."""
    # NOTE: 128 keys of 64 dims (the default model) are one split in one load, where 64 were
    # two dependent loads: 0.4-1.2 us less a call on an H200 (benchmarks/probe_decode_attn.py).
    # Keys of 128 dims stay at 64: in blocks of 128 a batch-16 decode at short contexts was
    # slower (11.6 -> 14.8 us).
    if cpu:
        return 32
    return 128 if head_dim <= 64 else 64


def _dot_precision(dtype: torch.dtype) -> str:
    # NOTE: fp32 must not silently drop to tf32 on GPU, or fp32 runs stop matching the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_shapes(q: torch.Tensor, k_buf: torch.Tensor, out: torch.Tensor) -> None:
    assert q.dim() == 3 and out.shape == q.shape, "q and out are [num_tokens, num_heads, head_dim]"
    assert k_buf.dim() == 3 and k_buf.shape[2] == q.shape[2], "pool buffers are [slots, Hkv, D]"
    assert q.shape[1] % k_buf.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_buf.stride(2) == 1 and out.stride(2) == 1


# Splits whose merge loads go out together (see _merge_splits), in programs of one query.
MERGE_UNROLL = 8


def _merge_rounds(block_h: int, max_splits: int) -> int:
    """Splits a round in the merge of a program of block_h query rows. A decode program (16
    rows) takes MERGE_UNROLL: a chain of the default model's layers on an H200 went from 17.6 to
    15.2 us a call at 4,096 keys and 10.7 to 9.8 at 2,048, batch 1, no slower at 256
    (benchmarks/probe_decode_attn.py). A verify program (8 nodes: 32 rows) keeps the plain
    loop: its splits are [32, 64] sums each, and 8 a round took 7.9 -> 9.1 us at 1,024 keys
    (4 a round: 8.7). The bits are the plain loop's either way."""
    return min(MERGE_UNROLL, max_splits) if block_h <= 16 else 1


def split_len_for(device: torch.device) -> int:
    """Keys per decode split (a multiple of the block size)."""
    return 32 if device.type == "cpu" else 128


def decode_attention(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens,
                     num_reqs: int, num_kv_splits: int, scale: float, arrived=None,
                     nodes_per_program: int = 1) -> None:
    """Split-K decode: row i of q is request i's only query; writes rows 0..num_reqs-1 of out.

    Each request's keys are cut into fixed splits of split_len_for(device) keys; num_kv_splits
    programs per (request, KV head) share them out (so batch 1 with a long context still fills
    the GPU), each split's result is kept, and the last program of each (request, KV head)
    merges them in order. The number of programs changes only the speed, never the result.

    arrived: int32 zeros, >= num_reqs * num_kv_heads, counting the programs done; each launch
    leaves them at zero again. Callers that replay graphs pass a buffer they keep
    (`arrival_counters`); without one, a new one is made (one more kernel: a memset).

    nodes_per_program: queries taken together by one program, which must read the same row
    (a chain verify's nodes, node j seeing the row up to itself): each key block is loaded once
    for all of them and their heads share the dot's rows. The results are bitwise those of a
    program a query (tests/test_batch_invariance.py, on the interpreter and compiled).
    """
    _check_shapes(q, k_buf, out)
    assert num_kv_splits >= 1
    if num_reqs % nodes_per_program:
        raise ValueError(f"nodes_per_program={nodes_per_program} does not divide "
                         f"num_reqs={num_reqs}")
    if num_reqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buf.shape[1]
    if arrived is None:
        arrived = arrival_counters(num_reqs, num_kv_heads, q.device)
    assert arrived.dtype == torch.int32 and arrived.numel() >= num_reqs * num_kv_heads
    group_size = num_heads // num_kv_heads
    block_d = _padded_head_dim(head_dim)
    block_h = max(16, triton.next_power_of_2(nodes_per_program * group_size))
    cpu = q.device.type == "cpu"
    split_len, block_n = split_len_for(q.device), _keys_a_block(head_dim, cpu)
    assert split_len % block_n == 0, "a split is whole blocks: its sums' order is the blocks'"
    max_splits = triton.cdiv(req_to_token.shape[1], split_len)  # a row's most keys
    mid_out = torch.empty(num_reqs, num_heads, max_splits, head_dim, dtype=torch.float32,
                          device=q.device)  # [bs, H, S, D] per-split normalised outputs
    mid_lse = torch.empty(num_reqs, num_heads, max_splits, dtype=torch.float32,
                          device=q.device)  # [bs, H, S] per-split log2-sum-exp2
    _decode_split_kernel[(num_reqs // nodes_per_program, num_kv_heads, num_kv_splits)](
        q, k_buf, v_buf, mid_out, mid_lse, arrived, out,
        req_to_token, req_pool_indices, seq_lens,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        scale * LOG2_E,
        HEAD_DIM=head_dim, GROUP_SIZE=group_size, NUM_HEADS=num_heads,
        NODES=nodes_per_program, NUM_PROGRAMS=num_kv_splits, SPLIT_LEN=split_len,
        MAX_SPLITS=max_splits, MERGE_UNROLL=_merge_rounds(block_h, max_splits),
        DOT_PRECISION=_dot_precision(q.dtype), BLOCK_H=block_h,
        BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=1 if cpu else 2, **pdl(q),
    )


def arrival_counters(num_queries: int, num_kv_heads: int, device) -> torch.Tensor:
    """The zeroed counters decode_attention needs for num_queries queries (see there)."""
    return torch.zeros(num_queries * num_kv_heads, dtype=torch.int32, device=device)


def pick_num_kv_splits(num_reqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Enough (request, kv head, split) programs to cover the SMs about twice, as a power of two.

    Depends only on the batch size, so a decode graph captured for a bucket stays valid.
    """
    wanted = math.ceil(2 * num_sms / max(1, num_reqs * num_kv_heads))
    return min(max_splits, triton.next_power_of_2(max(1, wanted)))
