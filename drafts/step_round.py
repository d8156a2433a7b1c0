"""A head's part of an overlapped speculative step (specpcg/speculative/step_graph.py): its
catch-up on the last verify's accepted path and its chain of drafts, the round runner's
bodies (specpcg/graphs/draft_runner.py), read from and written to device buffers only."""

from __future__ import annotations

import torch


class HeadStepRound:
    def __init__(self, draft):
        self.draft, self.rnd = draft, draft.round
        self.buckets = self.rnd.buckets
        self.captures = bool(self.rnd.graphs)  # no round graphs: the step runs eagerly too
        hidden = self.rnd.buf.target_hidden  # [max_bs * N, H'] (None: no hidden states)
        self.hidden_size = hidden.shape[1] if hidden is not None else 0
        self.hidden_dtype = hidden.dtype if hidden is not None else None
        self.pad_row = draft.kv_cache.req_pool.pad_row

    def bucket(self, n: int):
        return self.rnd.bucket(n)

    reach_extra = 0  # draft positions a round writes past its verify's width
    path_ids = True  # propose reads the last path's tokens (StepState.path builds them)

    def _catch_up(self, state, bs: int, path):
        rnd = self.rnd
        rnd.load_on_device(bs, state.rows[1, :bs], path)
        widest = [rnd.width] * bs  # the plan's shape: any accept length fits
        return rnd.catch_up_body(bs, widest, widest)

    def propose(self, state, bs: int, path):
        """([bs, N] verify nodes, root first: the catch-up's argmax, then the chain; None: a
        chain's tree)."""
        rnd = self.rnd
        rows, hidden = self._catch_up(state, bs, path)
        widest = [rnd.width] * bs
        token0 = self.draft.model.greedy_tokens(rows)
        columns = [path.roots[:, None], token0[:, None]]
        if rnd.steps:
            rnd.buf.token0[:bs].copy_(token0)
            if hidden is not None:
                rnd.buf.hidden0[:bs].copy_(hidden)
            columns.append(rnd.chain_body(bs, widest))
        return torch.cat(columns, 1), None

    def count(self, runner_name: str) -> None:
        self.draft.router.count("DRAFT_EXTEND", runner_name)
        self.draft.router.count("DECODE", runner_name, None, self.rnd.steps)


class StandaloneStepRound(HeadStepRound):
    """A draft model's round: it already holds the KV of the drafts it fed (the root and
    d1 .. d_{S-1} of S drafts), so its catch-up feeds only the path past the accepted ones it
    fed: the bonus, or d_S and the bonus when every draft was accepted."""

    def propose(self, state, bs: int, path) -> torch.Tensor:
        from specpcg.speculative.overlap import DevicePath

        # Of the accepted drafts, those it fed: at most S - 1 (N = S + 1 verify nodes).
        fed = (path.lens - 1).clamp(max=state.tokens.shape[1] - 2)
        take = fed[:, None] + torch.arange(self.rnd.width, device=fed.device)
        ids = path.ids.gather(1, take.clamp(max=path.ids.shape[1] - 1))
        return super().propose(state, bs, DevicePath(path.first_pos + 1 + fed, path.lens - fed,
                                                     path.roots, ids, None))


class HeadTreeStepRound(HeadStepRound):
    """A head's tree round: the catch-up, then every tree step and the node selection
    (drafts/tree_round.py), whose branches write the draft's KV past the verify's width."""

    def __init__(self, draft):
        super().__init__(draft)
        self.tree = draft.tree_round
        self.reach_extra = self.tree.round_slots

    def propose(self, state, bs: int, path):
        """([bs, N] the tree's nodes, root first; its Tree)."""
        rows, hidden = self._catch_up(state, bs, path)
        self.tree.load_root(rows, hidden)
        tree = self.tree.tree_body(bs, [self.rnd.width] * bs)
        return tree.draft_tokens, tree

    def count(self, runner_name: str) -> None:
        self.draft.router.count("DRAFT_EXTEND", runner_name, None, self.tree.num_steps)

