"""What every draft worker declares and does. Algorithm differences are data, not branches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specpcg.core import CaptureHiddenMode


@dataclass
class Proposal:
    """Per request, N = num_draft_tokens nodes; node 0 is the root (the last committed token)."""

    draft_tokens: torch.Tensor  # [bs, N] int64
    parents: Optional[torch.Tensor] = None  # [bs, N] int64 for trees; None for a chain
    draft_probs: Optional[torch.Tensor] = None  # [bs, N, V] q at each node's parent, or None


class DraftWorker:
    name = "base"
    needs_hidden = CaptureHiddenMode.NULL  # the most the target's forwards must capture for us
    aux_layers: tuple = ()
    builds_piecewise = False  # invariant 5: drafts use decode graphs only
    # Rounds that run from device state alone (specpcg/speculative/overlap.py): a draft that
    # sets it provides step_round, overlap_ready, device_path, draft_rows, resolved and trim.
    supports_overlap = False

    def can_catch_up_to_paths(self, reqs: list) -> bool:
        """Where overlap_ready is False: whether catch_up_to_paths can bring the draft to a
        state an overlapped step starts from, once the step in flight (if any) is read. The
        slots it takes are the overlapped step's own shortfall's (SpecOverlap.usable)."""
        return False

    def catch_up_to_paths(self, reqs: list) -> None:
        """Does the part of the catch-up an overlapped step's graph does not: afterwards each
        request's catch-up is one verify's path (overlap_ready)."""
        raise NotImplementedError

    def propose(self, reqs: list, spec) -> Proposal:
        raise NotImplementedError

    def catch_up_positions(self, reqs: list) -> Optional[int]:
        """The positions these requests' next round would first catch up on (what a switch
        from plain steps into speculation costs: specpcg/speculative/switches.py); None: the
        draft has no catch-up that grows with them (NGRAM)."""
        return None

    @property
    def overlap_context_len(self) -> int:
        """The longest request whose steps can overlap: the draft's own cache's context."""
        return self.kv_cache.req_pool.max_context_len

    def commit(self, reqs: list, accept_lens: list, hidden_paths=None) -> None:
        """After verify: `accept_lens[i]` drafts of request i were accepted. hidden_paths (drafts
        that need hidden states): [bs, N, H'], whose row i starts with the target's hidden
        states at the root and those drafts, accept_lens[i] + 1 rows."""

    def target_hidden(self, out, own: bool = False) -> torch.Tensor:
        """The rows of a target forward's output this draft reads (final or aux layers). own:
        a tensor of their own, which the next replay of a graph does not overwrite (the aux
        layers' concatenation is one already: no second copy)."""
        if self.aux_layers:
            return torch.cat(out.aux_hidden_states, dim=-1)
        return out.hidden_states.clone() if own else out.hidden_states

    def absorb(self, req, hidden: torch.Tensor) -> None:
        """Target hidden states of the request's next positions (prefill chunks), in order."""

    def absorb_rows(self, reqs: list, hidden: torch.Tensor) -> None:
        """A plain decode step's hidden states (`target_hidden(out, own=True)`): row i is
        request i's next position."""
        for i, req in enumerate(reqs):
            self.absorb(req, hidden[i:i + 1])

    def release(self, req) -> None:
        """The request finished or was preempted: drop its draft state."""

    def info(self) -> dict:
        return {"name": self.name}
