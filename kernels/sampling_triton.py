"""Speculative sampling over a draft tree in Triton: one program per request.

The walk over the tree is scalar (one depth, one sibling at a time, bounded by N so a malformed
sibling list cannot hang the GPU); the residual target distribution lives in a [bs, V] fp32
scratch row as `residual / mass`, and each rejection rewrites it in one blocked pass over V.
While no sibling has been rejected at the current node the residual is the target row itself,
read in place (`fresh`). Rejected siblings are removed from the draft row by dividing it by the
mass left (`draft_mass`) instead of zeroing them: the residual is already 0 at those tokens
(rejection needs p(x) < q(x)), so relu(p - q) is the same either way.

NOTE: a scalar load after a pass may read a lane another thread wrote, hence the barrier that
ends each pass. The launcher never reads tensor values on the host, so it can be captured in a
CUDA graph (after a warm-up call has compiled the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TINY = tl.constexpr(1e-30)  # as in sampling.py: an all-zero residual stays 0, not NaN


@triton.jit
def _residual_pass(src_ptr, dst_ptr, draft_row_ptr, mass, draft_mass, token, vocab_size,
                   HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """dst = relu(src / mass - draft_row / draft_mass) (or src / mass with `token` zeroed when
    there is no draft row); returns sum(dst). src may be dst (each lane reads, then writes)."""
    total = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab_size
        p = tl.load(src_ptr + offs, mask=in_vocab, other=0.0) / mass
        if HAS_DRAFT:
            q = tl.load(draft_row_ptr + offs, mask=in_vocab, other=0.0) / draft_mass
            residual = tl.maximum(p - q, 0.0)
        else:
            residual = tl.where(offs == token, 0.0, p)
        tl.store(dst_ptr + offs, residual, mask=in_vocab)
        total += tl.sum(residual, axis=0)
    tl.debug_barrier()
    return total


@triton.jit
def _sample_row(row_ptr, coin, vocab_size, BLOCK_V: tl.constexpr):
    """Inverse-CDF sample of a non-negative row (need not sum to 1); -1 if it has no mass.
    Same rule as sampling.sample_inverse_cdf: the first token with mass whose CDF passes
    coin * total, else the last token with mass."""
    total = 0.0
    last_positive = -1
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        r = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0)
        total += tl.sum(r, axis=0)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(r > 0, offs, -1), axis=0))
    threshold = coin * total
    carry = 0.0
    picked = vocab_size
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        r = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0)
        hit = (r > 0) & (carry + tl.cumsum(r, axis=0) > threshold)
        picked = tl.minimum(picked, tl.min(tl.where(hit, offs, vocab_size), axis=0))
        carry += tl.sum(r, axis=0)
    return tl.where(picked < vocab_size, picked, last_positive)


@triton.jit
def _try_children(tokens_ptr, next_sibling_ptr, coins_ptr, draft_ptr, target_row_ptr,
                  residual_row_ptr, row, child, fresh, mass, num_nodes, vocab_size,
                  HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Tries `child` and its next siblings in order against the residual target at their
    parent (target_row if fresh, else residual_row / mass) -> (the accepted child or -1, fresh,
    mass): the residual left at the parent."""
    # Siblings share their draft row (the first child's); rejected ones leave it.
    draft_row_ptr = draft_ptr + (row + tl.maximum(child, 0)) * vocab_size
    draft_mass = 1.0
    found = -1
    for _ in range(0, num_nodes):
        if (child >= 0) & (found < 0):
            token = tl.load(tokens_ptr + row + child)
            p_row_ptr = residual_row_ptr
            if fresh != 0:
                p_row_ptr = target_row_ptr
            p_token = tl.load(p_row_ptr + token) / mass
            q_token = 1.0
            if HAS_DRAFT:
                q_token = tl.load(draft_row_ptr + token) / draft_mass
            if tl.load(coins_ptr + row + child) * q_token < p_token:
                found = child
            else:
                total = _residual_pass(p_row_ptr, residual_row_ptr, draft_row_ptr, mass,
                                       draft_mass, token, vocab_size, HAS_DRAFT, BLOCK_V)
                mass = tl.maximum(total, TINY)
                fresh = 0
                if HAS_DRAFT:
                    draft_mass = tl.maximum(draft_mass - tl.load(draft_row_ptr + token), TINY)
                child = tl.load(next_sibling_ptr + row + child).to(tl.int32)
    return found, fresh, mass


