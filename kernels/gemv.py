"""Linear layers that take the few-row GEMV kernel (kernels/gemv_triton.py) where it applies:
up to MAX_ROWS rows of bf16 or fp16 activations on CUDA, outside autograd (a decode step of a
few requests, a batch-1 chain verify, a draft step). Everything else is `F.linear`, and the
gate/up projection's `linear_silu_mul` is then `F.linear` followed by the SiLU-and-mul kernel.

The torch twins (`*_torch`) are the reference; `use_triton` follows kernels/dispatch.py, except
that None also asks whether the call is one the kernel serves (`gemv_applies`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kernels import fused_ops
from kernels.dispatch import HAS_TRITON, pick_triton, triton_module
from kernels.matmul import linear_torch  # noqa: F401 (this op's twin is F.linear as well)

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def _max_rows() -> int:
    """The most activation rows the kernel takes by default: 8 (a batch-1 chain verify), or
    SPECPCG_GEMV_MAX_ROWS, up to 32. The kernel runs any row count in programs of 16 rows, and
    on an H200 a chain of the default model's layers ran faster than cuBLAS up to 32 rows (2.5-
    3.3 against 4.5 us a call, benchmarks/probe_pdl.py --cublas): no-spec decode at batch 16
    1.21x, a batch-4 chain verify 1.18x. But a plain decode of 9-32 requests then takes the
    kernel where their verify (8 rows a request) takes cuBLAS, which rounds otherwise: at 32 the
    GPU test of bf16 NGRAM against plain decoding saw 8 of 20 outputs identical (every
    divergence a near tie) under its floor of 10, and the deterministic mode's overlapped
    STANDALONE cell one accept histogram differ (outputs equal). 8 stays the default until
    both pass."""
    value = os.environ.get("SPECPCG_GEMV_MAX_ROWS", "8")
    if not value.isdigit() or not 1 <= int(value) <= 32:
        raise ValueError(f"SPECPCG_GEMV_MAX_ROWS={value!r}: expected a whole number from 1 to 32")
    return int(value)


MAX_ROWS = _max_rows()


def _flag(name: str) -> bool:
    """An on/off setting: 1 (the default) or 0."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


# Linear layers take the RMSNorm before them into their launch where it fits (`normed_linear`).
NORM_IN_GEMV = _flag("SPECPCG_NORM_IN_GEMV")
# A qkv projection takes the rotary and the K/V cache write too (`normed_qkv_rope`).
ROPE_IN_GEMV = _flag("SPECPCG_ROPE_IN_GEMV")


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
        return gemv_applies(x, weight, n_out) and not _pads(x)
    if use_triton and (x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS):
        raise ValueError(f"the GEMV kernel takes 1 to {MAX_ROWS} rows of activations, got x of "
                         f"shape {tuple(x.shape)}")
    return pick_triton(x, use_triton)


def linear_silu_mul_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_and_mul_torch(F.linear(x, weight))


# Inside `bucketed_rows`, GEMMs of more than BUCKETED_FROM rows run at one of these row counts: the
# first cuBLAS call at a row count it has not met costs 0.2-5 ms of host time (H200, bf16, the
# default model's EAGLE3 head: 4.5 ms at 777 rows, 0.1 ms on the next call at 777), and an eager
# draft forward (a catch-up over new prompts, or over the positions plain steps passed) meets a
# new row count nearly every time: the catch-up after 100 plain steps took 11.6 ms at batch 4,
# 6 of them in two such GEMMs, and 4.1 ms with its rows padded (benchmarks/probe_catchup.py).
_depth = 0
# Past 8 rows an eager forward inside `bucketed_rows` pads to a bucket and takes cuBLAS, as it
# did when the kernel stopped at 8 rows: a draft's eager forward may meet other row counts in
# the overlapped loop than in the synchronous one, and the deterministic mode's draft tokens
# must not change with them (tests/test_spec_overlap.py, on the GPU).
BUCKETED_FROM = 8


