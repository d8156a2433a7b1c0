"""The inputs of an overlapped step's chain verify, from the last step's accepted path
(specpcg/speculative/step_graph.py): where each request's verify starts, its nodes'
positions and KV slots, and its key counts.

In torch these are six small kernels (two for the start, one each for the columns, the slot
gather, its cast to int64 and the key counts), about 8 us of a batch-1 verify step of the
default model on an H200 (benchmarks/results/step_trace_ngram_p1_bs1_shape_ae405d2_h200.txt);
the Triton kernel (verify_inputs_triton.py) is one program per request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import pick_triton, triton_module


class VerifyInputs(NamedTuple):
    prefix: torch.Tensor  # [bs] int64: the root's position, 0 on padding rows
    positions: torch.Tensor  # [bs * n] int64: node j of request i at prefix[i] + j
    out_cache_loc: torch.Tensor  # [bs * n] int64: req_to_token[rows[i], prefix[i] + j]
    seq_lens: torch.Tensor  # [bs] int64: prefix + n


def verify_inputs_torch(first_pos, lens, live, rows, req_to_token, n: int) -> VerifyInputs:
    """The twin of verify_inputs (same arguments and result)."""
    prefix = (first_pos + lens) * live
    columns = prefix[:, None] + torch.arange(n, device=prefix.device)
    loc = req_to_token[rows[:, None], columns].reshape(-1).long()
    return VerifyInputs(prefix, columns.reshape(-1), loc, prefix + n)


def verify_inputs(first_pos: torch.Tensor, lens: torch.Tensor, live: torch.Tensor,
                  rows: torch.Tensor, req_to_token: torch.Tensor, n: int,
                  use_triton: bool | None = None) -> VerifyInputs:
    """first_pos, lens [bs] int64: the last verify's start and its emitted tokens; live [bs]
    bool: a real request (else a padding row, whose verify starts at 0); rows [bs]: the
    requests' req_to_token rows; n: the nodes a request verifies. Never reads tensor values on
    the host (CUDA-graph safe)."""
    if not pick_triton(first_pos, use_triton):
        return verify_inputs_torch(first_pos, lens, live, rows, req_to_token, n)
    return triton_module("verify_inputs_triton").verify_inputs_triton(
        first_pos, lens, live, rows, req_to_token, n)
