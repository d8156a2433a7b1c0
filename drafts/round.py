"""A draft's round on its round runner (specpcg/graphs/draft_runner.py): the catch-up on what
the last verify accepted, then every greedy draft step of a chain (or, for a head's tree, every
tree step: drafts/tree_round.py), one graph replay each.

What stays eager, and why:
- a catch-up that does not fit the round's fixed width (a new request's prompt), or, for heads,
  whose target hidden states do not all come from one verify: one eager DRAFT_EXTEND;
- a round with a sampled request: its draft steps draw from per-request generators on the host,
  so they go one DECODE batch at a time (the per-step decode graphs).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from drafts.base import Proposal
from specpcg.graphs.draft_runner import RoundRow
from specpcg.transfer import to_device


class CatchUpPlan(NamedTuple):
    ids: list  # per request, the tokens the catch-up feeds (at positions num_cached..)
    verify_hidden: Optional[torch.Tensor] = None  # heads: [B, W, H'] target rows of one verify
    verify_rows: Optional[list] = None  # heads: each request's row in verify_hidden


class RoundDrafting:
    """Mixin for chain drafts with a `round` runner (None: none built). The draft provides
    `kv_cache`, `router`, `model` (compute_logits, greedy_tokens), and:

    - `_catch_up_plan(reqs, states) -> CatchUpPlan | None` (None: the catch-up runs eagerly);
    - `_eager_catch_up(reqs, states) -> (logits [bs, V], hidden [bs, H] or None)`;
    - `_propose_steps(reqs, states, spec, logits, hidden, root) -> Proposal` (per-step chain);
    - `_caught_up(state, num_tokens)`: bookkeeping after the graph's catch-up.
    """

    round = None

    def catch_up_positions(self, reqs: list) -> int:
        """Every position a request's draft KV lacks: a new request's whole prompt, and each
        plain step since its last round (a model's forward over each, eager when it does not fit
        the round's width). The states live in `_reqs` by rid, counting `num_cached`."""
        known = self._reqs
        return sum(r.seq_len - (known[r.rid].num_cached if r.rid in known else 0)
                   for r in reqs)

    def _propose_chain(self, reqs: list, states: list, spec) -> Proposal:
        rnd = self.round
        bs = rnd.bucket(len(reqs)) if rnd is not None else None
        if bs is None:
            return self._propose_steps(reqs, states, spec, *self._eager_catch_up(reqs, states))
        plan = self._catch_up_plan(reqs, states)
        greedy = rnd.steps > 0 and all(r.params.is_greedy for r in reqs)
        if plan is None:
            logits, hidden = self._eager_catch_up(reqs, states)
            if not greedy:
                return self._propose_steps(reqs, states, spec, logits, hidden)
        n = len(reqs)
        root, caught = self._load_round(reqs, states, bs, plan, rnd.steps if greedy else 0)
        if caught is not None:
            rows, hidden = caught
            if not greedy:
                logits = self.model.compute_logits(rows)
                return self._propose_steps(reqs, states, spec, logits, hidden, root)
            token0 = self.model.greedy_tokens(rows)
        else:
            token0 = logits.argmax(-1)
        tokens = rnd.chain(bs, token0, hidden, [st.num_cached for st in states])
        self.router.count("DECODE", rnd.runner_name, rnd.eager_reason, rnd.steps)
        self._chained(states, rnd.steps)
        return Proposal(draft_tokens=torch.cat([root[:, None], token0[:, None], tokens[:n]], 1))

    def _load_round(self, reqs: list, states: list, bs: int, plan, step_slots: int):
        """Loads a round into the runner: the catch-up's rows (`plan`; None when it ran
        eagerly) and `step_slots` KV slots a request for the round's steps, allocated with the
        catch-up's in one go (one req_to_token write). Returns (the requests' root tokens,
        the graph catch-up's (output rows, hidden) or None: DraftGraphRunner.catch_up)."""
        ids = plan.ids if plan else [[] for _ in reqs]
        verify_rows = plan.verify_rows if plan and plan.verify_rows else [0] * len(reqs)
        slots = self.kv_cache.extend_many([st.req_pool_idx for st in states],
                                          [len(x) + step_slots for x in ids])
        rows = [RoundRow(x, st.num_cached, sl[:len(x)], st.req_pool_idx, vr, req.last_id)
                for req, st, x, sl, vr in zip(reqs, states, ids, slots, verify_rows)]
        steps = [sl[len(x):] for sl, x in zip(slots, ids)] if step_slots else None
        root = self.round.load(bs, rows, steps, plan.verify_hidden if plan else None).clone()
        if plan is None:
            return root, None
        return root, self._graph_catch_up(states, [len(x) for x in ids], bs)

    def _chained(self, states: list, num_steps: int) -> None:
        """After the chain graph fed num_steps drafts per request (their KV is in place)."""

    def _graph_catch_up(self, states: list, lens: list, bs: int):
        n, rnd = len(states), self.round
        seq_lens = [st.num_cached + k for st, k in zip(states, lens)]
        rows, hidden = rnd.catch_up(bs, seq_lens + [1] * (bs - n), lens + [1] * (bs - n))
        self.router.count("DRAFT_EXTEND", rnd.runner_name, rnd.eager_reason)
        for st, k in zip(states, lens):
            self._caught_up(st, k)
        return rows[:n], (hidden[:n] if hidden is not None else None)


def roots_of(reqs: list, device) -> torch.Tensor:
    """Each request's last committed token, on the device (no host sync)."""
    return to_device([r.last_id for r in reqs], device)
