"""commit_step in Triton (kernels/step_commit.py): one program per request.

A program loads its row: the accepted path (accept_index[:m + 1]), the tokens and, for a tree,
the KV slots at prefix .. prefix + N - 1. Node j's place in path order is c when it is the path's
c-th node, else m + 1 + (how many off-path nodes come before it); the tokens, the order and the
slots are stored at those places (a permutation: every place is written once). The launcher
never reads tensor values on the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_kernel(
    acc_idx_ptr, acc_len_ptr, live_ptr, tokens_ptr, bonus_ptr, prefix_ptr, rows_ptr, r2t_ptr,
    out_tokens_ptr, out_accept_ptr, out_bonus_ptr, out_prefix_ptr, host_ptr, order_ptr,
    stride_acc, stride_tok, stride_r2t, stride_out_tok, stride_host, N, D,
    TREE: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    m = tl.where(tl.load(live_ptr + i) != 0, tl.load(acc_len_ptr + i).to(tl.int64), 0)
    tok = tl.load(tokens_ptr + i * stride_tok + cols, mask=valid, other=0)
    place = cols.to(tl.int64)  # a chain's nodes are in path order already
    prefix = tl.load(prefix_ptr + i).to(tl.int64)
    if TREE:
        on = (cols <= m) & (cols < D)
        path = tl.load(acc_idx_ptr + i * stride_acc + cols, mask=on, other=-1).to(tl.int64)
        hits = path[:, None] == cols[None, :]  # [path position c, node j]
        on_path = tl.max(hits.to(tl.int32), axis=0) > 0  # [node j]
        path_pos = tl.sum(tl.where(hits, cols[:, None], 0), axis=0).to(tl.int64)
        off = (valid & ~on_path).to(tl.int64)
        place = tl.where(on_path, path_pos, m + tl.cumsum(off, axis=0))
        row = r2t_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_r2t + prefix
        slots = tl.load(row + cols, mask=valid)
        tl.debug_barrier()  # every thread's slots loaded before any is overwritten
        tl.store(row + place, slots, mask=valid)  # a permutation of the loaded columns
    host = host_ptr + i * stride_host
    tl.store(out_tokens_ptr + i * stride_out_tok + place, tok.to(tl.int64), mask=valid)
    tl.store(host + 2 + place, tok.to(tl.int64), mask=valid)
    tl.store(host + 2 + N + place, cols.to(tl.int64), mask=valid)
    tl.store(order_ptr + i * N + place, cols.to(tl.int64), mask=valid)
    bonus = tl.load(bonus_ptr + i).to(tl.int64)
    tl.store(out_accept_ptr + i, m)
    tl.store(out_bonus_ptr + i, bonus)
    tl.store(out_prefix_ptr + i, prefix)
    tl.store(host, m)
    tl.store(host + 1, bonus)


def commit_step_triton(accept_index, accept_len, live, tokens, bonus, prefix, rows, req_to_token,
                       out, tree: bool) -> torch.Tensor:
    bs, n = tokens.shape
    order = torch.empty(bs, n, dtype=torch.int64, device=tokens.device)
    if bs == 0:
        return order
    if accept_index.stride(-1) != 1 or tokens.stride(-1) != 1 or out.tokens.stride(-1) != 1:
        raise ValueError("accept_index, tokens and out.tokens need unit stride along a row")
    live = live.view(torch.uint8) if live.dtype == torch.bool else live
    _commit_kernel[(bs,)](
        accept_index, accept_len, live, tokens, bonus, prefix, rows, req_to_token,
        out.tokens, out.accept_len, out.bonus, out.prefix, out.host_row, order,
        accept_index.stride(0), tokens.stride(0), req_to_token.stride(0), out.tokens.stride(0),
        out.host_row.stride(0), n, accept_index.shape[1],
        TREE=tree, BLOCK=triton.next_power_of_2(max(n, 2)), num_warps=1)
    return order
