"""match_chain_rows and append_match_chain_rows in Triton (kernels/ngram_match.py): one program
per request scans its row backwards from the last token, BLOCK positions at a time, and stops
once it has seen max_candidates occurrences of that token; the second first writes the
request's last accepted path into its row. The launcher never reads tensor values on the host
(CUDA-graph safe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _match_row(row, last, out, width, length, min_window, pad_token,
               MAX_WINDOW: tl.constexpr, MAX_CANDIDATES: tl.constexpr,
               BLOCK: tl.constexpr, BLOCK_L: tl.constexpr):
    """One request: the drafts after the best earlier match of its row's context, whose last
    token is at `last`, stored at out[0 .. length - 1]."""
    last_tok = tl.load(row + tl.maximum(last, 0))
    offs = tl.arange(0, BLOCK)
    best = tl.full([], -1, tl.int64)  # match * (width + 1) + position, as the twin scores
    seen = tl.full([], 0, tl.int32)  # occurrences met so far, the most recent first
    end = tl.minimum(last, width)  # positions end - 1, end - 2, ... 0 are earlier ones
    while (end > 0) & (seen < MAX_CANDIDATES):
        pos = end - 1 - offs  # descending: the most recent first
        inside = pos >= 0
        occurs = inside & (tl.load(row + pos, mask=inside, other=-1) == last_tok)
        rank = seen + tl.cumsum(occurs.to(tl.int32), 0) - 1
        alive = occurs & (rank < MAX_CANDIDATES)
        picked = alive
        match = tl.full([BLOCK], 1, tl.int64)  # offset 0 matches by construction
        for back in tl.static_range(1, MAX_WINDOW):
            at = pos - back
            query = tl.load(row + tl.maximum(last - back, 0))
            alive = alive & (at >= 0)
            alive = alive & (tl.load(row + at, mask=alive, other=-1) == query)
            match += alive.to(tl.int64)
        score = tl.where(picked, match * (width + 1) + pos, -1)
        best = tl.maximum(best, tl.max(score, 0))
        seen += tl.sum(occurs.to(tl.int32), 0)
        end -= BLOCK
    cols = tl.arange(0, BLOCK_L)
    # As a block: the interpreter makes a loop-carried scalar's comparisons integers, which
    # a mask must not be.
    best = best + tl.zeros([BLOCK_L], tl.int64)
    found = (best >= 0) & (best // (width + 1) >= min_window)
    at = tl.where(found, best % (width + 1), 0) + 1 + cols
    valid = found & (at <= last) & (cols < length)
    tokens = tl.load(row + tl.minimum(at, width - 1), mask=valid, other=0).to(tl.int64)
    tl.store(out + cols, tl.where(valid, tokens, pad_token), mask=cols < length)


@triton.jit
def _match_chain_kernel(ids_ptr, rows_ptr, lens_ptr, out_ptr, stride_ids, width, length,
                        min_window, pad_token,
                        MAX_WINDOW: tl.constexpr, MAX_CANDIDATES: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_L: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = ids_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_ids
    last = tl.load(lens_ptr + i).to(tl.int64) - 1
    _match_row(row, last, out_ptr + i * length, width, length, min_window, pad_token,
               MAX_WINDOW, MAX_CANDIDATES, BLOCK, BLOCK_L)


@triton.jit
def _append_match_chain_kernel(ids_ptr, rows_ptr, nodes_ptr, accept_ptr, bonus_ptr, prefix_ptr,
                               out_ptr, stride_ids, stride_nodes, width, length, min_window,
                               pad_token, NODES: tl.constexpr, MAX_WINDOW: tl.constexpr,
                               MAX_CANDIDATES: tl.constexpr, BLOCK: tl.constexpr,
                               BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr):
    """append_path, then _match_row over the row it wrote; out row i: the bonus, the drafts."""
    i = tl.program_id(0).to(tl.int64)
    row = ids_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_ids
    m = tl.load(accept_ptr + i).to(tl.int64)
    bonus = tl.load(bonus_ptr + i)
    prefix = tl.load(prefix_ptr + i).to(tl.int64)
    cols = tl.arange(0, BLOCK_P)
    drafts = tl.load(nodes_ptr + i * stride_nodes + 1 + cols, mask=cols + 1 < NODES, other=0)
    path = tl.where(cols == m, bonus, drafts)
    pos = prefix + 1 + cols
    pos = tl.where((cols <= m) & (pos < width), pos, width)
    tl.store(row + pos, path.to(ids_ptr.dtype.element_ty), mask=cols < NODES)
    # The match reads what other threads of this program just wrote.
    tl.debug_barrier()
    tl.store(out_ptr + i * (length + 1), bonus.to(tl.int64))
    _match_row(row, prefix + m + 1, out_ptr + i * (length + 1) + 1, width, length, min_window,
               pad_token, MAX_WINDOW, MAX_CANDIDATES, BLOCK, BLOCK_L)


def match_chain_rows_triton(ids, rows, width: int, lens, length: int, min_window: int,
                            max_window: int, max_candidates: int, pad_token: int):
    bs = rows.shape[0]
    out = torch.empty(bs, length, dtype=torch.int64, device=ids.device)
    if bs == 0 or length == 0:
        return out
    cpu = ids.device.type == "cpu"
    _match_chain_kernel[(bs,)](
        ids, rows, lens, out, ids.stride(0), width, length, min_window, pad_token,
        MAX_WINDOW=max_window, MAX_CANDIDATES=max_candidates,
        BLOCK=64 if cpu else 512, BLOCK_L=triton.next_power_of_2(length), num_warps=4)
    return out


def append_match_chain_rows_triton(ids, rows, width: int, nodes, accept_len, bonus, prefix,
                                   length: int, min_window: int, max_window: int,
                                   max_candidates: int, pad_token: int):
    bs, num_nodes = nodes.shape
    out = torch.empty(bs, length + 1, dtype=torch.int64, device=ids.device)
    if bs == 0:
        return out
    cpu = ids.device.type == "cpu"
    _append_match_chain_kernel[(bs,)](
        ids, rows, nodes, accept_len, bonus, prefix, out, ids.stride(0), nodes.stride(0),
        width, length, min_window, pad_token, NODES=num_nodes, MAX_WINDOW=max_window,
        MAX_CANDIDATES=max_candidates, BLOCK=64 if cpu else 512,
        BLOCK_L=triton.next_power_of_2(max(length, 1)),
        BLOCK_P=triton.next_power_of_2(num_nodes), num_warps=4)
    return out
