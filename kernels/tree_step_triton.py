"""kernels/tree_step.py's advance_tree in Triton: one program per request.

The program loads the step's K * K children once, writes them and their path scores into the
tree's grids, then picks the K best in K rounds of a max over what is left (lowest index on
ties, as kernels.topk does), writing each pick's score, token, parent branch and ancestry row
as it goes. The launcher never reads tensor values on the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tree_step import Branches


@triton.jit
def _advance_kernel(
    top_ids_ptr, top_logp_ptr, scores_ptr, anc_ptr,
    cand_tokens_ptr, cand_scores_ptr, branch_parents_ptr,
    scores_out_ptr, tokens_out_ptr, parent_out_ptr, anc_out_ptr,
    s, stride_ab, stride_ak, stride_af,
    S: tl.constexpr, K: tl.constexpr, F: tl.constexpr, LAST: tl.constexpr,
    BLOCK_KK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_KK)
    real = j < K * K
    ids = tl.load(top_ids_ptr + req * K * K + j, mask=real, other=0)
    logp = tl.load(top_logp_ptr + req * K * K + j, mask=real, other=0.0)
    path = tl.load(scores_ptr + req * K + j // K, mask=real, other=0.0)
    cand = tl.where(real, path + logp, float("-inf"))
    grid = req * S * K * K + s * K * K
    tl.store(cand_tokens_ptr + grid + j, ids, mask=real)
    tl.store(cand_scores_ptr + grid + j, cand, mask=real)
    if not LAST:
        left = real
        f = tl.arange(0, BLOCK_F)
        e = tl.arange(0, BLOCK_K)
        width = F + K
        for i in tl.static_range(K):
            best = tl.max(tl.where(left, cand, float("-inf")), axis=0)
            pick = tl.min(tl.where(left & (cand == best), j, BLOCK_KK), axis=0)
            left = left & (j != pick)
            branch = pick // K
            tl.store(scores_out_ptr + req * K + i, best)
            tl.store(tokens_out_ptr + req * K + i, tl.sum(tl.where(j == pick, ids, 0), axis=0))
            tl.store(parent_out_ptr + req * K + i, branch.to(tl.int64))
            tl.store(branch_parents_ptr + req * S * K + (s + 1) * K + i, pick.to(tl.int64))
            seen = tl.load(anc_ptr + req * stride_ab + branch * stride_ak + f * stride_af,
                           mask=f < F, other=0)
            row = anc_out_ptr + req * K * width + i * width
            tl.store(row + f, seen, mask=f < F)
            tl.store(row + F + e, (e == i).to(tl.uint8), mask=e < K)


def advance_tree_triton(cand_tokens, cand_scores, branch_parents, top_ids, top_logp, scores,
                        ancestors, s: int):
    bs, num_steps, k, _ = cand_tokens.shape
    last = s + 1 == num_steps
    fed = ancestors.shape[-1]
    device = cand_tokens.device
    if not all(t.is_contiguous() for t in (cand_tokens, cand_scores, branch_parents)):
        raise ValueError("the tree's candidate grids must be contiguous")
    out = None if last else Branches(
        torch.empty(bs, k, dtype=torch.float32, device=device),
        torch.empty(bs, k, dtype=cand_tokens.dtype, device=device),
        torch.empty(bs, k, dtype=torch.int64, device=device),
        torch.empty(bs, k, fed + k, dtype=torch.bool, device=device))
    anc = ancestors.view(torch.uint8) if ancestors.dtype == torch.bool else ancestors
    # A last step writes no branches: its kernel never touches these pointers.
    outs = (cand_scores,) * 4 if last else (out.scores, out.tokens, out.parent,
                                            out.ancestors.view(torch.uint8))
    if bs:
        _advance_kernel[(bs,)](
            top_ids.contiguous(), top_logp.contiguous(), scores.contiguous(), anc,
            cand_tokens, cand_scores, branch_parents, *outs, s, *anc.stride(),
            S=num_steps, K=k, F=fed, LAST=last,
            BLOCK_KK=max(triton.next_power_of_2(k * k), 2),
            BLOCK_K=max(triton.next_power_of_2(k), 2), BLOCK_F=max(triton.next_power_of_2(fed), 2),
            num_warps=1)
    return out
