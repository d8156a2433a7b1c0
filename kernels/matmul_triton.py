"""A batch-invariant matmul in Triton: y = x @ w.T (+ bias) with one tiling for every row count.

NOTE: every output element is computed by the same program shape, summing over K in the same
BLOCK_K steps and the same order, whatever M is. cuBLAS picks tile shapes and split-K by the
problem size, so a row's result there changes with the number of rows beside it; here it
cannot (enable_deterministic_inference uses this for every linear layer and the LM head).

The tiling (N tile, K tile, K splits, warps, stages) is a function of the weight's shape and
the device only (`tiling_for`), never of M: a weight with few output columns gets narrower N
tiles or a split K so that a decode step still fills the GPU. With a split K, each split's
partial sum lands in an fp32 workspace and a second kernel adds the splits in a fixed order.
What a row's sum depends on is the K tile and the splits alone; the launch (`Launch`: rows and
columns per program, warps, whether one program adds the splits itself) may follow M, so a
call of many rows takes wide tiles and no workspace and still gives every row the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.dispatch import cuda_index

try:  # host-built TMA descriptors (Triton >= 3.4); without them no launch asks for TMA
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

BLOCK_M = 64


@dataclass(frozen=True)
class Tiling:
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _load_tiles(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k0, k_end, stride_xm, stride_wn,
                BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K] at k0, zero past k_end."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_end
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    return x, w


@triton.jit
def _dot_range(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm,
               stride_wn, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in [k_start, k_end) of x[m, k] * w[n, k], in BLOCK_K steps from k_start."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x, w = _load_tiles(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k0, k_end,
                           stride_xm, stride_wn, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _dot_splits(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, K, K_PER_SPLIT, stride_xm,
                stride_wn, DOT_PRECISION: tl.constexpr, SPLITS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Every split's sum, each from zero, added 0, 1, 2, ... onto zero (as _sum_splits_kernel
    adds them), in one loop over K: the partial sum is added onto the total and restarted at
    each split's end, so the software pipeline never drains between splits."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = K_PER_SPLIT // BLOCK_K
    for i in range(0, steps):
        x, w = _load_tiles(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, i * BLOCK_K, K,
                           stride_xm, stride_wn, BLOCK_K)
        part = tl.dot(x, tl.trans(w), part, input_precision=DOT_PRECISION)
        if ((i + 1) % per_split == 0) | (i + 1 == steps):
            acc += part
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if tl.cdiv(steps, per_split) < SPLITS:  # an empty last split adds +0.0 (turns -0.0 to 0.0)
        acc += tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS_IN_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """SPLITS_IN_PROGRAM == 1: program z sums split z (its partial sum goes to the workspace, or
    is the result when K is not split). > 1: one program sums every split itself."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    if SPLITS_IN_PROGRAM == 1:
        k_start = split * K_PER_SPLIT
        acc = _dot_range(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k_start,
                         tl.minimum(K, k_start + K_PER_SPLIT), stride_xm, stride_wn,
                         DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _dot_splits(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, K, K_PER_SPLIT,
                          stride_xm, stride_wn, DOT_PRECISION, SPLITS_IN_PROGRAM,
                          BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + split.to(tl.int64) * stride_ys
    tl.store(y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _matmul_tma_kernel(x_desc, w_desc, y_desc, b_ptr, N, K, K_PER_SPLIT,
                       HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """_matmul_kernel's wide launch with tiles copied in by the TMA engine (Hopper and later):
    the same BLOCK_K steps, and the same split sums added in the same order, so the same bits.
    The descriptors zero what lies past M, N and K, as the masked loads do."""
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    steps = tl.cdiv(K, BLOCK_K)
    if SPLITS == 1:  # as _dot_range: one sum from zero
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in range(0, steps):
            acc = tl.dot(x_desc.load([off_m, i * BLOCK_K]), w_desc.load([off_n, i * BLOCK_K]).T,
                         acc, input_precision=DOT_PRECISION)
    else:  # as _dot_splits
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        per_split = K_PER_SPLIT // BLOCK_K
        for i in range(0, steps):
            part = tl.dot(x_desc.load([off_m, i * BLOCK_K]), w_desc.load([off_n, i * BLOCK_K]).T,
                          part, input_precision=DOT_PRECISION)
            if ((i + 1) % per_split == 0) | (i + 1 == steps):
                acc += part
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if tl.cdiv(steps, per_split) < SPLITS:
            acc += tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ps, stride_pm, stride_ym,
                       HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # always split 0, 1, 2, ...: the order never changes
        acc += tl.load(part_ptr + s * stride_ps + rows, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiling_for(n: int, k: int, device: torch.device) -> Tiling:
    """The tiling for a weight [n, k] on `device`. NOTE: it must never read M."""
    if device.type != "cuda":
        return Tiling(num_stages=1)
    return cuda_tiling(n, k, _sm_count(cuda_index(device)))


def cuda_tiling(n: int, k: int, sms: int) -> Tiling:
    """A decode step (one M tile) spread over the `sms` SMs: N tiles of 128 columns where that
    fills them, else 64 or 32; then K split in two, four or eight (each split at least 512
    deep) until about 1.25 programs per SM. Deep weights read K in steps of 128.

    Fitted to bench_matmul on an H100 (benchmarks/results/matmul.jsonl): against cuBLAS in
    bf16, one step's linear layers run 1.01 / 1.00 / 0.98x at 1 / 16 / 64 rows on the
    Llama-3-8B shapes and 0.90 / 0.88 / 0.86x on the default model's (0.46x and 0.78x at 512
    rows with the decode launch; calls of 128 rows or more take a wide launch, launch_for)."""
    block_n = 128 if triton.cdiv(n, 128) >= sms else 64 if 4 * triton.cdiv(n, 64) >= sms else 32
    split = 1
    while triton.cdiv(n, block_n) * split < 1.25 * sms and k // (2 * split) >= 512 and split < 8:
        split *= 2
    block_k = 128 if k >= 2048 else 64
    return Tiling(block_n=block_n, block_k=block_k, split_k=split, num_warps=4,
                  num_stages=3 if block_k == 128 else 4)


@dataclass(frozen=True)
class Launch:
    """How a call's programs cover the output: rows and columns per program, warps, stages,
    and whether one program sums every K split itself. None of these changes a row's sum (the
    same BLOCK_K steps in the same order, the splits added in the same order), so unlike the
    Tiling it may depend on M: many rows (a verify, a prefill) take wide tiles and no fp32
    workspace, which a decode step could not fill the GPU with."""
    block_m: int = BLOCK_M
    block_n: int | None = None  # None: the tiling's
    num_warps: int | None = None
    num_stages: int | None = None
    fuse_splits: bool = False
    tma: bool = False  # tiles copied in by descriptors (fuse_splits implied; Hopper and later)


WIDE_FROM_ROWS = 128  # from this many rows on, a CUDA call may take a wide launch
# Widest first; each adds the K splits in one pipelined loop (_dot_splits). Fitted to
# `bench_matmul.py --launches` on an H100 (matmul.jsonl, "matmul_launch"): at 512 rows the 8B
# shape's split layers ran 0.33-0.40x cuBLAS with the workspace, 0.54-0.70x with these (one
# loop per split, draining the pipeline at each, ran 0.52-0.60x); 128 x 128 tiles need 8
# warps (with 4, two fp32 accumulators spill: 0.06x).
WIDE_LAUNCHES = (Launch(128, 128, 8, 3, True), Launch(64, 128, 4, 4, True),
                 Launch(64, 64, 4, 4, True))
# The same tiles copied in by TMA descriptors, where the GPU has them (Hopper on): at 256 rows
# the 8B shape's layer linears ran 0.88x cuBLAS against 0.77x with pointer loads, at 512 rows
# 0.82x against 0.72x (matmul.jsonl, 4e7c473), every row bitwise the decode launch's.
WIDE_LAUNCHES_TMA = tuple(Launch(lc.block_m, lc.block_n, lc.num_warps, lc.num_stages, True, True)
                          for lc in WIDE_LAUNCHES)


@lru_cache(maxsize=None)
def _has_tma(index: int) -> bool:
    return TensorDescriptor is not None and torch.cuda.get_device_capability(index)[0] >= 9


def launch_for(m: int, n: int, device: torch.device) -> Launch:
    """The widest launch whose programs still fill about 0.7 of the SMs, for m >= 128 rows on
    CUDA (TMA loads where the GPU has them); else the decode launch (the workspace for split K)."""
    if device.type != "cuda":
        return Launch()
    index = cuda_index(device)
    return cuda_launch(m, n, _sm_count(index), _has_tma(index))


def cuda_launch(m: int, n: int, sms: int, tma: bool = False) -> Launch:
    if m < WIDE_FROM_ROWS:
        return Launch()
    for lc in WIDE_LAUNCHES_TMA if tma else WIDE_LAUNCHES:
        if triton.cdiv(m, lc.block_m) * triton.cdiv(n, lc.block_n) >= 0.7 * sms:
            return lc
    return Launch()


_UNFIT: set = set()  # (launch, K tile, device): wide launches this GPU's shared memory refused


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor, tiling: Tiling | None = None, launch: Launch | None = None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K].T (+ bias [N]); x and weight row-contiguous.
    launch None: launch_for's choice, or the decode launch where this GPU cannot fit it."""
    assert x.stride(1) == 1 and weight.stride(1) == 1 and out.stride(1) == 1
    t = tiling or tiling_for(weight.shape[0], x.shape[1], x.device)
    if launch is not None:
        return _launch(x, weight, bias, out, t, launch)
    lc = launch_for(x.shape[0], weight.shape[0], x.device)
    key = (lc, t.block_k, x.device)
    if lc != Launch() and key not in _UNFIT:
        try:
            return _launch(x, weight, bias, out, t, lc)
        except triton.runtime.errors.OutOfResources:
            # NOTE: a GPU with less shared memory than the H100 the launches were fitted on;
            # the decode launch gives the same bits, so it is a safe fallback.
            _UNFIT.add(key)
    _launch(x, weight, bias, out, t, Launch())


def tma_fits(*tensors: torch.Tensor) -> bool:
    """TMA copies need 16-byte aligned bases and row strides."""
    return TensorDescriptor is not None and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _launch_tma(x, weight, bias, out, t: Tiling, lc: Launch) -> None:
    m, k = x.shape
    n = weight.shape[0]
    block_n = lc.block_n or t.block_n
    _matmul_tma_kernel[(triton.cdiv(m, lc.block_m), triton.cdiv(n, block_n))](
        TensorDescriptor.from_tensor(x, [lc.block_m, t.block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, t.block_k]),
        TensorDescriptor.from_tensor(out, [lc.block_m, block_n]),
        bias if bias is not None else weight, n, k,
        triton.cdiv(triton.cdiv(k, t.block_k), t.split_k) * t.block_k,
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SPLITS=t.split_k, BLOCK_M=lc.block_m, BLOCK_N=block_n, BLOCK_K=t.block_k,
        num_warps=lc.num_warps or t.num_warps, num_stages=lc.num_stages or t.num_stages)


def _launch(x, weight, bias, out, t: Tiling, lc: Launch) -> None:
    if lc.tma:
        if tma_fits(x, weight, out):
            return _launch_tma(x, weight, bias, out, t, lc)
        lc = Launch(lc.block_m, lc.block_n, lc.num_warps, lc.num_stages, fuse_splits=True)
    m, k = x.shape
    n = weight.shape[0]
    block_n = lc.block_n or t.block_n
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    k_per_split = triton.cdiv(triton.cdiv(k, t.block_k), t.split_k) * t.block_k
    workspace = t.split_k > 1 and not lc.fuse_splits
    grid = (triton.cdiv(m, lc.block_m), triton.cdiv(n, block_n), 1 if lc.fuse_splits else t.split_k)
    # [split_k, M, N] fp32 partial sums when K is split; the bias goes in after they are added
    dest = torch.empty(t.split_k, m, n, dtype=torch.float32, device=x.device) if workspace else out
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, dest, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), dest.stride(-2), dest.stride(0) if workspace else 0,
        HAS_BIAS=bias is not None and not workspace, DOT_PRECISION=precision,
        SPLITS_IN_PROGRAM=t.split_k if lc.fuse_splits else 1,
        BLOCK_M=lc.block_m, BLOCK_N=block_n, BLOCK_K=t.block_k,
        num_warps=lc.num_warps or t.num_warps, num_stages=lc.num_stages or t.num_stages)
    if workspace:
        _sum_splits_kernel[(triton.cdiv(m, 32), triton.cdiv(n, 64))](
            dest, bias if bias is not None else weight, out, m, n,
            dest.stride(0), dest.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=t.split_k, BLOCK_M=32, BLOCK_N=64, num_warps=4)
