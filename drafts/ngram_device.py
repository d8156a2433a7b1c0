"""NGRAM's proposals (chains and trees) computed on the device, so that its speculative steps can
overlap (specpcg/speculative/overlap.py): the step graph appends the last verify's accepted
tokens to each request's token history on the device and matches the new context there, with
no read of the tokens by the host.

The rule is the host index's (drafts/ngram.py). For chains: among the MAX_CANDIDATES most
recent earlier occurrences of the last token, the one whose match with the context's suffix
is longest (at most max_window tokens; the most recent on a tie) gives the continuation after
it, if that match has at least min_window tokens. Trees merge the first max_bfs_breadth
distinct continuations in that order into a trie (`match_tree`). So a request proposes the
same drafts whether its step ran on the host or on the device. Every shape is fixed by the
batch bucket and the history's width, so one CUDA graph replays it. A chain's match (one
kernel: kernels/ngram_match.py) reads a request's tokens back from its end until it has met
MAX_CANDIDATES occurrences; a tree's grows with the history's width (the engine's context
length), not with the requests' own lengths.
"""

from __future__ import annotations

import torch

from kernels.ngram_match import (append_match_chain_rows, append_path, continuation,
                                 scored_matches)
from kernels.tree import tree_from_parents
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



def match_tree(history: torch.Tensor, lens: torch.Tensor, num_nodes: int, min_window: int,
               max_window: int, max_candidates: int, breadth: int, pad_token: int) -> tuple:
    """The host's tree (drafts/ngram.py: `continuations` merged by `_trie_bfs`) on the device.
    Returns ([bs, num_nodes - 1] draft tokens, [bs, num_nodes - 1] their parents), BFS order
    under the root (node 0), padded with pad_token leaves under the root.

    Up to `breadth` distinct continuations, longest match first, the most recent on a tie,
    form a trie: a node is a prefix, made by the first continuation that has it. BFS orders a
    depth by its parents' order, then siblings by the continuation that made them."""
    h, last = history.long(), (lens - 1)[:, None]
    bs, length, dev = h.shape[0], num_nodes - 1, h.device
    score = scored_matches(h, last, max_window, max_candidates).sort(1, descending=True).values
    tokens, valid = continuation(h, last, score, min_window, length)  # [bs, k, L]
    conts = torch.where(valid, tokens, -1)
    ok = valid[:, :, 0]  # a continuation of at least one token
    k = conts.shape[1]
    ranks = torch.arange(k, device=dev)
    same = (conts[:, :, None, :] == conts[:, None, :, :]).all(-1)  # [bs, k, k]
    seen = (same & ok[:, None, :] & (ranks[None, :] < ranks[:, None])[None]).any(-1)
    new = ok & ~seen
    order = torch.where(new, new.long().cumsum(1) - 1, k)  # rank among the distinct ones
    pick = order.topk(min(breadth, k), dim=1, largest=False)
    taken = pick.values < min(breadth, k)  # [bs, B]
    c = torch.where(taken[:, :, None], conts.gather(1, pick.indices[:, :, None].expand(
        -1, -1, length)), -1)  # [bs, B, L], -1 past each continuation's end
    return _trie_bfs(c, num_nodes, pad_token)


def _trie_bfs(c: torch.Tensor, num_nodes: int, pad_token: int) -> tuple:
    """c: [bs, B, L] continuations (-1 past their ends) -> the first num_nodes - 1 trie nodes
    in BFS order: (tokens, parents), each [bs, num_nodes - 1]."""
    bs, b, length = c.shape
    dev = c.device
    idx = torch.arange(b, device=dev)
    prefix = (c[:, :, None, :] == c[:, None, :, :]).long().cumprod(-1).bool()  # [bs, i, j, L]
    # maker[bs, j, d]: the first continuation with j's first d + 1 tokens (j itself if none).
    maker = torch.where(prefix, idx[None, :, None, None], b).amin(1)  # [bs, B, L]
    exists = (maker == idx[None, :, None]) & (c >= 0)
    node = torch.zeros(bs, b, length, dtype=torch.long, device=dev)  # BFS index, 1 = first
    parent = torch.zeros_like(node)
    placed = torch.ones(bs, 1, dtype=torch.long, device=dev)  # the root
    for d in range(length):
        up = (node[:, :, d - 1].gather(1, maker[:, :, d - 1]) if d
              else torch.zeros(bs, b, dtype=torch.long, device=dev))
        key = torch.where(exists[:, :, d], up * b + idx, -1)
        before = ((key[:, None, :] < key[:, :, None]) & (key[:, None, :] >= 0)).sum(-1)
        node[:, :, d] = torch.where(exists[:, :, d], placed + before, 0)
        parent[:, :, d] = up
        placed = placed + exists[:, :, d].sum(1, keepdim=True)
    slot = torch.where((node > 0) & (node < num_nodes), node, num_nodes).flatten(1)
    tokens = torch.full((bs, num_nodes + 1), pad_token, dtype=torch.long, device=dev)
    parents = torch.zeros(bs, num_nodes + 1, dtype=torch.long, device=dev)
    tokens.scatter_(1, slot, c.flatten(1))
    parents.scatter_(1, slot, parent.flatten(1))
    return tokens[:, 1:num_nodes], parents[:, 1:num_nodes]


class NgramStepRound:
    """NGRAM's part of an overlapped speculative step: append the last verify's path to the
    token history, then match the new context (specpcg/speculative/step_graph.py)."""

    hidden_size, hidden_dtype, pad_row = 0, None, None  # no hidden states, no KV cache
    reach_extra = 0
    path_ids = False  # the path's tokens come from the step state (append_path, the kernel)

    def __init__(self, draft, buckets: list, padded: bool):
        """buckets: the target's decode graph batch sizes (padded), or the most requests that
        run at once (not padded: no graphs, so the step runs at the batch's own size)."""
        self.draft, self.buckets, self.captures = draft, buckets, padded

    def bucket(self, n: int):
        if not self.captures:
            return n if n <= self.buckets[-1] else None
        return pick_bucket(self.buckets, n)

    def propose(self, state, bs: int, path) -> tuple:
        """([bs, N] nodes, root first; their Tree, or None for a chain)."""
        d, history = self.draft, self.draft.history
        rows, n = state.rows[0, :bs], state.tokens.shape[1]
        last = (state.tokens[:bs], state.accept_len[:bs], state.bonus[:bs], path.first_pos)
        if d.chain:
            return append_match_chain_rows(history.ids, rows, history.width, *last, n - 1,
                                           d.min_window, d.max_window, d.max_candidates,
                                           d.pad_token), None
        append_path(history.ids, rows, history.width, *last)
        lens = path.first_pos + path.lens + 1
        ids = history.ids[rows, :history.width]
        drafts, parents = match_tree(ids, lens, n, d.min_window, d.max_window, d.max_candidates,
                                     d.max_bfs_breadth, d.pad_token)
        tokens = torch.cat([path.roots[:, None], drafts], 1)
        tree = tree_from_parents(tokens, torch.cat([torch.full_like(parents[:, :1], -1),
                                                    parents], 1))
        return tokens, tree

    def count(self, runner_name: str) -> None:
        """NGRAM runs no draft forward."""
