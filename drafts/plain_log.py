"""A head's log of the target's plain decode steps over one unchanged batch: the hidden rows
it catches up on when speculation resumes. Handed to the requests (one piece each) when the
batch changes, the draft needs them or the log is full: a plain step then costs no work per
request. Split per request every step, the floor of an engine with a head ran 0.94x no-spec at
batch 64 (EAGLE3, H200, 4087e7e), and 1.04x logged whole (180be28).

A request's handed-over rows wait for speculation to resume, and a run of plain steps can last
as long as the answer: 3 x hidden x 2 bytes a position for EAGLE3 (about 24 KB on the 8B shape,
6 GB for 64 requests over 4,096 plain steps), none of it in the KV cache's budget. So once a
request holds more than PENDING_MAX rows, the head catches up on them as a log fills
(`fold_long`): the work its next speculative step would have done, done in pieces.
"""

from __future__ import annotations

import torch

# Rows a request may hold before the head catches up on them (about 24 MB a request on the
# 8B shape's EAGLE3 rows).
PENDING_MAX = 1024
# Plain steps a log of copied rows (no ring: under parallelism, or turned off) spans before
# it hands them over, as a ring of this depth would.
TENSOR_DEPTH = 64


class _Log:
    """Rows of the plain steps over one batch (`reqs`, the same Request objects in the same
    rows), for their requests' states; full once `depth` steps are logged."""

    def __init__(self, reqs: list, states: list):
        self.reqs, self.states = list(reqs), states

    @property
    def full(self) -> bool:
        return len(self) >= self.depth

    def hand_over(self) -> None:
        if len(self):
            for st, mine in zip(self.states, self.rows()):  # rows: [bs, steps, H']
                st.pending.append(mine)


class TensorLog(_Log):
    """The steps' rows as tensors of their own (a copy made after each step)."""

    def __init__(self, reqs: list, states: list):
        super().__init__(reqs, states)
        self.steps = []

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def depth(self) -> int:
        return TENSOR_DEPTH

    def rows(self) -> torch.Tensor:
        return torch.stack(self.steps, dim=1)


class RingLog(_Log):
    """The steps' rows where each step's graph wrote them (specpcg/hidden_ring.py): a count.
    Full once it spans the ring's depth: the next step would overwrite its first."""

    def __init__(self, reqs: list, states: list, ring):
        """reqs: the batch at its first step, each at the position that step wrote."""
        super().__init__(reqs, states)
        self.ring, self.depth = ring, ring.depth
        self.pool_rows = [r.req_pool_idx for r in reqs]
        self.first, self.steps = [r.num_cached for r in reqs], 0

    def __len__(self) -> int:
        return self.steps

    def rows(self) -> torch.Tensor:
        return self.ring.read(self.pool_rows, self.first, self.steps)


def fold_long(reqs: list, states: list, catch_up) -> None:
    """Catches the head up (`catch_up(reqs, states)`, which takes every pending row) on the
    rows of each request holding more than PENDING_MAX whose next token the host holds: a
    head position pairs a row with the token after it, and with overlap scheduling the last
    step's token, and the one before it, are still on the device."""
    folds = []
    for req, st in zip(reqs, states):
        held = sum(p.shape[0] for p in st.pending)
        known = min(held, req.seq_len - st.num_cached - 1)
        if held > PENDING_MAX and known > 0:
            folds.append((req, st, known))
    if not folds:
        return
    rest = []
    for _, st, known in folds:
        rows = torch.cat(st.pending)
        st.pending = [rows[:known]]
        rest.append(rows[known:])
    catch_up([req for req, _, _ in folds], [st for _, st, _ in folds])
    for (_, st, _), rows in zip(folds, rest):
        st.pending, st.verified = ([rows] if rows.shape[0] else []), None


class PlainSteps:
    """A head's handling of the target's plain steps (drafts/eagle.py's HeadDraft): their rows
    logged per batch, handed to the requests, and folded into the head past PENDING_MAX."""

    _plain = None  # TensorLog | RingLog: plain steps' rows not yet handed over

    def absorb_rows(self, reqs: list, hidden: torch.Tensor) -> None:
        # The step's own rows (target_hidden's own=True), logged whole while the batch stays
        # the same.
        log = self._plain
        if not isinstance(log, TensorLog) or log.reqs != reqs:
            self._hand_over()
            log = self._plain = TensorLog(reqs, [self._state(r) for r in reqs])
        log.steps.append(hidden)
        self._if_full(log)

    def absorb_ring(self, reqs: list) -> None:
        """A plain step wrote its rows to self.hidden_ring at each request's num_cached."""
        log = self._plain  # the same batch: the same Request objects in the same rows
        if not isinstance(log, RingLog) or log.reqs != reqs:
            self._hand_over()
            log = self._plain = RingLog(reqs, [self._state(r) for r in reqs], self.hidden_ring)
        log.steps += 1
        self._if_full(log)

    def _if_full(self, log) -> None:
        if log.full:
            self._hand_over()
            fold_long(log.reqs, log.states, self._eager_catch_up)

    def _hand_over(self) -> None:
        """Gives the plain steps' logged rows to their requests, before anything reads a
        request's pending rows (propose, overlap_ready, device_path). commit and resolved
        replace them only after one of those ran in the same step, with no plain step between."""
        if self._plain is not None:
            self._plain.hand_over()
            self._plain = None