@triton.jit
def _verify_sampling_kernel(
    tokens_ptr, first_child_ptr, next_sibling_ptr, target_ptr, draft_ptr, coins_ptr,
    final_coins_ptr, residual_ptr, accept_index_ptr, accept_len_ptr, bonus_ptr,
    num_nodes, vocab_size, max_depth,
    HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program: the accepted path and bonus of request `req` (accept_index arrives -1)."""
    req = tl.program_id(0).to(tl.int64)
    row = req * num_nodes  # this request's nodes in every [bs, N] tensor
    residual_row_ptr = residual_ptr + req * vocab_size
    accept_row_ptr = accept_index_ptr + req * (max_depth + 1)
    tl.store(accept_row_ptr, 0)  # the root is always on the path
    cur = 0
    num_accepted = 0
    searching = 1  # 0 once a level had no accepted child
    fresh = 1  # 1: the residual is target_probs[cur]; 0: residual_row / mass
    mass = 1.0
    for depth in range(1, max_depth + 1):
        child = tl.load(first_child_ptr + row + cur).to(tl.int32)
        child = tl.where(searching != 0, child, -1)
        target_row_ptr = target_ptr + (row + cur) * vocab_size
        found, fresh, mass = _try_children(
            tokens_ptr, next_sibling_ptr, coins_ptr, draft_ptr, target_row_ptr,
            residual_row_ptr, row, child, fresh, mass, num_nodes, vocab_size, HAS_DRAFT, BLOCK_V)
        if found >= 0:
            tl.store(accept_row_ptr + depth, found.to(tl.int64))
            cur = found
            num_accepted += 1
            fresh = 1
            mass = 1.0
        else:
            searching = 0
    tl.store(accept_len_ptr + req, num_accepted.to(tl.int64))

    coin = tl.load(final_coins_ptr + req)
    target_row_ptr = target_ptr + (row + cur) * vocab_size
    p_row_ptr = residual_row_ptr
    if fresh != 0:
        p_row_ptr = target_row_ptr
    bonus = _sample_row(p_row_ptr, coin, vocab_size, BLOCK_V)
    if bonus < 0:  # an all-zero residual had zero probability of being reached
        bonus = _sample_row(target_row_ptr, coin, vocab_size, BLOCK_V)
    tl.store(bonus_ptr + req, bonus.to(bonus_ptr.dtype.element_ty))


def verify_sampling_triton(draft_tokens: torch.Tensor, first_child: torch.Tensor,
                           next_sibling: torch.Tensor, target_probs: torch.Tensor,
                           draft_probs: torch.Tensor | None, coins: torch.Tensor,
                           final_coins: torch.Tensor, accept_index: torch.Tensor,
                           accept_len: torch.Tensor, bonus: torch.Tensor) -> None:
    """Inputs contiguous: [bs, N] tree tensors (first_child, next_sibling int64), fp32
    target_probs / draft_probs [bs, N, V] (draft_probs may be None), fp32 coins [bs, N] and
    final_coins [bs]; accept_index [bs, max_depth + 1] int64 filled with -1. Writes
    accept_index, accept_len [bs] int64 and bonus [bs]."""
    bs, num_nodes, vocab_size = target_probs.shape
    if bs == 0:
        return
    residual = torch.empty(bs, vocab_size, dtype=torch.float32,
                           device=target_probs.device)  # [bs, V] scratch
    has_draft = draft_probs is not None
    _verify_sampling_kernel[(bs,)](
        draft_tokens, first_child, next_sibling, target_probs,
        draft_probs if has_draft else target_probs,  # unused without a draft; any pointer
        coins, final_coins, residual, accept_index, accept_len, bonus,
        num_nodes, vocab_size, accept_index.shape[1] - 1,
        HAS_DRAFT=has_draft, BLOCK_V=min(triton.next_power_of_2(vocab_size), 1024),
        num_warps=4,
    )
