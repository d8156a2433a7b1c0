"""Weight bandwidth of a few-row step's matmuls (CUDA only): cuBLAS (F.linear) against the GEMV
kernel (kernels/gemv_triton.py) at each of a sweep of tilings, over the Llama-3-8B shape's
weights (qkv, o, gate_up, down, LM head) and the default model's, for each row count asked
(1: a batch-1 decode; 8: a batch-1 chain verify of 8 nodes).

Each timing replays one call per copy of the weight, captured in one CUDA graph (no launch
gaps; bench_matmul.time_us), with enough copies that none stays in L2, as in a real step where
the whole model streams through. The gate_up shapes run with the SiLU-and-mul epilogue against cuBLAS followed
by the SiLU-and-mul kernel. Lines: shape, rows, backend (cublas, triton, chosen: the kernel's
own tiling), config (BLOCK_N, BLOCK_K, warps, stages, SPLITS), us per call, GB/s of weight read, and
the fraction of a device-to-device copy's rate. s_*: the default model's shapes.

    python benchmarks/probe_gemv.py [--shapes qkv o ...] [--rows 1 8] > out.txt
    python benchmarks/probe_gemv.py --shapes s_qkv s_o --rows 8 --splits 2 3 4  # split K
"""

from __future__ import annotations

import argparse

import torch

import common

common.add_repo_to_path()
from bench_matmul import time_us  # noqa: E402
from bench_reference import copy_bandwidth  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096),
          "s_qkv": (960, 576), "s_o": (576, 576), "s_gate_up": (3072, 576), "s_down": (576, 1536),
          "s_head": (49152, 576)}
CONFIGS = [(bn, bk, w, s, 1) for bn, bk in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512),
                                         (8, 256), (8, 512), (16, 128), (16, 256), (32, 128))
           for w, s in ((2, 4), (4, 3), (4, 4), (8, 3))]
# 2-8 rows: _rows_kernel's tiles (16 padded rows x BLOCK_N outputs on tensor cores)
ROW_CONFIGS = [(bn, bk, w, s, 1) for bn in (16, 32, 64) for bk in (64, 128, 256)
               for w, s in ((4, 3), (4, 4))]
ROW_CONFIGS += [(bn, bk, w, s, 1) for bn in (16, 32) for bk in (512, 1024)
                for w, s in ((2, 1), (4, 1), (4, 2), (8, 1))]


def split_configs(splits: list, k: int) -> list:
    """2-8 rows with K split over `splits` programs a tile (more programs a launch)."""
    if k >= 4096:  # the 8B shape's: wider tiles, fewer splits pay
        return [(bn, bk, w, 3, sp) for sp in splits for bn in (32, 64) for bk in (128, 256)
                for w in (4, 8)]
    return [(bn, bk, w, 3, sp) for sp in splits for bn in (16, 32) for bk in (64, 128, 256)
            for w in (2, 4)]


def gemv(x, w, out, cfg, silu_mul=False):
    from kernels.gemv_triton import gemv as launch

    launch(x, w, None, out, silu_mul, tile=cfg)


def sweep(name: str, n: int, k: int, rows: int, dev, copy_bps: float,
          splits: list | None = None) -> None:
    """Every config on one shape at `rows` rows (gate_up shapes: with the SiLU-and-mul
    epilogue, against cuBLAS followed by the SiLU-and-mul kernel)."""
    from kernels import fused_ops
    from kernels.gemv_triton import tiling

    nbytes = n * k * 2
    copies = max(2, -(-400_000_000 // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    silu = "gate_up" in name
    out = torch.empty(rows, n // 2 if silu else n, device=dev, dtype=torch.bfloat16)
    if silu:
        def ref(a, w):
            return fused_ops.silu_and_mul(torch.nn.functional.linear(a, w))
    else:
        ref = torch.nn.functional.linear
    results = [("cublas", "-", time_us(ref, ws, x))]
    chosen = tiling(out.shape[-1], k, rows)
    configs = CONFIGS if rows == 1 else split_configs(splits, k) if splits else ROW_CONFIGS
    for cfg in configs + ([chosen] if chosen else []):
        try:
            gemv(x, ws[0], out, cfg, silu)
        except Exception as err:  # noqa: BLE001 (a config the GPU refuses)
            print(f"# {name} {cfg}: {type(err).__name__}")
            continue
        label = "chosen" if cfg == chosen else "triton"
        results.append((label, cfg, time_us(lambda a, w: gemv(a, w, out, cfg, silu), ws, x)))
    best = sorted(results, key=lambda r: r[2])
    for row in best[:4] + [r for r in results if r[0] != "triton"]:
        print(f"{name:9s} {rows:2d} {row[0]:7s} {str(row[1]):18s} {row[2]:8.2f} us "
              f"{nbytes / row[2] / 1e3:6.0f} GB/s {nbytes / row[2] * 1e6 / copy_bps:.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1])
    p.add_argument("--splits", nargs="+", type=int, default=None,
                   help="from 2 rows: sweep these K splits instead of the unsplit tilings")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    copy_bps = copy_bandwidth(dev)
    print(f"# copy {copy_bps / 1e9:.0f} GB/s")
    for rows in args.rows:
        for name in args.shapes:
            sweep(name, *SHAPES[name], rows, dev, copy_bps, args.splits)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
