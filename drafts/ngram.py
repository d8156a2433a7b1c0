"""NGRAM: drafts copied from earlier text of the same request (prompt lookup); no model.

Each request keeps an index of where each token occurred, fed incrementally as tokens are
committed; a propose grows matches backwards (up to max_window tokens) from the most recent
occurrences of the last token, so its cost does not grow with the context. A chain takes the
continuation after the longest matching suffix; a tree (topk > 1) merges the continuations of
up to `bfs_breadth` matches into a trie and keeps its first N - 1 nodes in breadth-first order.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Optional

import torch

from drafts.base import DraftWorker, Proposal
from drafts.ngram_device import NgramStepRound, TokenHistory
from specpcg.transfer import to_device

MAX_CANDIDATES = 64  # most recent earlier occurrences of the last token a propose examines
# The device's match scans a request's whole history every step, so its cost grows with the
# history's width: longer requests take the host's steps.
DEVICE_HISTORY_TOKENS = 16384


class _RequestIndex:
    """A request's tokens and where each occurred; a match is grown backwards from an
    occurrence of the last token. Indexing costs one dict append per committed token (a 4k
    prompt: about a millisecond), proposing at most MAX_CANDIDATES x max_window comparisons,
    whatever the context length. It keeps its own copy of the tokens, appended as they come:
    building `all_ids` copies the whole context, every step and request."""

    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self.ids: list = []
        self.positions: dict = {}  # token -> [positions], oldest first
        self.num_indexed = 0  # positions before this one are indexed

    def sync(self, req) -> list:
        """Appends the request's tokens committed since the last call; returns them all."""
        prompt = req.prompt_ids
        if len(self.ids) < len(prompt):
            self.extend(prompt[len(self.ids):])
        return self.extend(req.output_ids[len(self.ids) - len(prompt):])

    def extend(self, tokens: list) -> list:
        """Appends tokens and indexes them; returns all the request's tokens."""
        ids = self.ids
        ids.extend(tokens)
        # NOTE: the last token is left out: it ends the query itself.
        table = self.positions
        for pos in range(self.num_indexed, len(ids) - 1):
            found = table.get(ids[pos])
            if found is None:
                table[ids[pos]] = [pos]
            else:
                found.append(pos)
        self.num_indexed = max(self.num_indexed, len(ids) - 1)
        return ids

    def _match_len(self, end: int, last: int) -> int:
        """How many tokens ending at `end` equal those ending at `last` (<= max_window)."""
        ids, w = self.ids, 1
        while w < self.max_window and end - w >= 0 and ids[end - w] == ids[last - w]:
            w += 1
        return w

    def continuations(self, length: int, breadth: int, context: Optional[int] = None) -> list:
        """Up to `breadth` distinct continuations, longest match first, most recent first, of
        the first `context` tokens (all of them by default): what a propose made then saw."""
        ids = self.ids
        context = len(ids) if context is None else context
        last = context - 1
        ends = self.positions.get(ids[last], ())
        cut = bisect_left(ends, last)  # occurrences before the query's own last token
        candidates = reversed(ends[max(cut - MAX_CANDIDATES, 0):cut])
        if breadth == 1 and length > 0:
            return self._longest(candidates, last, length, context)
        scored = [(self._match_len(end, last), end) for end in candidates]
        scored.sort(key=lambda m: -m[0])  # stable: the most recent first among equal lengths
        found = []
        for match_len, end in scored:
            if match_len < self.min_window:
                break
            cont = ids[end + 1:min(end + 1 + length, context)]
            if cont and cont not in found:
                found.append(cont)
            if len(found) >= breadth:
                break
        return found

    def _longest(self, candidates, last: int, length: int, context: int) -> list:
        """continuations' one continuation (a chain's), without ranking every candidate: the
        longest match, the most recent of equals, and no further look once one is max_window
        long. NOTE: a shadow verify (specpcg/speculative/shadow.py) runs this on the host
        after every step of an adaptive NGRAM engine; ranking all 64 candidates took most of
        its 15 us on a 2-core CPU."""
        best_len, best_end = 0, None
        for end in candidates:
            match_len = self._match_len(end, last)
            if match_len > best_len:
                best_len, best_end = match_len, end
                if match_len >= self.max_window:
                    break
        if best_end is None or best_len < self.min_window:
            return []
        return [self.ids[best_end + 1:min(best_end + 1 + length, context)]]


