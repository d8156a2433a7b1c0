"""The draft trainer's cross-entropy against the target's top-k distribution, in row chunks.

loss = -sum over rows r, entries j of p[r, j] * log_softmax(hidden[r] @ weight.T)[ids[r, j]]

Rows without a label carry p = 0; a hard label is k = 1 with p = 1. The gradient is taken in
the same pass as the loss, chunk by chunk (d loss / d logits = softmax * sum(p) - p at the ids),
so no [rows, vocab] tensor outlives its chunk and nothing is recomputed in backward.

NOTE: the autograd form it replaces kept each step's logits for backward under a checkpoint, so
a full-vocabulary head (EAGLE, NEXTN: 49,152 ids) built, recomputed and walked [rows, vocab]
tensors about a dozen times a step; at 32,768-token batches NEXTN's steps took twice EAGLE3's
(8,192 ids) on the H100 (benchmarks/results/train12/).
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 4096  # a 49,152-id chunk of fp32 logits: 0.8 GB


class _ChunkedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, probs, chunk_rows: int):
        w = weight.to(hidden.dtype)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros_like(w) if weight.requires_grad else None
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        total = hidden.new_zeros((), dtype=acc)
        for start in range(0, hidden.shape[0], chunk_rows):
            h, i, p = (t[start:start + chunk_rows] for t in (hidden, ids, probs))
            p = p.to(acc)
            logp = torch.log_softmax((h @ w.T).to(acc), dim=-1)
            total -= (p * logp.gather(1, i)).sum()
            grad = logp.exp_().mul_(p.sum(1, keepdim=True)).scatter_add_(1, i, -p).to(w.dtype)
            grad_h[start:start + chunk_rows] = grad @ w
            if grad_w is not None:
                grad_w.addmm_(grad.T, h)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype)
        return grad_h * grad_out, gw, None, None, None


def soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       soft_ids=None, soft_probs=None, chunk_rows: int = CHUNK_ROWS):
    """Summed cross-entropy of hidden [R, H] @ weight [V, H].T against the target's top-k
    (soft_ids [R, k], -1 outside the vocabulary, soft_probs [R, k]) or, without them, its argmax
    `labels` [R]; rows whose label is -1 count nothing."""
    valid = (labels >= 0).to(hidden.dtype)[:, None]
    if soft_ids is None:
        ids, probs = labels.clamp(min=0)[:, None], valid
    else:
        ids, probs = soft_ids.clamp(min=0), soft_probs.to(hidden.dtype) * valid
    return _ChunkedSoftCE.apply(hidden, weight, ids, probs, chunk_rows)
