"""Speculative sampling over a draft tree (temperature > 0): accept drafts, sample the bonus.

Tree layout and outputs: see tree.py and verify.py (`VerifyResult`; `bonus` here is sampled,
with draft_tokens' dtype). Inputs per request, N nodes, vocabulary V:

- target_probs [bs, N, V]: the target's distribution for the token after node i, already
  temperature / top-k / top-p processed (rows sum to 1);
- draft_probs [bs, N, V] or None: row i = the distribution node i was drawn from, i.e. the
  draft's distribution at parent(i). Siblings are drawn from one distribution without
  replacement, so their rows are equal and their tokens distinct; the first child's row is used;
- coins [bs, N] uniform in [0, 1): coins[b, i] decides node i (coins[b, 0] is unused);
- final_coins [bs] uniform in [0, 1): samples the bonus token by inverse CDF.

The walk: cur = 0 (the root), p = target_probs[cur]. Try the children of cur in sibling order.

- With draft_probs (recursive rejection sampling without replacement): q = the siblings' draft
  row. Accept child token x iff coin * q(x) < p(x), i.e. with probability min(1, p(x) / q(x)).
  On rejection p <- norm(relu(p - q)) and q <- norm(q with x removed), then the next sibling.
- Target-only (draft_probs None, drafts chosen without looking at the coins, e.g. top-k): accept
  x iff coin < p(x); on rejection p <- norm(p with x zeroed). This is the rule above with q the
  one-hot of x.

An accepted child becomes cur (p = its target row) and the walk goes one level down; when no
child of cur is accepted, or max_depth drafts are accepted, the bonus is drawn from p.

Why the target distribution is preserved: for the children tried at one node, by induction from
the last one: if whatever follows a rejection emits a token distributed as the residual p', a
trial emits x with probability min(p(x), q(x)) (x ~ q, kept w.p. min(1, p/q)) and rejects with
probability sum(relu(p - q)), after which p' = norm(relu(p - q)) is emitted; the total is
min(p, q) + relu(p - q) = p, whatever q was. The next sibling is drawn from the q with x removed,
and p' is zero at x (rejection needs p(x) < q(x)), so the induction holds; the last step, the
bonus, is drawn from p' itself. Target-only is the case q = one-hot(x): accept w.p. p(x), and
relu(p - one-hot(x)) zeroes x. Once a child is accepted, the tokens after it are drawn the same
way from the target rows along the path, so every emitted token follows the target.

The Triton kernel (sampling_triton.py) runs one program per request and keeps the residual p in
a [bs, V] scratch buffer; it removes rejected siblings from q by tracking their mass (p is
already 0 at those tokens), which the twin does literally.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module
from .verify import VerifyResult, check_tree_inputs

TINY = 1e-30  # keeps an all-zero residual at zero instead of NaN; it is then never sampled


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(dim=-1, keepdim=True).clamp(min=TINY)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t: [bs, M], index: [bs] -> t[b, index[b]]: [bs]."""
    return t.gather(1, index[:, None])[:, 0]


