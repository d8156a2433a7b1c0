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
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module

MAX_TRITON_K = 16  # unrolled per entry; wider k goes to the twin


def topk_rows_torch(x: torch.Tensor, k: int, log_softmax: bool) -> tuple:
    """The twin: (indices int64 [..., k], values fp32 [..., k]) of the k largest entries of
    each row of x [..., V] (of log_softmax(x) when log_softmax)."""
    x = x.float()
    top = (x.log_softmax(-1) if log_softmax else x).topk(k, dim=-1)
    return top.indices, top.values


def topk_rows(x: torch.Tensor, k: int, log_softmax: bool = False,
              use_triton: bool | None = None) -> tuple:
    """(indices int64 [..., k], values fp32 [..., k]): the k largest entries of each row of
    x [..., V], of log_softmax(x) when `log_softmax`. Never reads tensor values on the host
    (CUDA-graph safe)."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k must be in [1, {x.shape[-1]}] (the row length), got {k}")
    if not pick_triton(x, use_triton) or k > MAX_TRITON_K:
        return topk_rows_torch(x, k, log_softmax)
    return triton_module("topk_triton").topk_rows_triton(x, k, log_softmax)
