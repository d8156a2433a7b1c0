"""The ring a target's plain decode steps write a draft head's hidden rows into.

A head catches up on the target's hidden states at every position it missed; in plain steps
the step's graph writes them here, at [request's pool row, position % depth]
(kernels/hidden_ring.py), and the head reads a stretch of them back, in order, when it needs
them or before the ring wraps (drafts/plain_log.py). SPECPCG_HIDDEN_RING=0 turns it off: the
rows are then copied out after each step, as after a decode step the piecewise runner serves.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from kernels.hidden_ring import write_ring
from kernels.topk import argmax_rows
from specpcg.transfer import to_device

DEPTH = 64  # plain steps between two reads at most: one gather per 64 steps of a batch
MIN_DEPTH = 8  # below this the ring is not made (its reads would come too often)
MAX_BYTES = 256 * 2**20  # what the ring may take; a wider row gets a shallower ring


class HiddenRing:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device, depth: int = DEPTH):
        """rows: the request pool's rows, its padding row among them; width: a step's hidden
        row (the aux layers' side by side)."""
        self.depth, self.width = depth, width
        self.buf = torch.zeros(rows, depth, width, dtype=dtype, device=device)
        self._steps = {}  # steps -> arange(steps) on the device
        self.warm()

    def warm(self) -> None:
        """One read now, of the first row (its output dropped). NOTE: a process's first read
        took 18-35 ms on an H100 against 0.24-0.64 later, nearly all of it the index arithmetic
        (8e39105, d6e54e1: probe_first_look.py --cold), and it comes in the first switch from
        plain steps into speculation, whose cost adaptive speculation prices its next looks by
        (speculative/switches.py)."""
        self.read([0], [0], 1)

    @classmethod
    def for_draft(cls, ctx, aux_layers: int) -> Optional["HiddenRing"]:
        """The ring of a head reading `aux_layers` layers (0: the last) of the target in
        DraftContext ctx, as deep as MAX_BYTES allows (at most DEPTH), or None: turned off,
        under parallelism (plain steps hand their rows over after the step), or too shallow."""
        if os.environ.get("SPECPCG_HIDDEN_RING", "1") == "0" or ctx.parallel is not None:
            return None
        rows = ctx.kv_cache.req_pool.req_to_token.shape[0]
        width = ctx.model_config.hidden_size * max(1, aux_layers)
        per_step = rows * width * torch.empty((), dtype=ctx.dtype).element_size()
        depth = min(DEPTH, MAX_BYTES // per_step)
        return cls(rows, width, ctx.dtype, ctx.device, depth) if depth >= MIN_DEPTH else None

    def write(self, sources: list, positions: torch.Tensor, pool_rows: torch.Tensor,
              logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode step's rows (sources: [n, H] each), inside its graph or eagerly. With
        `logits` ([n, V]), the greedy pick's launch writes them (kernels/topk.argmax_rows),
        whose picks come back; else None."""
        if logits is None:
            write_ring(self.buf, sources, positions, pool_rows)
            return None
        return argmax_rows(logits, ring=(self.buf, sources, positions, pool_rows))

    def read(self, pool_rows: list, first: list, steps: int) -> torch.Tensor:
        """[n, steps, W]: request i's rows at positions first[i] .. first[i] + steps - 1, which
        the last `steps` plain steps wrote (steps <= depth)."""
        if not 0 < steps <= self.depth:
            raise ValueError(f"steps={steps}: a read covers 1 to {self.depth} steps")
        arange = self._steps.get(steps)
        if arange is None:
            arange = self._steps[steps] = torch.arange(steps, device=self.buf.device)
        start = to_device([[r * self.depth for r in pool_rows], first], self.buf.device)
        index = start[0, :, None] + (start[1, :, None] + arange) % self.depth
        flat = self.buf.view(-1, self.width)
        return flat.index_select(0, index.view(-1)).view(len(pool_rows), steps, self.width)