def sample_inverse_cdf(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """probs: [bs, V] non-negative (need not sum to 1), coins: [bs] in [0, 1) -> [bs] int64:
    the first token with mass whose CDF passes coin * total; -1 when a row has no mass."""
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    threshold = coins * probs.sum(dim=-1)  # [bs]
    hit = (probs > 0) & (probs.cumsum(dim=-1) > threshold[:, None])  # [bs, V]
    first = torch.where(hit, vocab, probs.shape[-1]).amin(dim=-1)
    # Rounding can leave coin * total just above the last CDF value: take the last token with mass.
    last_positive = torch.where(probs > 0, vocab, -1).amax(dim=-1)
    return torch.where(first < probs.shape[-1], first, last_positive)


def _reject(p, q, token, rejected):
    """Residual update of the rows where `rejected`: p <- norm(relu(p - q)), q <- q without the
    token (with q None, the target-only rule: p <- norm(p without the token))."""
    if q is None:
        residual = _normalize(p.scatter(1, token[:, None], 0.0))
    else:
        residual = _normalize((p - q).clamp(min=0))
        q = torch.where(rejected[:, None], _normalize(q.scatter(1, token[:, None], 0.0)), q)
    return torch.where(rejected[:, None], residual, p), q


def verify_sampling_torch(draft_tokens, first_child, next_sibling, target_probs, draft_probs,
                          coins, final_coins, max_depth: int) -> VerifyResult:
    """The twin: the walk above, batched over requests (one depth, one sibling step at a time)."""
    bs, num_nodes = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(bs, device=device)
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.int64,
                              device=device)  # [bs, max_depth + 1]
    accept_index[:, 0] = 0
    cur = torch.zeros(bs, dtype=torch.int64, device=device)  # [bs] last accepted node
    searching = torch.ones(bs, dtype=torch.bool, device=device)  # [bs] nothing rejected yet
    p = target_probs[:, 0].clone()  # [bs, V] residual target distribution at cur
    for depth in range(1, max_depth + 1):
        child = torch.where(searching, _gather(first_child, cur), -1)
        q = None if draft_probs is None else draft_probs[rows, child.clamp(min=0)]  # [bs, V]
        found = torch.full_like(cur, -1)
        for _ in range(num_nodes - 1):  # a node has at most N - 1 children
            live = (child >= 0) & (found < 0)
            if not live.any():  # a host sync, worth it on CPU: most nodes have few children
                break
            safe = child.clamp(min=0)
            token = _gather(draft_tokens, safe).to(torch.int64)
            q_token = 1.0 if q is None else _gather(q, token)
            accepted = live & (_gather(coins, safe) * q_token < _gather(p, token))
            rejected = live & ~accepted
            found = torch.where(accepted, child, found)
            p, q = _reject(p, q, token, rejected)
            child = torch.where(rejected, _gather(next_sibling, safe), child)
        searching &= found >= 0
        accept_index[:, depth] = torch.where(searching, found, -1)
        cur = torch.where(searching, found, cur)
        p = torch.where(searching[:, None], target_probs[rows, cur], p)
    accept_len = (accept_index >= 0).sum(dim=1) - 1
    bonus = sample_inverse_cdf(p, final_coins)
    # An all-zero residual had zero probability of being reached; fall back to the target row.
    fallback = sample_inverse_cdf(target_probs[rows, cur], final_coins)
    bonus = torch.where(bonus >= 0, bonus, fallback).to(draft_tokens.dtype)
    return VerifyResult(accept_index, accept_len, bonus)


def _check_sampling_inputs(draft_tokens, target_probs, draft_probs, coins, final_coins):
    bs, num_nodes = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (bs, num_nodes):
        raise ValueError(f"target_probs must be [{bs}, {num_nodes}, V], "
                         f"got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must be {tuple(target_probs.shape)} or None, "
                         f"got {tuple(draft_probs.shape)}")
    if coins.shape != (bs, num_nodes):
        raise ValueError(f"coins must be [{bs}, {num_nodes}], got {tuple(coins.shape)}")
    if final_coins.shape != (bs,):
        raise ValueError(f"final_coins must be [{bs}], got {tuple(final_coins.shape)}")


def verify_sampling(draft_tokens: torch.Tensor, first_child: torch.Tensor,
                    next_sibling: torch.Tensor, target_probs: torch.Tensor,
                    draft_probs: torch.Tensor | None, coins: torch.Tensor,
                    final_coins: torch.Tensor, max_depth: int | None = None, *,
                    use_triton: bool | None = None) -> VerifyResult:
    """draft_tokens, first_child, next_sibling: [bs, N] (tree.Tree's fields); target_probs,
    draft_probs: [bs, N, V] or draft_probs None; coins: [bs, N]; final_coins: [bs] (see the
    module docstring). max_depth: the deepest draft level (default N - 1, always enough).
    Probabilities and coins are used in fp32."""
    max_depth = check_tree_inputs(draft_tokens, first_child, next_sibling, max_depth)
    _check_sampling_inputs(draft_tokens, target_probs, draft_probs, coins, final_coins)
    first_child, next_sibling = first_child.to(torch.int64), next_sibling.to(torch.int64)
    target_probs, coins, final_coins = target_probs.float(), coins.float(), final_coins.float()
    draft_probs = None if draft_probs is None else draft_probs.float()
    if not pick_triton(draft_tokens, use_triton):
        return verify_sampling_torch(draft_tokens, first_child, next_sibling, target_probs,
                                     draft_probs, coins, final_coins, max_depth)
    bs = draft_tokens.shape[0]
    device = draft_tokens.device
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.int64,
                              device=device)  # [bs, max_depth + 1]
    accept_len = torch.empty(bs, dtype=torch.int64, device=device)  # [bs]
    bonus = torch.empty(bs, dtype=draft_tokens.dtype, device=device)  # [bs]
    triton_module("sampling_triton").verify_sampling_triton(
        draft_tokens.contiguous(), first_child.contiguous(), next_sibling.contiguous(),
        target_probs.contiguous(), None if draft_probs is None else draft_probs.contiguous(),
        coins.contiguous(), final_coins.contiguous(), accept_index, accept_len, bonus)
    return VerifyResult(accept_index, accept_len, bonus)
