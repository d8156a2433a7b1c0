"""A plain decode step's hidden rows for a draft head, written into a ring inside the step.

A head (EAGLE, EAGLE3, NEXTN) catches up on the target's hidden states of every position it
missed while the engine decoded plain. Those rows are graph outputs, overwritten by the next
replay, so each plain step used to copy them out after the replay: for EAGLE3 a concatenation
of three layers' rows, one more launch and its host work in every step of an engine whose draft
does not pay (about 8 us a step at batch 1 on an H200, docs/PERFORMANCE.md). Here the step
itself writes its rows to ring[pool row, position % depth]: nothing is launched outside the
graph, and a request's missed rows are read back (`specpcg/hidden_ring.py`) when the draft
needs them or before the ring wraps. Where the step's graph takes its greedy pick
(kernels/topk.argmax_rows with `ring`), the pick's first kernel writes the rows as well: one
launch fewer a step.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module


def ring_index(positions: torch.Tensor, pool_rows: torch.Tensor, depth: int) -> torch.Tensor:
    """Each row's entry in the ring viewed as [rows * depth, W] (the twin's arithmetic)."""
    return pool_rows.long() * depth + positions.long() % depth


def check_sources(ring: torch.Tensor, sources: list) -> None:
    """Raises unless `sources` ([n, H] each) fill a row of `ring` ([rows, depth, W]) side by
    side."""
    if not 1 <= len(sources) <= 3:
        raise ValueError(f"1 to 3 sources, got {len(sources)}")
    n, h = sources[0].shape
    if len(sources) * h != ring.shape[-1] or any(s.shape != (n, h) for s in sources):
        raise ValueError(f"sources {[tuple(s.shape) for s in sources]} do not fill a ring row "
                         f"of {ring.shape[-1]}")


def write_ring(ring: torch.Tensor, sources: list, positions: torch.Tensor,
               pool_rows: torch.Tensor, use_triton: bool | None = None) -> None:
    """ring: [rows, depth, W]; sources: [n, H] each (len(sources) * H == W), row i of each
    written, side by side, to ring[pool_rows[i], positions[i] % depth]. Never reads tensor
    values on the host (CUDA-graph safe)."""
    check_sources(ring, sources)
    rows, depth, width = ring.shape
    n = sources[0].shape[0]
    if not pick_triton(ring, use_triton):
        index = ring_index(positions[:n], pool_rows[:n], depth)
        ring.view(rows * depth, width).index_copy_(0, index, torch.cat(sources, dim=-1))
        return
    triton_module("hidden_ring_triton").write_ring_triton(ring, sources, positions, pool_rows)