def row_bucket(rows: int) -> int:
    """The smallest of 16 * 2^k and 24 * 2^k (k >= 0) that holds `rows` (at most 1.5x)."""
    size = 16
    while size < rows:
        if size * 3 // 2 >= rows:
            return size * 3 // 2
        size *= 2
    return size


@contextmanager
def bucketed_rows(enabled: bool = True):
    """Within, `linear` and `linear_silu_mul` pad the activations' rows to `row_bucket` (zero
    rows, their outputs dropped) where cuBLAS runs the GEMM. Callers enable it on CUDA for
    eager forwards whose row counts vary; a CUDA graph's capture is never padded."""
    global _depth
    _depth += int(enabled)
    try:
        yield
    finally:
        _depth -= int(enabled)


def _pads(x: torch.Tensor) -> bool:
    """Whether x's rows are padded to a bucket (`bucketed_rows`)."""
    return (bool(_depth) and x.dim() == 2 and x.shape[0] > BUCKETED_FROM
            and not (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x, its rows padded to row_bucket with zeros inside `bucketed_rows`, else x itself."""
    if not _pads(x):
        return x
    rows = row_bucket(x.shape[0])
    if rows == x.shape[0]:
        return x
    out = x.new_zeros(rows, x.shape[1])
    out[:x.shape[0]] = x
    return out


def warm_row_buckets(weights: list, max_rows: int) -> None:
    """Calls each weight shape's GEMM once at every row bucket above BUCKETED_FROM up to max_rows,
    so that the first padded call at a bucket (`bucketed_rows`) finds cuBLAS ready."""
    shapes = {(tuple(w.shape), w.dtype, w.device): w for w in weights}  # layers share shapes
    rows = row_bucket(BUCKETED_FROM + 1)
    with torch.no_grad():
        while rows <= row_bucket(max_rows):
            for w in shapes.values():
                F.linear(w.new_zeros(rows, w.shape[1]), w)
            rows = row_bucket(rows + 1)


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, its rows padded to a bucket inside `bucketed_rows`."""
    padded = _padded(x)
    out = F.linear(padded, weight, bias)
    return out if padded is x else out[:x.shape[0]]


def prepare_capture(device: torch.device) -> None:
    """Makes the kernel's process-wide state on `device` (its split launches' arrival counters)
    eagerly, as every CUDA graph capture that may run the kernel needs first."""
    if device.type == "cuda" and HAS_TRITON:
        triton_module("gemv_triton").arrival_counters(device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           use_triton: bool | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), as F.linear."""
    if not _use_kernel(x, weight, use_triton):
        return bucketed_linear(x, weight, bias)
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
        padded = _padded(x)
        both = F.linear(padded, weight)
        return fused_ops.silu_and_mul(both if padded is x else both[:x.shape[0]],
                                      use_triton=use_triton)
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    return triton_module("gemv_triton").gemv(x, weight, None, out, silu_mul=True)


def norm_fits(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
              n_out: int | None = None) -> bool:
    """Whether a call the kernel serves (`gemv_applies`) takes the RMSNorm before it into its
    launch (`normed_linear`): where the launch reads the whole depth in one step (the default
    model's 576, not the 8B shape's 4,096): at one row, and from 2 rows where the rows kernel
    takes one-step tiles (`one_step_fits`: PDL on Hopper), as the roped qkv launch does
    (`rope_fits`); unless SPECPCG_NORM_IN_GEMV=0. At one row a batch-1 decode step of the
    default model runs 190 kernels where it ran 250, their own time 495 against 530 us (H200,
    probe_decode_trace). At 8 rows (a batch-1 (7, 1, 8) verify) the norm before gate/up in the
    launch ran 1,630 / 1,637 against 1,594 / 1,610 tok/s at accept chance 0.0001, two pairs
    alternating on one H100 (bench_accept; 1,629 against 1,598 / 1,608 on an H200)."""
    return _one_step_norm(x, weight, norm_weight, n_out) and (
        x.shape[0] == 1 or triton_module("gemv_triton").one_step_fits(x))


def _one_step_norm(x, weight, norm_weight, n_out=None) -> bool:
    """A call the kernel serves whose launch may take the norm: its whole depth in one step."""
    if (not NORM_IN_GEMV or not gemv_applies(x, weight, n_out) or _pads(x)
            or norm_weight.dtype != x.dtype):
        return False
    return x.shape[1] <= triton_module("gemv_triton").ONE_ROW_BLOCK_K  # gemv_applies tiled it


def rope_fits(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
              head_dim: int) -> bool:
    """Whether a qkv projection takes the norm, the rotary and the K/V write into one launch
    (`normed_qkv_rope`): where it takes the norm (`norm_fits`) and, from 2 rows, 8 of each of a
    head's halves make a tensor-core tile (D / 2 a multiple of 8); unless SPECPCG_ROPE_IN_GEMV
    or SPECPCG_NORM_IN_GEMV is 0."""
    if not ROPE_IN_GEMV or head_dim % 2 or not norm_fits(x, weight, norm_weight):
        return False
    return x.shape[0] == 1 or head_dim // 2 % 8 == 0


def normed_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  silu_mul: bool = False, use_triton: bool | None = None) -> tuple | None:
    """(linear(rmsnorm(x + residual)) or, silu_mul, its SiLU-and-mul, x + residual) in one
    launch, where `norm_fits` (use_triton None) or use_triton: a batch-1 decode step of the
    default model ran 61 RMSNorm kernels of about 1.3 us each, each between two matmuls.
    residual None: rmsnorm(x), and x is the residual. None where the launch does not fit: the
    caller runs the norm's kernel, then the matmul. The norm rounds as kernels/norm.py's."""
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    fits = (norm_fits(x, weight, norm_weight, n_out) if use_triton is None
            else pick_triton(x, use_triton))
    if not fits:
        return None
    residual_out = torch.empty_like(x) if residual is not None else None
    out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    triton_module("gemv_triton").gemv(x, weight, bias, out, silu_mul,
                                      norm=(residual, norm_weight, eps, residual_out))
    return out, (x if residual is None else residual_out)


def normed_linear_torch(x, residual, norm_weight, eps, weight, bias=None, silu_mul=False):
    """normed_linear's twin: the norm's kernel (or its twin), then the matmul."""
    if residual is None:
        residual, h = x, fused_ops.rms_norm_torch(x, norm_weight, eps)
    else:
        h, residual = fused_ops.fused_add_rms_norm_torch(x, residual, norm_weight, eps)
    return (linear_silu_mul_torch(h, weight) if silu_mul else F.linear(h, weight, bias)), residual


def normed_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None, rope: tuple,
                    use_triton: bool | None = None) -> tuple | None:
    """normed_linear of a qkv projection, then the rotary on q and k and k, v written to the
    caches at the tokens' slots, all in one launch (kernels/gemv_rope_triton.py; rope is as
    there): (qkv, x + residual), or None where `rope_fits` does not hold (use_triton None):
    the caller then runs them apart."""
    fits = (rope_fits(x, weight, norm_weight, rope[-1]) if use_triton is None
            else pick_triton(x, use_triton))
    if not fits:
        return None
    residual_out = torch.empty_like(x) if residual is not None else None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    triton_module("gemv_rope_triton").gemv_rope(
        x, weight, bias, out, (residual, norm_weight, eps, residual_out), rope)
    return out, (x if residual is None else residual_out)


def normed_qkv_rope_torch(x, residual, norm_weight, eps, weight, bias, rope):
    """normed_qkv_rope's twin: the norm, the matmul, then the rotary and the cache write."""
    qkv, residual = normed_linear_torch(x, residual, norm_weight, eps, weight, bias)
    positions, cos_sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim = rope
    q, k, v = qkv.split([num_q_heads * head_dim] + [num_kv_heads * head_dim] * 2, dim=-1)
    fused_ops.rotary_store_torch_(positions, q, k, v, cos_sin, head_dim, k_cache, v_cache, slots)
    return qkv, residual
