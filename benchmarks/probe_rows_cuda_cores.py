"""Few-row linear layers on CUDA cores against the tensor-core `_rows_kernel` (CUDA only).

A batch-1 chain verify of 8 nodes runs every linear layer at 8 rows, where the one-row GEMV
kernel of a decode step reads the same weights faster (the default model on an H200: 2.0-3.2
against 3.1-4.9 us a call; kernels/gemv_triton.py). Two CUDA-core forms of the 8-row kernel are
swept here beside the chosen tilings, on the default model's shapes (each gate_up call with its
SiLU-and-mul), with each timing a CUDA-graph replay of one call per weight copy
(probe_gemv.py's method, weights out of L2):

- `sum3d`: a [rows, BLOCK_N, BLOCK_K] product of fp32 activations and weights summed over K;
- `per_row`: the one-row kernel's tile of weights held in registers while a static loop over the
  8 rows loads each row of activations and reduces it on its own.

Lines: shape, kernel (chosen1 / chosen8: kernels/gemv_triton.tiling at 1 and 8 rows; sum3d,
per_row: best configs), config (BLOCK_N, BLOCK_K, warps, stages), us per call, and the largest
difference from the chosen 8-row kernel's outputs (bf16).

    python benchmarks/probe_rows_cuda_cores.py > out.txt
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import common

common.add_repo_to_path()
from bench_matmul import time_us  # noqa: E402
from kernels.gemv_triton import _rows_epilogue  # noqa: E402 (the library kernel's epilogue)

SHAPES = {"s_qkv": (960, 576), "s_o": (576, 576), "s_gate_up": (3072, 576), "s_down": (576, 1536)}
CONFIGS = {"sum3d": [(bn, bk, w, s) for bn in (1, 2, 4) for bk in (512, 1024) for w in (2, 4, 8)
                     for s in (1, 2)],
           "per_row": [(bn, bk, w, s) for bn in (1, 2, 4) for bk in (512, 1024) for w in (1, 2, 4)
                       for s in (1, 2)]}
ROWS = 8


@triton.jit
def _sum3d_kernel(x_ptr, w_ptr, y_ptr, M, N, K, UP_OFFSET, stride_xm, stride_wn, stride_ym,
                  SILU_MUL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        wm = mask_n[:, None] & mask_k[None, :]
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        w = tl.load(rows, mask=wm, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
        if SILU_MUL:
            up = tl.load(rows + UP_OFFSET * stride_wn, mask=wm, other=0.0).to(tl.float32)
            acc_up += tl.sum(x[:, None, :] * up[None, :, :], 2)
    _rows_epilogue(acc, acc_up, y_ptr, y_ptr, offs_m, mask_m, offs_n, mask_n, stride_ym,
                   False, SILU_MUL)


@triton.jit
def _per_row_kernel(x_ptr, w_ptr, y_ptr, M, N, K, UP_OFFSET, stride_xm, stride_wn, stride_ym,
                    SILU_MUL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        wm = mask_n[:, None] & mask_k[None, :]
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        w = tl.load(rows, mask=wm, other=0.0).to(tl.float32)
        up = w
        if SILU_MUL:
            up = tl.load(rows + UP_OFFSET * stride_wn, mask=wm, other=0.0).to(tl.float32)
        for m in tl.static_range(ROWS):
            xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=mask_k & (m < M),
                         other=0.0).to(tl.float32)
            row = offs_m[:, None] == m
            acc = tl.where(row, acc + tl.sum(w * xm[None, :], 1)[None, :], acc)
            if SILU_MUL:
                acc_up = tl.where(row, acc_up + tl.sum(up * xm[None, :], 1)[None, :], acc_up)
    _rows_epilogue(acc, acc_up, y_ptr, y_ptr, offs_m, offs_m < M, offs_n, mask_n, stride_ym,
                   False, SILU_MUL)


KERNELS = {"sum3d": _sum3d_kernel, "per_row": _per_row_kernel}


def launch(kind: str, x, w, out, cfg, silu: bool) -> None:
    bn, bk, warps, stages = cfg
    n_out = out.shape[-1]
    KERNELS[kind][(triton.cdiv(n_out, bn),)](
        x, w, out, x.shape[0], n_out, x.shape[1], n_out if silu else 0, x.stride(0),
        w.stride(0), out.stride(0), SILU_MUL=silu, ROWS=ROWS, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages)


def sweep(name: str, n: int, k: int, dev) -> list:
    from kernels.gemv_triton import gemv, tiling

    silu = "gate_up" in name
    copies = max(2, -(-400_000_000 // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    found = []
    for rows in (1, ROWS):
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(rows, n // 2 if silu else n, device=dev, dtype=torch.bfloat16)
        gemv(x, ws[0], None, out, silu)
        ref = out.clone()
        found.append((f"chosen{rows}", tiling(out.shape[-1], k, rows), time_us(
            lambda a, w: gemv(a, w, None, out, silu), ws, x), 0.0))
        for kind in KERNELS if rows == ROWS else ():
            for cfg in CONFIGS[kind]:
                try:
                    launch(kind, x, ws[0], out, cfg, silu)
                except Exception as err:  # noqa: BLE001 (a config the GPU refuses)
                    print(f"# {name} {kind} {cfg}: {type(err).__name__}", flush=True)
                    continue
                diff = (out.float() - ref.float()).abs().max().item()
                found.append((kind, cfg, time_us(
                    lambda a, w: launch(kind, a, w, out, cfg, silu), ws, x), diff))
    return found


def main() -> None:
    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        found = sweep(name, n, k, dev)
        for kind in ("chosen1", "chosen8", *KERNELS):
            for label, cfg, us, diff in sorted((f for f in found if f[0] == kind),
                                               key=lambda f: f[2])[:3]:
                print(f"{name:9s} {label:8s} {str(cfg):18s} {us:6.2f} us  diff {diff:.2g}",
                      flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
