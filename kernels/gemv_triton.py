"""Linear layers of a few rows (1 to MAX_ROWS) in Triton: y = x @ w.T (+ bias), and
silu(x @ gate.T) * (x @ up.T) in the same pass over a fused [gate; up] weight.

A batch-1 decode step reads every weight once for one row of activations, and a batch-1 chain
verify for eight, so their matmuls are bound by memory. cuBLAS runs them as tensor-core tiles
of 8 rows and splits K for the narrow ones (o and down), which costs a second kernel to add the
splits; the SiLU-and-mul after the gate/up matmul is a third. One row (`_gemv_kernel`): each
program reads BLOCK_N whole weight rows in BLOCK_K steps, keeps an fp32 product per element and
reduces once at the end: no split, no workspace, and the activation in the epilogue. 2 to
MAX_ROWS rows (`_rows_kernel`): the rows padded to 16 on tensor cores, each weight tile read
once for all of them, the same epilogue. (fp32 products on CUDA cores for several rows ran
1.4-3.7x slower than cuBLAS at 8 rows: every program re-read the activations.)

NOTE: an output's sum depends on K and BLOCK_K only: BLOCK_K follows K (`tiling`), one row's
BLOCK_N never changes a sum, and from 2 rows the whole tiling follows K and whether the launch
takes one-step tiles (PDL on a device with the shared memory; on an H200 both tilings gave
the same bits at 8 and 16 rows, benchmarks/probe_pdl.py --norms). So a column shard of a
weight (tensor parallelism) gives the same bits as the whole weight. From 2 rows a row's bits
do not depend on the other rows either.
The launcher reads no tensor values on the host: capturable in a CUDA graph once compiled.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.dispatch import cuda_index, pdl
from kernels.gemv import MAX_ROWS


# One row's steps along K, whatever the shape (`tiling`): a normed launch needs K within one.
ONE_ROW_BLOCK_K = 1024


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, stride_rm, stride_rom,
                 eps, N, K, UP_OFFSET, stride_wn,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_N outputs (`one_row_sums`)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = one_row_sums(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, eps, offs_n, mask_n,
                     K, UP_OFFSET, stride_wn, HAS_BIAS, SILU_MUL, NORM, HAS_RESIDUAL, BLOCK_K,
                     PDL)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def one_row_sums(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, eps, offs_n, mask_n, K,
                 UP_OFFSET, stride_wn, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """Outputs offs_n of one row (fp32, bias added). SILU_MUL: output n is silu(row n . x) *
    (row n + UP_OFFSET . x), each sum rounded to y's dtype first, as silu_and_mul over a
    matmul's output. PDL (kernels/dispatch.pdl): the first BLOCK_K of the weights are read
    before the wait. NORM (K <= BLOCK_K): x is first RMSNorm'd (`_norm_rows`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask = mask_n[:, None] & mask_k[None, :]
    w = tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    up = w
    if SILU_MUL:
        up = tl.load(rows + UP_OFFSET * stride_wn + offs_k[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    if NORM:
        x = _norm_rows(x, r_ptr + offs_k, r_out_ptr + offs_k, nw, mask_k, K, eps,
                       tl.program_id(0) == 0, HAS_RESIDUAL, 0)
    x = x.to(tl.float32)[None, :]
    acc = w * x
    acc_up = up * x
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x
        if SILU_MUL:
            up_k = tl.load(rows + UP_OFFSET * stride_wn + offs_k[None, :], mask=mask,
                           other=0.0)
            acc_up += up_k.to(tl.float32) * x
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SILU_MUL:
        dtype = y_ptr.dtype.element_ty
        gate = y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * tl.sum(acc_up, 1).to(dtype).to(tl.float32)
    return y


@triton.jit
def _norm_rows(x, r_ptrs, r_out_ptrs, nw, mask, K, eps, WRITER, HAS_RESIDUAL: tl.constexpr,
               AXIS: tl.constexpr):
    """RMSNorm of the rows of x (along AXIS, whole in this step) with kernels/norm.py's
    rounding: x + residual rounded to x's dtype (stored to r_out by the WRITER program alone:
    the others still read the residual), normalised, rounded, scaled by nw, rounded."""
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if WRITER:
            tl.store(r_out_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=AXIS, keep_dims=True) / K + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    return (normed * nw.to(tl.float32)).to(x.dtype)


@triton.jit
def _rows_epilogue(acc, acc_up, b_ptr, y_ptr, offs_m, mask_m, offs_n, mask_n, stride_ym,
                   HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    """The one-row kernel's epilogue over [16, BLOCK_N] sums: bias, SiLU-and-mul, store."""
    y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        dtype = y_ptr.dtype.element_ty
        gate = y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * acc_up.to(dtype).to(tl.float32)
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, stride_rm, stride_rom,
                 eps, part_ptr, arrived_ptr, M, N, K, K_PER, UP_OFFSET,
                 stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLITS: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr):
    """2 or more rows: BLOCK_N outputs of 16 rows a program (program (tile, s, b): rows 16 b
    to 16 b + 15), on tensor cores (the rows padded to 16, which costs nothing where the
    weight's read is the bound). SPLITS > 1: program (tile, s, b) sums K_PER of the depth,
    and the last of a tile's programs to arrive adds the splits' fp32 sums (`_rows_add_splits`).
    ONE_STEP (K_PER <= BLOCK_K): a program's depth is one step, and with PDL (dispatch.pdl)
    its weights are read before the wait, as the one-row kernel's first step is. Several
    steps wait first: reading only the first step's weights early measured no faster
    (3.61-3.65 against 3.50 us a call in a chain of the default model's layers at 8 rows on
    an H200, benchmarks/probe_pdl.py). NORM (ONE_STEP, SPLITS 1): the rows are RMSNorm'd."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.program_id(2) * 16 + tl.arange(0, 16)
    mask_m = offs_m < M
    cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    k_lo = tl.program_id(1) * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    if ONE_STEP:  # the weights read before the wait
        w, up, nw = rows_weights(cols, cols + UP_OFFSET * stride_wn, nw_ptr, mask_n, k_lo, k_hi,
                                 SILU_MUL, NORM, BLOCK_K)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc, acc_up = rows_sums(x_ptr, w, up, nw, r_ptr, r_out_ptr, stride_xm, stride_rm,
                                stride_rom, eps, offs_m, mask_m, k_lo, k_hi, K, tile == 0,
                                SILU_MUL, NORM, HAS_RESIDUAL, BLOCK_N, BLOCK_K)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask = mask_k[:, None] & mask_n[None, :]
            acc = tl.dot(x, tl.load(cols + offs_k[:, None], mask=mask, other=0.0), acc)
            if SILU_MUL:
                up = tl.load(cols + UP_OFFSET * stride_wn + offs_k[:, None], mask=mask,
                             other=0.0)
                acc_up = tl.dot(x, up, acc_up)
    if SPLITS == 1:
        _rows_epilogue(acc, acc_up, b_ptr, y_ptr, offs_m, mask_m, offs_n, mask_n, stride_ym,
                       HAS_BIAS, SILU_MUL)
    else:
        slot = tl.program_id(2) * tl.num_programs(0) + tile  # this tile of these 16 rows
        _rows_add_splits(acc, acc_up, b_ptr, y_ptr, part_ptr, arrived_ptr, slot, offs_m,
                         mask_m, offs_n, mask_n, stride_ym, HAS_BIAS, SILU_MUL, BLOCK_N, SPLITS)


@triton.jit
def rows_weights(cols, up_cols, nw_ptr, mask_n, k_lo, k_hi, UP: tl.constexpr,
                 NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """A one-step tile's reads that depend on no kernel before it, made before PDL's wait: the
    weight tiles (up's, UP) and the norm's weight (NORM), each the first where not asked for."""
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_hi
    mask = mask_k[:, None] & mask_n[None, :]
    w = tl.load(cols + offs_k[:, None], mask=mask, other=0.0)
    up = w
    if UP:
        up = tl.load(up_cols + offs_k[:, None], mask=mask, other=0.0)
    nw = w
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)[None, :]
    return w, up, nw


@triton.jit
def rows_sums(x_ptr, w, up, nw, r_ptr, r_out_ptr, stride_xm, stride_rm, stride_rom, eps,
              offs_m, mask_m, k_lo, k_hi, K, WRITER, UP: tl.constexpr, NORM: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[16, BLOCK_N] fp32 sums of rows offs_m over depth k_lo..k_hi (one step) against the
    weight tiles of `rows_weights` (and, UP, up's: else acc_up is zeros), after the wait: the
    rows read and, NORM, RMSNorm'd (`_norm_rows`, the WRITER program storing the residual)."""
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_hi
    x_mask = mask_m[:, None] & mask_k[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
    if NORM:
        x = _norm_rows(x, r_ptr + offs_m[:, None] * stride_rm + offs_k[None, :],
                       r_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :], nw,
                       x_mask, K, eps, WRITER, HAS_RESIDUAL, 1)
    acc = tl.dot(x, w, tl.zeros([16, BLOCK_N], dtype=tl.float32))
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if UP:
        acc_up = tl.dot(x, up, acc_up)
    return acc, acc_up


@triton.jit
def _rows_add_splits(acc, acc_up, b_ptr, y_ptr, part_ptr, arrived_ptr, slot, offs_m, mask_m,
                     offs_n, mask_n, stride_ym, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Stores this split's fp32 sums; the last of the tile's programs to arrive adds them all
    in split order (so the bits follow K, BLOCK_K and SPLITS alone) and runs the epilogue.
    One kernel, not a split kernel and a sum kernel: a launch costs about what a small layer's
    read does. The barrier orders every thread's stores before the counter's release; the last
    to arrive (acquire) sees them all and zeroes the counter again."""
    cell = tl.arange(0, 16)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    parts = part_ptr + slot.to(tl.int64) * (SPLITS * 2 * 16 * BLOCK_N) + cell
    mine = parts + tl.program_id(1) * (2 * 16 * BLOCK_N)
    tl.store(mine, acc)
    if SILU_MUL:
        tl.store(mine + 16 * BLOCK_N, acc_up)
    tl.debug_barrier()
    if tl.atomic_add(arrived_ptr + slot, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        tl.store(arrived_ptr + slot, 0)
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # ".cg": other SMs wrote them, skip L1
            acc += tl.load(parts + s * (2 * 16 * BLOCK_N), cache_modifier=".cg")
            if SILU_MUL:
                acc_up += tl.load(parts + s * (2 * 16 * BLOCK_N) + 16 * BLOCK_N,
                                  cache_modifier=".cg")
        _rows_epilogue(acc, acc_up, b_ptr, y_ptr, offs_m, mask_m, offs_n, mask_n,
                       stride_ym, HAS_BIAS, SILU_MUL)


def tiling(n: int, k: int, rows: int = 1, one_step: bool = True) -> tuple | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLITS) for `n` outputs of depth `k` over
    `rows` rows of activations, or None where cuBLAS is faster. The tiles follow K and
    `one_step` alone (see the NOTE).

    One row, fitted on an H200 (`python benchmarks/probe_gemv.py`, CUDA-graph replays, weights
    out of L2): one or two rows a program and 1,024-deep steps read the Llama-3-8B shape's
    weights at 0.76-1.08 of a device copy's rate where cuBLAS reached 0.63-1.05 (o: 10.6
    against 12.7 us; gate/up with its SiLU-and-mul: 54.4 against 60.6 us), and the default
    model's 1.7-1.9x faster. A wide and shallow weight (the default model's tied LM head,
    49,152 x 576) is the exception: cuBLAS 16.0 us, the best tiling here 17.0.

    2-16 rows (a program's 16 rows cost what 8 do), fitted at 8 rows on an H100 (`probe_gemv.py
    --rows 8`): wide tiles and 256-deep steps on the 8B shape's weights (qkv 20.2 against
    cuBLAS's 20.8 us, gate/up with its SiLU-and-mul 81.9 against 85.6, its LM head 344 against
    391), narrow ones on the default model's (3.3-4.9 against 3.5-5.8 us); its tied LM head
    gains 3% here and stays on cuBLAS. Deep weights
    split K (`probe_gemv.py --rows 8 --splits ...`, one H200): their unsplit launches have too
    few programs to fill the GPU (the default model's down, 576 x 1,536: 36 programs, 4.70 us;
    6 splits 3.93; the 8B shape's down, 4,096 x 14,336: 37.3 us, 3 splits 31.2, cuBLAS 31.0).
    Splitting the 4,096-deep ones paid for o (13.1 -> 11.5 us) and cost qkv, so they stay
    whole. With PDL (`one_step`) a program whose depth is one step reads all its weights before
    the wait (ONE_STEP): a chain of the default model's layers on an H200 (`probe_pdl.py
    --tiles`) went from 3.49-3.50 to 2.38-2.49 us a call at 2-8 rows with shallow weights in one
    1,024-deep step and 1,536-deep ones in 6 one-step splits; at 12-16 rows 2.50-2.53, where
    cuBLAS (then the SiLU-and-mul kernel) took 4.51 (`--cublas`). Without PDL those tiles took
    5.0-5.3 us (against 3.8: a 1,024-deep step of gate and up takes about 150 KB of shared
    memory, one program an SM), so there the steps stay 128 deep (`one_step_fits`). Past 16
    rows a program takes 16 of them: at 32 rows 3.25 against cuBLAS's 4.52, at 64 4.84 against
    4.62, so MAX_ROWS may be raised to 32 (kernels/gemv.py says why it is 8); deep weights (the
    8B shape's), whose reads past 16 rows were not measured, stop at 16."""
    if rows > MAX_ROWS or (k < 1024 and n > 16384) or (rows > 16 and k >= 4096):
        return None
    if rows == 1:
        return (2 if n >= 65536 else 1), ONE_ROW_BLOCK_K, 4, 4, 1
    # by K alone, like BLOCK_K: a tensor-parallel shard (fewer outputs) keeps the tiling
    if k < 1024:
        return (32, max(16, triton.next_power_of_2(k)), 4, 1, 1) if one_step else (
            32, 128, 4, 4, 1)
    if k < 4096:
        return 32, (256 if one_step else 128), 4, (1 if one_step and k <= 1536 else 3), 6
    if k < 8192:
        return 64, 256, 4, 4, 1
    return 32, 256, 4, 3, 3


@lru_cache(maxsize=None)  # asked once a device: eager forwards ask per linear layer
def _shared_memory(index: int) -> int:
    """Bytes of shared memory a program may take on device `index`."""
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 0)


def one_step_fits(x: torch.Tensor) -> bool:
    """Whether x's launches take one-step tiles: with PDL, and where a 1,024-deep step of gate
    and up (about 150 KB of shared memory) fits in the device's (Hopper: 227 KB)."""
    if not (x.is_cuda and pdl(x)["PDL"]):
        return False
    return _shared_memory(cuda_index(x.device)) >= (2 * 32 + 16) * 1024 * 2


MAX_TILES = 8192  # arrival counters a device keeps: a split launch's BLOCK_N-wide tiles
_arrived: dict = {}


def _device_key(device: torch.device) -> tuple:
    """A bare "cuda" (an engine's device) and a tensor's "cuda:0" are one key."""
    return device.type, cuda_index(device) if device.type == "cuda" else device.index


def made_arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's counters if something made them already, else None (none are made)."""
    return _arrived.get(_device_key(device))


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed counters for split launches (each launch leaves them zero), shared by
    every engine in the process. Made eagerly (`kernels.gemv.prepare_capture`), never inside a
    capture: made there, they lived in the graph's pool and only that graph's replay zeroed
    them. On one H200 a second engine's batches of 8 then read another's leftover bytes as
    arrivals (6,912 of 8,192 counters nonzero) and went wrong from their second token."""
    key = _device_key(device)
    if key not in _arrived:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the GEMV kernel's arrival counters for {device} must be made before a CUDA "
                "graph capture: call kernels.gemv.prepare_capture(device) before capturing")
        _arrived[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _arrived[key]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor, silu_mul: bool = False, tile: tuple | None = None,
         norm: tuple | None = None) -> torch.Tensor:
    """x [M, K] (any M, in programs of 16 rows), weight [N, K], and out [M, N] or, for
    silu_mul, [M, N / 2] (weight rows: gate, then up), each with unit column stride.
    tile: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLITS) instead of `tiling`'s (probe_gemv's
    sweep; SPLITS applies from 2 rows). norm: (residual or None, norm weight [K], eps,
    residual_out or None): the matmul takes RMSNorm(x + residual) and writes x + residual to
    residual_out, a tensor of its own (`norm_fits` says where it may). Returns out."""
    m, k = x.shape
    n_out = out.shape[-1]
    # from 2 rows the tiles follow K alone (whatever rows `tiling` would leave to cuBLAS)
    block_n, block_k, warps, stages, splits = tile or tiling(
        n_out, k, min(m, 2), m > 1 and one_step_fits(x)) or (
        (32, 128, 4, 4, 1) if m > 1 else (1, 1024, 4, 4, 1))
    residual, norm_weight, eps, residual_out = norm or (None, x, 0.0, None)
    if norm is not None and not (block_k >= k and (m == 1 or splits == 1)):
        raise ValueError(f"a normed launch takes x's whole depth in one step, got K {k} in "
                         f"steps of {block_k} over {splits} splits")
    has_residual = residual is not None
    residual, residual_out = (residual, residual_out) if has_residual else (x, x)
    args = (x, weight, bias if bias is not None else weight, out, residual, norm_weight,
            residual_out, residual.stride(0), residual_out.stride(0), eps)
    flags = dict(HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
                 HAS_RESIDUAL=has_residual, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=warps, num_stages=stages, **pdl(x))
    tiles = triton.cdiv(n_out, block_n)
    up_offset = n_out if silu_mul else 0
    if m == 1:
        _gemv_kernel[(tiles,)](*args, n_out, k, up_offset, weight.stride(0), **flags)
        return out
    blocks = triton.cdiv(m, 16)
    if splits > 1 and tiles * blocks > MAX_TILES:
        raise ValueError(f"a split launch takes at most {MAX_TILES} tiles of outputs, got "
                         f"{tiles * blocks} ({n_out} outputs, BLOCK_N {block_n}, {m} rows)")
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    parts = (torch.empty(blocks * tiles * splits * 2 * 16 * block_n, dtype=torch.float32,
                         device=x.device) if splits > 1 else out)
    arrived = arrival_counters(x.device) if splits > 1 else out
    _rows_kernel[(tiles, splits, blocks)](
        *args, parts, arrived, m, n_out, k, per_split, up_offset, x.stride(0), weight.stride(0),
        out.stride(0), SPLITS=splits, ONE_STEP=per_split <= block_k, **flags)
    return out
