"""The end of an overlapped speculative step (specpcg/speculative/step_graph.py): what a verify
accepted, written where the next step and the host read it.

For every request: its accept length (0 for a padding row), the nodes in path order (the
accepted path first, root included, then the other nodes ascending: `order`), the verify's
tokens in that order, and, for a tree, its KV slots in that order too (req_to_token's columns
prefix .. prefix + N - 1), so the accepted path's KV sits at the verify's first positions, as
the host's keep_path does; then the state the next step reads (tokens, accept length, bonus,
prefix) and the row the host reads (accept length, bonus, tokens, order).

In torch that is about twenty small kernels (an argsort, scatters, gathers, an index_put and
the copies), 40-50 us of a batch-1 EAGLE3 (6, 4, 12) step on the H100
(benchmarks/results/step_eagle3_bs1_6412_b3898d0_h100.txt); the Triton kernel
(step_commit_triton.py) is one program per request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import pick_triton, triton_module


def path_tokens(nodes: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
                cols: torch.Tensor) -> torch.Tensor:
    """[bs, N] a verify's accepted path after its root: nodes[:, 1..m] (m = accept_len), then
    the bonus at column m, then anything. cols: arange(N) on the nodes' device."""
    return torch.where(cols == accept_len[:, None], bonus[:, None],
                       torch.cat([nodes[:, 1:], bonus[:, None]], 1))


class StepOutputs(NamedTuple):
    """Where a step's results go ([bs] or [bs, N] rows of the step state)."""

    tokens: torch.Tensor  # [bs, N] int64: the nodes' tokens, path order
    accept_len: torch.Tensor  # [bs] int64
    bonus: torch.Tensor  # [bs] int64
    prefix: torch.Tensor  # [bs] int64
    host_row: torch.Tensor  # [bs, 2 + 2N] int64: accept length, bonus, tokens, order


def path_first(accept_index: torch.Tensor, accept_len: torch.Tensor) -> torch.Tensor:
    """[bs, N] node indices: each request's accepted path (accept_index[:, :m + 1], root
    first), then its other nodes in ascending order."""
    bs, n = accept_index.shape
    cols = torch.arange(n, device=accept_index.device).expand(bs, n)
    on_path = cols <= accept_len[:, None]
    key = torch.full((bs, n + 1), n, dtype=torch.long, device=accept_index.device) + torch.arange(
        n + 1, device=accept_index.device)  # off the path: after every path node, in order
    key.scatter_(1, torch.where(on_path, accept_index.long(), n), cols)  # column n: a sink
    return key[:, :n].argsort(1)


def commit_step_torch(accept_index, accept_len, live, tokens, bonus, prefix, rows, req_to_token,
                      out: StepOutputs, tree: bool) -> torch.Tensor:
    """The twin of commit_step (same arguments and result)."""
    bs, n = tokens.shape
    m = torch.where(live, accept_len.long(), 0)
    order = torch.arange(n, device=tokens.device).expand(bs, n)
    if tree:
        order = path_first(accept_index, m)
        tokens = tokens.gather(1, order)
        cols = prefix[:, None] + torch.arange(n, device=tokens.device)
        slots = req_to_token[rows[:, None], cols]
        req_to_token[rows[:, None], cols] = slots.gather(1, order)
    out.tokens.copy_(tokens)
    out.accept_len.copy_(m)
    out.bonus.copy_(bonus.long())
    out.prefix.copy_(prefix)
    torch.cat([m[:, None], out.bonus[:, None], tokens, order], 1, out=out.host_row)
    return order


def commit_step(accept_index: torch.Tensor, accept_len: torch.Tensor, live: torch.Tensor,
                tokens: torch.Tensor, bonus: torch.Tensor, prefix: torch.Tensor,
                rows: torch.Tensor, req_to_token: torch.Tensor, out: StepOutputs, tree: bool,
                use_triton: bool | None = None) -> torch.Tensor:
    """accept_index [bs, N] (a tree's accepted nodes in path order, root first), accept_len,
    live (bool: a real request), bonus, prefix (where the verify started), rows (the target's
    req_to_token rows) [bs]; tokens [bs, N] the verify's nodes; tree: rearrange tokens and KV
    slots into path order (a chain's nodes are already). Writes `out`; returns order [bs, N].
    Never reads tensor values on the host (CUDA-graph safe)."""
    if not pick_triton(tokens, use_triton):
        return commit_step_torch(accept_index, accept_len, live, tokens, bonus, prefix, rows,
                                 req_to_token, out, tree)
    return triton_module("step_commit_triton").commit_step_triton(
        accept_index, accept_len, live, tokens, bonus, prefix, rows, req_to_token, out, tree)
