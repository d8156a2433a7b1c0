"""The speculative step: propose -> verify -> accept -> commit, for every running request.

Co-scheduled with continuous batching: new requests are prefilled by the target as usual (the
piecewise graph), then join the running batch, which this step advances by 1..N tokens each.
"""

from __future__ import annotations

from collections import Counter

import torch

from kernels.tree import chain_tree, tree_from_parents
from specpcg.core import CaptureHiddenMode, ForwardMode
from specpcg.sampler import record_output_logprobs
from specpcg.speculative.accept import SimulatedAccept, accept
from specpcg.transfer import to_device


class SpecDecoder:
    def __init__(self, draft, router, kv_cache, spec, device):
        self.draft, self.router, self.kv_cache = draft, router, kv_cache
        self.spec, self.device = spec, device
        self.num_verify = 0
        self.num_emitted = 0
        self.histogram: Counter = Counter()
        self.depth_hist: Counter = Counter()  # (drafts verified, accepted) -> verifies
        self.simulate = SimulatedAccept.from_spec(spec)  # benchmark only; None = lossless
        self._chain_trees: dict = {}  # (bs, N) -> a chain Tree (its tokens replaced per step)

    @property
    def tokens_per_request(self) -> int:
        return self.spec.num_draft_tokens

    def step(self, reqs: list) -> list:
        """Returns, per request, the tokens it emits this step (accepted drafts + bonus)."""
        proposal = self.draft.propose(reqs, self.spec)
        tree, out, prefix_lens = self._verify(reqs, proposal)
        logits = out.all_logits.view(len(reqs), self.spec.num_draft_tokens, -1)
        result = accept(reqs, tree, proposal.draft_probs, logits, self.simulate)
        return self._commit(reqs, tree, result, prefix_lens, out, logits,
                            chain=proposal.parents is None)

    def _verify(self, reqs: list, proposal):
        """One TARGET_VERIFY forward over every request's N nodes (root + drafts)."""
        from specpcg.batch import make_batch

        draft_tokens = proposal.draft_tokens.to(self.device)
        tree = (self.verify_tree(draft_tokens) if proposal.parents is None
                else tree_from_parents(draft_tokens, proposal.parents.to(self.device)))
        n = self.spec.num_draft_tokens
        prefix_lens = [r.num_cached for r in reqs]  # the root (last token) has no KV yet
        self.kv_cache.extend_many([r.req_pool_idx for r in reqs], [n] * len(reqs))
        # Placeholder ids build the batch; the drafts stay on the device (no host sync here).
        batch = make_batch(self.kv_cache, ForwardMode.TARGET_VERIFY, reqs, [[0] * n] * len(reqs),
                           self.device)
        batch.input_ids = draft_tokens.reshape(-1)
        self.verify_outputs(batch)
        if proposal.parents is not None:
            # NOTE: a node sits at prefix_len + depth and sees only its ancestors.
            batch.positions = (to_device(prefix_lens, self.device)[:, None]
                               + tree.depths).flatten()
            batch.tree_mask = tree.tree_mask
        return tree, self.router.forward(batch), prefix_lens

    def verify_outputs(self, batch) -> None:
        """What a TARGET_VERIFY forward returns: every node's logits, and every node's hidden
        state for a draft that reads them (the accepted ones feed its catch-up)."""
        batch.return_all_logits = True
        if self.draft.needs_hidden:
            batch.capture_hidden_mode = CaptureHiddenMode.FULL
            batch.aux_hidden_layers = self.draft.aux_layers

    def record(self, req, m: int, depth: int | None = None) -> None:
        """Counts a verify of `req` that accepted m drafts (and emitted m + 1 tokens) of the
        `depth` it verified (None: all num_draft_tokens - 1)."""
        self.depth_hist[(depth or self.spec.num_draft_tokens - 1, m)] += 1
        req.spec_verify_ct += 1
        req.spec_accepted_drafts += m
        req.spec_histogram[m] += 1
        self.histogram[m] += 1
        self.num_verify += 1
        self.num_emitted += m + 1

    def verify_tree(self, draft_tokens):
        """A chain's tree depends on its shape alone: built once per batch size, then only
        the tokens change (a verify step is latency-bound; this saves a handful of ops)."""
        key = tuple(draft_tokens.shape)
        shape = self._chain_trees.get(key)
        if shape is None:
            shape = self._chain_trees[key] = chain_tree(draft_tokens)
        return shape._replace(draft_tokens=draft_tokens)

    def _commit(self, reqs: list, tree, result, prefix_lens: list, out, logits,
                chain: bool) -> list:
        """logits: [bs, N, V], the verify's; out: its ModelOutput (hidden states)."""
        n = tree.draft_tokens.shape[1]
        # One device-to-host copy for everything the host needs (each .tolist() is a sync).
        host = torch.cat([result.accept_index, result.accept_len[:, None], result.bonus[:, None],
                          tree.draft_tokens.to(result.bonus.device)], dim=1).tolist()
        accept_index = [row[:n] for row in host]
        accept_lens = [row[n] for row in host]
        bonus = [row[n + 1] for row in host]
        tokens = [row[n + 2:] for row in host]
        emitted = []
        for i, req in enumerate(reqs):
            m = accept_lens[i]
            path = accept_index[i][:m + 1]  # root + accepted drafts: their KV is kept
            self.kv_cache.keep_path(req.req_pool_idx, prefix_lens[i], path)
            req.num_cached = prefix_lens[i] + m + 1
            emitted.append([tokens[i][node] for node in path[1:]] + [bonus[i]])
            if req.return_logprob:  # node path[j]'s logits chose emitted token j
                chosen = to_device(emitted[-1], logits.device)
                record_output_logprobs(logits[i, path], chosen, [req] * len(path))
            self.record(req, m)
        self.draft.commit(reqs, accept_lens, self.hidden_paths(out, result, chain))
        return emitted

    def hidden_paths(self, out, result, chain: bool):
        """[bs, N, H']: row i holds the target's hidden states at request i's root and accepted
        drafts first (accept_lens[i] + 1 of them), then rows that mean nothing."""
        if not self.draft.needs_hidden:
            return None
        n = self.spec.num_draft_tokens
        # [bs * N, H']; a chain's own copy: the graph's buffer is reused by the next replay.
        hidden = self.draft.target_hidden(out, own=chain)
        bs = hidden.shape[0] // n
        if chain:  # a chain's accepted nodes are its first ones: the rows are in place
            return hidden.view(bs, n, -1)
        rows = result.accept_index.to(hidden.device) + n * torch.arange(
            bs, device=hidden.device)[:, None]  # [bs, N]
        return hidden[rows.clamp(min=0)]

    def stats(self) -> dict:
        avg = self.num_emitted / self.num_verify if self.num_verify else 0.0
        return {"avg_spec_accept_length": avg, "spec_verify_ct": self.num_verify,
                "spec_accept_histogram": dict(sorted(self.histogram.items()))}


def spec_meta(req, num_draft_tokens: int) -> dict:
    """Per-request metrics under SGLang's names (accept length counts the bonus token)."""
    verify = req.spec_verify_ct
    spec_tokens = len(req.output_ids) - req.plain_decode_tokens
    return {
        "spec_verify_ct": verify,
        "spec_accept_length": spec_tokens / verify if verify else 0.0,
        "plain_decode_tokens": req.plain_decode_tokens,
        "spec_accept_rate": (req.spec_accepted_drafts / (verify * (num_draft_tokens - 1))
                             if verify else 0.0),
        "spec_accepted_drafts": req.spec_accepted_drafts,
        "spec_accept_histogram": [req.spec_histogram.get(m, 0) for m in range(num_draft_tokens)],
    }
