"""match_chain_rows in Triton (kernels/ngram_match.py): one program per request scans its row
backwards from the last token, BLOCK positions at a time, and stops once it has seen
max_candidates occurrences of that token. The launcher never reads tensor values on the host
(CUDA-graph safe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _match_chain_kernel(ids_ptr, rows_ptr, lens_ptr, out_ptr, stride_ids, width, length,
                        min_window, pad_token,
                        MAX_WINDOW: tl.constexpr, MAX_CANDIDATES: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_L: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = ids_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_ids
    last = tl.load(lens_ptr + i).to(tl.int64) - 1
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
    tl.store(out_ptr + i * length + cols, tl.where(valid, tokens, pad_token), mask=cols < length)


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
