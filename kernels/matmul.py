"""Batch-invariant linear: y = x @ w.T (+ b), a row's result independent of the other rows.

The Triton kernel (kernels/matmul_triton.py) guarantees it; the torch twin is the reference
(and what CPU engines run: the interpreter would be far too slow for a model)."""

from __future__ import annotations

from typing import Optional

import torch

from kernels.dispatch import pick_triton, triton_module


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    return torch.nn.functional.linear(x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     use_triton: Optional[bool] = None) -> torch.Tensor:
    if not pick_triton(x, use_triton):
        return linear_torch(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [M, N]
    if x2.shape[0]:
        triton_module("matmul_triton").matmul(x2, weight.contiguous(), bias, out)
    return out.view(*lead, weight.shape[0])
