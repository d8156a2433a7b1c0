"""NGRAM's chain proposals computed on the device, so that its speculative steps can overlap
(specpcg/speculative/overlap.py): the step graph appends the last verify's accepted tokens to
each request's token history on the device and matches the new context there, with no read
of the tokens by the host.

The rule is the host index's (drafts/ngram.py), for chains: among the MAX_CANDIDATES most
recent earlier occurrences of the last token, the one whose match with the context's suffix
is longest (at most max_window tokens; the most recent on a tie) gives the continuation after
it, if that match has at least min_window tokens. So a request proposes the same drafts
whether its step ran on the host or on the device. Every shape is fixed by the batch bucket
and the history's width, so one CUDA graph replays it; the cost grows with that width (the
engine's context length), not with the requests' own lengths.
"""

from __future__ import annotations

import torch

from specpcg.graphs.buckets import pick_bucket
from specpcg.transfer import to_device


class TokenHistory:
    """Row r holds the tokens of the request in the target's request row r, by position; the
    host keeps how many of each request's tokens are there already (`synced`)."""

    def __init__(self, num_rows: int, width: int, device):
        # One sink column past the context: masked writes land there.
        self.ids = torch.zeros(num_rows, width + 1, dtype=torch.int32, device=device)
        self.width = width
        self._synced: dict = {}  # rid -> (row, tokens on the device)

    def sync(self, reqs: list) -> None:
        """Copies what each request's host ids hold past what its row has (one copy)."""
        rows, cols, vals = [], [], []
        for req in reqs:
            row, have = self._synced.get(req.rid, (req.req_pool_idx, 0))
            if row != req.req_pool_idx:  # re-admitted into another row
                have = 0
            ids = req.all_ids
            rows += [req.req_pool_idx] * (len(ids) - have)
            cols += range(have, len(ids))
            vals += ids[have:]
            self._synced[req.rid] = (req.req_pool_idx, len(ids))
        if vals:
            packed = to_device([rows, cols, vals], self.ids.device)
            self.ids[packed[0], packed[1]] = packed[2].to(self.ids.dtype)

    def mark(self, req, num_tokens: int) -> None:
        """The device row holds the request's first num_tokens tokens (and maybe more)."""
        self._synced[req.rid] = (req.req_pool_idx, num_tokens)

    def drop(self, req) -> None:
        self._synced.pop(req.rid, None)

    def append(self, rows, first_pos, lens, ids) -> None:
        """Writes ids[i, :lens[i]] at positions first_pos[i] + 1 .. of row rows[i]."""
        cols = torch.arange(ids.shape[1], device=ids.device)
        pos = first_pos[:, None] + 1 + cols
        pos = torch.where((cols < lens[:, None]) & (pos < self.width), pos, self.width)
        self.ids[rows[:, None].expand_as(pos), pos] = ids.to(self.ids.dtype)


def match_chain(history: torch.Tensor, lens: torch.Tensor, length: int, min_window: int,
                max_window: int, max_candidates: int, pad_token: int) -> torch.Tensor:
    """history: [bs, C] tokens by position; lens: [bs] context lengths (the last token at
    lens - 1). Returns [bs, length]: each context's continuation after its best earlier match,
    pad_token past it (or everywhere when nothing matches). Three passes over [bs, C] (find
    the occurrences, keep the most recent), the rest over [bs, max_candidates, max_window]."""
    bs, width = history.shape
    dev = history.device
    pos = torch.arange(width, device=dev)
    last = (lens - 1)[:, None]
    h = history.long()
    occurs = (h == h.gather(1, last.clamp(min=0))) & (pos < last)
    ends = torch.where(occurs, pos, -1).topk(min(max_candidates, width), dim=1).values  # [bs, k]
    back = torch.arange(max_window, device=dev)  # offsets before a match's end
    at = ends[:, :, None] - back  # [bs, k, W]
    before = h.gather(1, at.clamp(min=0).flatten(1)).view(at.shape)
    query = h.gather(1, (last - back).clamp(min=0))  # [bs, W]: the context's own suffix
    same = (before == query[:, None, :]) & (at >= 0)
    # Offset 0 matches by construction; the match runs while every offset after it does.
    match = same[:, :, 1:].long().cumprod(2).sum(2) + 1  # [bs, k]
    score = torch.where(ends >= 0, match * (width + 1) + ends, -1)
    best = score.max(1).values
    found = (best >= 0) & (best // (width + 1) >= min_window)
    start = best % (width + 1) + 1  # the token after the match
    cols = start[:, None] + torch.arange(length, device=dev)
    valid = found[:, None] & (cols <= last)
    return torch.where(valid, h.gather(1, cols.clamp(max=width - 1)),
                       torch.full_like(cols, pad_token))


class NgramStepRound:
    """NGRAM's part of an overlapped speculative step: append the last verify's path to the
    token history, then match the new context (specpcg/speculative/step_graph.py)."""

    hidden_size, hidden_dtype, pad_row = 0, None, None  # no hidden states, no KV cache
    reach_extra = 0

    def __init__(self, draft, buckets: list, padded: bool):
        """buckets: the target's decode graph batch sizes (padded), or the most requests that
        run at once (not padded: no graphs, so the step runs at the batch's own size)."""
        self.draft, self.buckets, self.captures = draft, buckets, padded

    def bucket(self, n: int):
        if not self.captures:
            return n if n <= self.buckets[-1] else None
        return pick_bucket(self.buckets, n)

    def propose(self, state, bs: int, path) -> torch.Tensor:
        d, history = self.draft, self.draft.history
        rows = state.rows[0, :bs]
        history.append(rows, path.first_pos, path.lens, path.ids)
        drafts = match_chain(history.ids[rows, :history.width], path.first_pos + path.lens + 1,
                             state.tokens.shape[1] - 1, d.min_window, d.max_window,
                             d.max_candidates, d.pad_token)
        return torch.cat([path.roots[:, None], drafts], 1), None

    def count(self, runner_name: str) -> None:
        """NGRAM runs no draft forward."""