class NgramDraft(DraftWorker):
    name = "NGRAM"
    kv_cache = None  # no draft model: nothing of its own to cache
    history = None  # TokenHistory: each request's tokens on the device (chains, after setup)

    def __init__(self, min_window: int = 1, max_window: int = 12, min_bfs_breadth: int = 1,
                 max_bfs_breadth: int = 10, pad_token: int = 0):
        self.min_window, self.max_window = min_window, max_window
        self.max_bfs_breadth = max_bfs_breadth
        self.pad_token = pad_token
        self.max_candidates = MAX_CANDIDATES
        self._index: dict = {}  # rid -> _RequestIndex

    def setup(self, ctx) -> None:
        """A token history on the device, so that steps (chains and trees) can overlap."""
        self._width, self.chain = ctx.spec.num_draft_tokens, ctx.spec.is_chain
        pool = ctx.kv_cache.req_pool
        width = min(pool.max_context_len, DEVICE_HISTORY_TOKENS)
        self.history = TokenHistory(pool.req_to_token.shape[0], width, ctx.device)

    def _continuations(self, req, spec) -> list:
        index = self._index.setdefault(req.rid, _RequestIndex(self.min_window, self.max_window))
        index.sync(req)
        breadth = 1 if spec.is_chain else self.max_bfs_breadth
        return index.continuations(spec.num_draft_tokens - 1, breadth)

    def propose(self, reqs: list, spec) -> Proposal:
        n = spec.num_draft_tokens
        rows, parent_rows = [], []
        for req in reqs:
            conts = self._continuations(req, spec)
            tokens, parents = (_chain(conts, n) if spec.is_chain else _trie_bfs(conts, n))
            rows.append([req.last_id] + [t if t is not None else self.pad_token for t in tokens])
            parent_rows.append([-1] + parents)
        draft_tokens = torch.tensor(rows, dtype=torch.long)  # [bs, N]
        parents = None if spec.is_chain else torch.tensor(parent_rows, dtype=torch.long)
        return Proposal(draft_tokens=draft_tokens, parents=parents)

    def shadow_accept(self, req, context: int, spec) -> Optional[int]:
        """The drafts a verify of the request's first `context` tokens would have accepted,
        judged on the tokens that followed (the target's own, however they were decoded); None
        until they are all known, or where they cannot judge: a tree of a sampled request (its
        verify samples siblings from residual distributions). A chain's draft is one-hot, so
        a sampled token equals it with the probability a verify accepts it: the count is
        unbiased for sampled requests too (specpcg/speculative/shadow.py)."""
        if not spec.is_chain and not req.params.is_greedy:
            return None
        n = spec.num_draft_tokens
        if context < 1 or req.seq_len < context + n - 1:
            return None
        index = self._index.setdefault(req.rid, _RequestIndex(self.min_window, self.max_window))
        ids = index.sync(req)
        conts = index.continuations(n - 1, 1 if spec.is_chain else self.max_bfs_breadth,
                                    context)
        tokens, parents = _chain(conts, n) if spec.is_chain else _trie_bfs(conts, n)
        tokens = [self.pad_token if t is None else t for t in tokens]  # as propose pads
        actual = ids[context:context + n - 1]
        return _chain_walk(tokens, actual) if spec.is_chain else _walk(tokens, parents, actual)

    def release(self, req) -> None:
        self._index.pop(req.rid, None)
        if self.history is not None:
            self.history.drop(req)

    # -- overlapped steps (specpcg/speculative/overlap.py) -------------------------------------
    @property
    def supports_overlap(self) -> bool:
        return self.history is not None

    def step_round(self, decode, max_requests: int) -> NgramStepRound:
        """decode: the target's DecodeGraphRunner (None: no graphs, nothing to pad to)."""
        if decode is None:
            return NgramStepRound(self, [max_requests], padded=False)
        return NgramStepRound(self, list(decode.buckets), padded=True)

    def overlap_ready(self, reqs: list) -> bool:
        return True  # nothing to catch up on

    @property
    def overlap_context_len(self) -> int:
        return self.history.width

    def device_path(self, reqs: list):
        """Brings each request's history up to date; its path is its last token alone."""
        from specpcg.speculative.overlap import DevicePath

        self.history.sync(reqs)
        device = self.history.ids.device
        ints = to_device([[r.num_cached - 1, 1, r.last_id] for r in reqs], device)
        ids = torch.zeros(len(reqs), self._width, dtype=torch.long, device=device)
        ids[:, 0] = ints[:, 2]
        return DevicePath(first_pos=ints[:, 0], lens=ints[:, 1], roots=ints[:, 2], ids=ids,
                          hidden=None)

    def draft_rows(self, reqs: list) -> list:
        return [r.req_pool_idx for r in reqs]  # rows of no cache: the history's are the target's

    def resolved(self, req, prefix: int, hidden_paths, row: int, m: int) -> None:
        """An overlapped step verified from `prefix`: the device history holds the request's
        tokens up to its root there; the next step appends the rest."""
        self.history.mark(req, prefix + 1)

    def trim(self, req) -> None:
        """Nothing reserved: NGRAM has no KV cache."""


def _chain(conts: list, n: int) -> tuple:
    tokens = list(conts[0]) if conts else []
    tokens += [None] * (n - 1 - len(tokens))  # padding drafts: almost surely rejected
    return tokens, list(range(0, n - 1))


def _walk(tokens: list, parents: list, actual: list) -> int:
    """How deep a verify walks into a draft (tokens[i] and parents[i] are node i + 1's; node 0
    is the root) when the target emits `actual`: the drafts it accepts."""
    node, depth = 0, 0
    for tok in actual:
        node = next((i + 1 for i, (t, p) in enumerate(zip(tokens, parents))
                     if p == node and t == tok), None)
        if node is None:
            break
        depth += 1
    return depth


def _chain_walk(tokens: list, actual: list) -> int:
    """_walk for a chain (node i + 1's parent is node i): its drafts that match `actual`
    from the first on."""
    depth = 0
    for tok, want in zip(tokens, actual):
        if tok != want:
            break
        depth += 1
    return depth


def _trie_bfs(conts: list, n: int) -> tuple:
    """Merges continuations into a trie under the root; its first n - 1 nodes in BFS order."""
    children: dict = {0: {}}  # node -> {token: child node}
    tokens, parents = [None], [-1]
    for cont in conts:
        node = 0
        for tok in cont:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(tokens)
                children[node][tok] = nxt
                children[nxt] = {}
                tokens.append(tok)
                parents.append(node)
            node = nxt
    order, queue = [], [0]
    while queue:  # BFS renumbering: a parent always precedes its children
        node = queue.pop(0)
        order.append(node)
        queue.extend(children[node].values())
    order = order[:n]
    new_id = {old: i for i, old in enumerate(order)}
    out_tokens = [tokens[o] for o in order[1:]]
    out_parents = [new_id[parents[o]] for o in order[1:]]
    while len(out_tokens) < n - 1:  # pad with leaves under the root
        out_tokens.append(None)
        out_parents.append(0)
    return out_tokens, out_parents
