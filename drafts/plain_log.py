"""A head's log of the target's plain decode steps over one unchanged batch: the hidden rows
it catches up on when speculation resumes. Handed to the requests (one piece each) only when
the batch changes or the draft needs them: a plain step then costs no work per request. Split
per request every step, the floor of an engine with a head ran 0.94x no-spec at batch 64
(EAGLE3, H200, 4087e7e), and 1.04x logged whole (180be28)."""

from __future__ import annotations

import torch


class TensorLog:
    """The steps' rows as tensors of their own (a copy made after each step)."""

    def __init__(self, rids: list, states: list):
        self.rids, self.states, self.steps = rids, states, []

    def __len__(self) -> int:
        return len(self.steps)

    def hand_over(self) -> None:
        if not self.steps:
            return
        rows = torch.stack(self.steps, dim=1)  # [bs, steps, H']
        for st, mine in zip(self.states, rows):
            st.pending.append(mine)


class RingLog:
    """The steps' rows where each step's graph wrote them (specpcg/hidden_ring.py): a count.
    Full once it spans the ring's depth: the next step would overwrite its first."""

    def __init__(self, reqs: list, states: list, ring):
        """reqs: the batch at its first step, each at the position that step wrote."""
        self.reqs, self.states, self.ring = list(reqs), states, ring
        self.rids = [r.rid for r in reqs]
        self.pool_rows = [r.req_pool_idx for r in reqs]
        self.first, self.steps = [r.num_cached for r in reqs], 0

    def __len__(self) -> int:
        return self.steps

    @property
    def full(self) -> bool:
        return self.steps >= self.ring.depth

    def hand_over(self) -> None:
        if not self.steps:
            return
        rows = self.ring.read(self.pool_rows, self.first, self.steps)  # [bs, steps, H']
        for st, mine in zip(self.states, rows):
            st.pending.append(mine)
