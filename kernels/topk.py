"""The k best entries of each row, optionally as log-probabilities: a draft tree's expansion.

An EAGLE-2 tree step takes, for every branch, the k most likely next tokens and their
log-probabilities (`log_softmax(logits).topk(k)`), then the k best of the k * k candidates. On the
GPU torch runs that as a softmax kernel and a radix select of about 16 kernels over the whole
vocabulary: at batch 16 with a (5, 4, 8) tree, 80-90 us of a tree step's 270 (H200,
benchmarks/results/step_eagle3_bs16_548_a2694f5_h200.txt). The Triton version (topk_triton.py)
takes a row's chunks in parallel, each keeping its own k best and its log-sum-exp in registers,
then merges them: two kernels, one when a row fits one chunk.

Order: the k entries come largest first; equal values come lowest index first (the Triton
kernel's rule; the twin's torch.topk agrees except where values tie exactly, which logits of a
trained head or sums of its log-probabilities practically never do, and a tie only changes which
of two equally likely drafts is tried). Values are fp32.

`index_map` ([V] int64) returns index_map[i] in place of each index i: a draft head's logits over
its own smaller vocabulary come back as target ids (its d2t table) without a scatter into a
target-vocabulary row or a gather after the top-k, one kernel fewer each.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module
from .hidden_ring import check_sources, write_ring

MAX_TRITON_K = 16  # unrolled per entry; wider k goes to the twin


def topk_rows_torch(x: torch.Tensor, k: int, log_softmax: bool, index_map=None) -> tuple:
    """The twin: (indices int64 [..., k], values fp32 [..., k]) of the k largest entries of
    each row of x [..., V] (of log_softmax(x) when log_softmax; indices through index_map)."""
    x = x.float()
    top = (x.log_softmax(-1) if log_softmax else x).topk(k, dim=-1)
    ids = top.indices if index_map is None else index_map[top.indices]
    return ids, top.values


def topk_rows(x: torch.Tensor, k: int, log_softmax: bool = False,
              use_triton: bool | None = None, index_map: torch.Tensor | None = None) -> tuple:
    """(indices int64 [..., k], values fp32 [..., k]): the k largest entries of each row of
    x [..., V], of log_softmax(x) when `log_softmax`; index_map: [V] int64, indices come back
    as index_map[index]. Never reads tensor values on the host (CUDA-graph safe)."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k must be in [1, {x.shape[-1]}] (the row length), got {k}")
    if index_map is not None and (index_map.shape != (x.shape[-1],)
                                  or index_map.dtype != torch.int64):
        raise ValueError(f"index_map must be [{x.shape[-1]}] int64, got "
                         f"{tuple(index_map.shape)} {index_map.dtype}")
    if not pick_triton(x, use_triton) or k > MAX_TRITON_K:
        return topk_rows_torch(x, k, log_softmax, index_map)
    return triton_module("topk_triton").topk_rows_triton(x, k, log_softmax, index_map)


def argmax_rows(x: torch.Tensor, use_triton: bool | None = None,
                ring: tuple | None = None) -> torch.Tensor:
    """[...] int64: the index of each row's largest entry of x [..., V], the lowest on ties
    (torch.argmax's rule, and the top-k kernel's), read from bf16 as well as fp32 rows. On the
    GPU it is the top-k kernel's two passes: torch's reduction over the default model's 49,152
    logits took 13 us for a batch-1 verify's 12 rows, the kernel's chunks run side by side.
    ring: (ring, sources, positions, pool rows), kernels.hidden_ring.write_ring's arguments
    for x [n, V]'s n rows, written by the same launch (a decode graph's last kernel less)."""
    if ring is not None:
        check_sources(ring[0], ring[1])
        if ring[1][0].shape[0] != x[..., 0].numel():
            raise ValueError(f"the ring's sources have {ring[1][0].shape[0]} rows, the picks "
                             f"{x[..., 0].numel()}")
    if not pick_triton(x, use_triton):
        if ring is not None:
            write_ring(*ring, use_triton=False)
        return x.argmax(-1)
    return triton_module("topk_triton").topk_rows_triton(x, 1, False, ring=ring)[0][..., 0]
