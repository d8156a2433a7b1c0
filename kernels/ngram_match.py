"""NGRAM's chain match on the device: for each request, the continuation after the earlier
occurrence of its last token whose match with the context's suffix is longest (at most
max_window tokens; the most recent on a tie), among the max_candidates most recent
occurrences, if that match has at least min_window tokens (drafts/ngram.py has the rule, its
host index the reference).

In torch (the twin) that is about sixty small kernels and a top-k over the history's whole
width: most of the 82 kernels and 207 busy us (of 1,275) that an NGRAM (7, 1, 8) step at batch
16 ran before its verify on the H100 (benchmarks/results/step_ngram_bs16_7f5f586_h100.txt), a
79 us top-k among them. The Triton kernel
(ngram_match_triton.py) is one program per request, scanning its row backwards from the last
token until it has seen max_candidates occurrences.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module
from .step_commit import path_tokens


def scored_matches(h: torch.Tensor, last: torch.Tensor, max_window: int,
                   max_candidates: int) -> torch.Tensor:
    """h: [bs, C] int64 tokens, last: [bs, 1] the last token's position. Returns [bs, k]: each
    of the k most recent earlier occurrences of the last token scored match * (C + 1) + its
    position (match: how many tokens ending there equal the context's suffix, <= max_window),
    -1 for none. Three passes over [bs, C], the rest over [bs, k, max_window]."""
    width, dev = h.shape[1], h.device
    pos = torch.arange(width, device=dev)
    occurs = (h == h.gather(1, last.clamp(min=0))) & (pos < last)
    ends = torch.where(occurs, pos, -1).topk(min(max_candidates, width), dim=1).values  # [bs, k]
    back = torch.arange(max_window, device=dev)  # offsets before a match's end
    at = ends[:, :, None] - back  # [bs, k, W]
    before = h.gather(1, at.clamp(min=0).flatten(1)).view(at.shape)
    query = h.gather(1, (last - back).clamp(min=0))  # [bs, W]: the context's own suffix
    same = (before == query[:, None, :]) & (at >= 0)
    # Offset 0 matches by construction; the match runs while every offset after it does.
    match = same[:, :, 1:].long().cumprod(2).sum(2) + 1  # [bs, k]
    return torch.where(ends >= 0, match * (width + 1) + ends, -1)


def continuation(h: torch.Tensor, last: torch.Tensor, score: torch.Tensor, min_window: int,
                 length: int) -> tuple:
    """The `length` tokens after each scored match ([bs, ...] scores) and which of them exist
    (the match is long enough, the token is inside the context): ([..., length], same)."""
    width = h.shape[1]
    found = (score >= 0) & (score // (width + 1) >= min_window)
    cols = (score % (width + 1) + 1)[..., None] + torch.arange(length, device=h.device)
    tail = (1,) * (score.dim() - 1)
    valid = found[..., None] & (cols <= last.view(-1, *tail, 1))
    flat = cols.clamp(max=width - 1).flatten(1)
    return h.gather(1, flat).view(cols.shape), valid


def match_chain(history: torch.Tensor, lens: torch.Tensor, length: int, min_window: int,
                max_window: int, max_candidates: int, pad_token: int) -> torch.Tensor:
    """The twin. history: [bs, C] tokens by position; lens: [bs] context lengths (the last
    token at lens - 1). Returns [bs, length] int64: each context's continuation after its best
    earlier match, pad_token past it (or everywhere when nothing matches)."""
    h, last = history.long(), (lens - 1)[:, None]
    best = scored_matches(h, last, max_window, max_candidates).max(1).values
    tokens, valid = continuation(h, last, best, min_window, length)
    return torch.where(valid, tokens, torch.full_like(tokens, pad_token))


def match_chain_rows(ids: torch.Tensor, rows: torch.Tensor, width: int, lens: torch.Tensor,
                     length: int, min_window: int, max_window: int, max_candidates: int,
                     pad_token: int, use_triton: bool | None = None) -> torch.Tensor:
    """match_chain over rows `rows` of a token buffer `ids` ([R, >= width], the first width
    columns by position; drafts/ngram_device.TokenHistory's), without copying them out first.
    lens [bs] <= width. Never reads tensor values on the host (CUDA-graph safe)."""
    if not pick_triton(ids, use_triton):
        return match_chain(ids[rows, :width], lens, length, min_window, max_window,
                           max_candidates, pad_token)
    return triton_module("ngram_match_triton").match_chain_rows_triton(
        ids, rows, width, lens, length, min_window, max_window, max_candidates, pad_token)


def append_path(ids: torch.Tensor, rows: torch.Tensor, width: int, nodes: torch.Tensor,
                accept_len: torch.Tensor, bonus: torch.Tensor, prefix: torch.Tensor) -> None:
    """Writes each request's accepted path after its last verify into its row of `ids` (the
    token history: [R, width + 1], a sink column last): nodes[i, 1..m] at positions
    prefix[i] + 1 .., then bonus[i] (m = accept_len[i]; node 0, the root, is at prefix[i]
    already). Positions at or past `width` go to the sink column."""
    cols = torch.arange(nodes.shape[1], device=nodes.device)
    path = path_tokens(nodes, accept_len, bonus, cols)
    pos = prefix[:, None] + 1 + cols
    pos = torch.where((cols <= accept_len[:, None]) & (pos < width), pos, width)
    ids[rows[:, None].expand_as(pos), pos] = path.to(ids.dtype)


def append_match_chain_rows(ids: torch.Tensor, rows: torch.Tensor, width: int,
                            nodes: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
                            prefix: torch.Tensor, length: int, min_window: int, max_window: int,
                            max_candidates: int, pad_token: int,
                            use_triton: bool | None = None) -> torch.Tensor:
    """An overlapped NGRAM step's whole proposal: appends each request's last accepted path to
    its history row (`append_path`), then matches the new context (`match_chain_rows`).
    Returns [bs, length + 1] int64: the bonus (the next verify's root), then the drafts. On
    the GPU one kernel, where the torch ops were about fifteen launches a step (a batch-1
    NGRAM step's whole prologue before its verify was some thirty, 70 of its 1,090 us on an
    H200, benchmarks/results/step_trace_ngram_bs1_403c987_h200.txt)."""
    if pick_triton(ids, use_triton):
        return triton_module("ngram_match_triton").append_match_chain_rows_triton(
            ids, rows, width, nodes, accept_len, bonus, prefix, length, min_window, max_window,
            max_candidates, pad_token)
    append_path(ids, rows, width, nodes, accept_len, bonus, prefix)
    lens = prefix + accept_len + 2
    drafts = match_chain_rows(ids, rows, width, lens, length, min_window, max_window,
                              max_candidates, pad_token, use_triton=False)
    return torch.cat([bonus[:, None], drafts], 1)
