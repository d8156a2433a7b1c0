"""Linear layers that take the few-row GEMV kernel (kernels/gemv_triton.py) where it applies:
up to MAX_ROWS rows of bf16 or fp16 activations on CUDA, outside autograd (a decode step of a
few requests, a batch-1 chain verify, a draft step). Everything else is `F.linear`, and the
gate/up projection's `linear_silu_mul` is then `F.linear` followed by the SiLU-and-mul kernel.

The torch twins (`*_torch`) are the reference; `use_triton` follows kernels/dispatch.py, except
that None also asks whether the call is one the kernel serves (`gemv_applies`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fused_ops
from kernels.dispatch import HAS_TRITON, pick_triton, triton_module
from kernels.matmul import linear_torch  # noqa: F401 (this op's twin is F.linear as well)

GEMV_DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 8  # the most activation rows it takes: a batch-1 chain verify's 8 nodes


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, n_out: int | None = None) -> bool:
    """True for a call the GEMV kernel serves by default: 1 to MAX_ROWS rows of bf16/fp16 on
    CUDA, no gradient asked for, both operands with unit column stride, and a shape where the
    kernel beats cuBLAS (gemv_triton.tiling of its `n_out` outputs: the weight's rows unless
    given)."""
    return (x.is_cuda and HAS_TRITON and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and not (x.requires_grad or weight.requires_grad)
            and triton_module("gemv_triton").tiling(n_out or weight.shape[0], weight.shape[1],
                                                    x.shape[0]) is not None)


def _use_kernel(x: torch.Tensor, weight: torch.Tensor, use_triton: bool | None,
                n_out: int | None = None) -> bool:
    if use_triton is None:
        return gemv_applies(x, weight, n_out)
    if use_triton and (x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS):
        raise ValueError(f"the GEMV kernel takes 1 to {MAX_ROWS} rows of activations, got x of "
                         f"shape {tuple(x.shape)}")
    return pick_triton(x, use_triton)


def linear_silu_mul_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_and_mul_torch(F.linear(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           use_triton: bool | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), as F.linear."""
    if not _use_kernel(x, weight, use_triton):
        return F.linear(x, weight, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return triton_module("gemv_triton").gemv(x, weight, bias, out)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    use_triton: bool | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for weight = [gate; up] (no bias), as
    silu_and_mul(F.linear(x, weight))."""
    if weight.shape[0] % 2:
        raise ValueError(f"a [gate; up] weight needs an even row count, got "
                         f"{tuple(weight.shape)}")
    inter = weight.shape[0] // 2
    if not _use_kernel(x, weight, use_triton, inter):
        return fused_ops.silu_and_mul(F.linear(x, weight), use_triton=use_triton)
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    return triton_module("gemv_triton").gemv(x, weight, None, out, silu_mul=True)
