"""Programmatic dependent launch (PDL) on a chain of few-row linear layers (CUDA, Hopper on).

A batch-1 decode step is a chain of about 250 small kernels replayed from one CUDA graph, and
each waits for the one before to finish before it starts: its launch and its first reads of
weights (which depend on nothing before it) sit in that gap. With PDL a kernel may start while
the one before ends: it loads its first weights, then waits (`griddepcontrol.wait`) before it
reads the activations the kernel before wrote.

This probe runs the default model's linear layers as a chain of dependent calls, layer after
layer (qkv, o, gate/up with SiLU-and-mul, down; each layer's weights its own, out of L2 as in a
real step), captured in one CUDA graph, at 1 and 8 rows. Variants:
  library   kernels/gemv_triton.gemv (its tiling) without PDL;
  lib-pdl   the same with PDL (kernels/dispatch.pdl), as the engine runs it on Hopper;
  copy      the probe's copy of its kernel, no PDL (the control for the next two);
  pdl       the copy launched with PDL, the first weights read before the wait;
  pdl-early the same, each program also signalling at its start that the next may launch.
Lines: rows, variant, us per call (a replay of the chain over its calls), and whether the
chain's output has the bits of its control's (library: its first run; pdl, pdl-early: copy's;
a read before the wait would show as a difference).

    python benchmarks/probe_pdl.py [--layers 30] [--rows 1 8] > out.txt
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import common

common.add_repo_to_path()

HIDDEN, QKV, INTER = 576, 960, 1536  # the default model's shapes


@triton.jit
def _gemv_copy(x_ptr, w_ptr, y_ptr, N, K, UP_OFFSET, stride_wn, SILU_MUL: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
               EARLY: tl.constexpr):
    """kernels/gemv_triton._gemv_kernel (no bias) for K <= BLOCK_K, with the PDL wait after
    the weights' loads."""
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask = mask_n[:, None] & mask_k[None, :]
    w = tl.load(rows + offs_k[None, :], mask=mask, other=0.0)
    up = w
    if SILU_MUL:
        up = tl.load(rows + UP_OFFSET * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(w.to(tl.float32) * x, 1)
    if SILU_MUL:
        dtype = y_ptr.dtype.element_ty
        gate = y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * tl.sum(up.to(tl.float32) * x, 1).to(dtype).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _rows_copy(x_ptr, w_ptr, y_ptr, M, N, K, UP_OFFSET, stride_xm, stride_wn, stride_ym,
               SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr, EARLY: tl.constexpr):
    """kernels/gemv_triton._rows_kernel (no bias, no split), the first BLOCK_K of weights
    read before the PDL wait."""
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & mask_n[None, :]
    w = tl.load(cols + offs_k[:, None], mask=mask, other=0.0)
    up = w
    if SILU_MUL:
        up = tl.load(cols + UP_OFFSET * stride_wn + offs_k[:, None], mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if k0 > 0:
            mask = mask_k[:, None] & mask_n[None, :]
            w = tl.load(cols + offs_k[:, None], mask=mask, other=0.0)
            if SILU_MUL:
                up = tl.load(cols + UP_OFFSET * stride_wn + offs_k[:, None], mask=mask,
                             other=0.0)
        acc = tl.dot(x, w, acc)
        if SILU_MUL:
            acc_up = tl.dot(x, up, acc_up)
    y = acc
    if SILU_MUL:
        dtype = y_ptr.dtype.element_ty
        gate = y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * acc_up.to(dtype).to(tl.float32)
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def call(variant: str, x, w, out, silu: bool) -> None:
    from kernels.gemv_triton import gemv, tiling

    if variant in ("library", "lib-pdl"):
        from kernels import dispatch

        dispatch._pdl_devices[x.device.index or 0] = variant == "lib-pdl"
        gemv(x, w, None, out, silu)
        return
    m, k = x.shape
    n_out = out.shape[-1]
    pdl, early = variant != "copy", variant == "pdl-early"
    extra = {"launch_pdl": True} if pdl else {}
    if m == 1:
        bn = tiling(n_out, k, 1)[0]
        _gemv_copy[(triton.cdiv(n_out, bn),)](
            x, w, out, n_out, k, n_out if silu else 0, w.stride(0), SILU_MUL=silu, BLOCK_N=bn,
            BLOCK_K=triton.next_power_of_2(k), PDL=pdl, EARLY=early, num_warps=4, **extra)
    else:
        bn, bk = 32, 128
        _rows_copy[(triton.cdiv(n_out, bn),)](
            x, w, out, m, n_out, k, n_out if silu else 0, x.stride(0), w.stride(0),
            out.stride(0), SILU_MUL=silu, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, EARLY=early,
            num_warps=4, num_stages=3, **extra)


def chain(variant: str, layers: list, x: torch.Tensor, bufs: dict) -> torch.Tensor:
    """Every layer's four linear calls, each reading the one before's output."""
    h = x
    for qkv, o, gate_up, down in layers:
        call(variant, h, qkv, bufs["qkv"], False)
        call(variant, bufs["qkv"][:, :HIDDEN], o, bufs["o"], False)
        call(variant, bufs["o"], gate_up, bufs["act"], True)
        call(variant, bufs["act"], down, bufs["h"], False)
        h = bufs["h"]
    return h


def measure(variant: str, layers: list, rows: int, replays: int) -> tuple:
    dev = layers[0][0].device
    x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    bufs = {name: torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            for name, n in (("qkv", QKV), ("o", HIDDEN), ("act", INTER), ("h", HIDDEN))}
    chain(variant, layers, x, bufs)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(variant, layers, x, bufs)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / (4 * len(layers)), out.clone()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--replays", type=int, default=50)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
    layers = [(weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * INTER, HIDDEN),
               weight(HIDDEN, INTER)) for _ in range(args.layers)]
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, "
          f"{args.layers} layers, {4 * args.layers} calls a chain", flush=True)
    for rows in args.rows:
        seen = {}
        for variant in ("library", "lib-pdl", "copy", "pdl", "pdl-early", "library", "lib-pdl"):
            try:
                us, out = measure(variant, layers, rows, args.replays)
            except Exception as err:  # noqa: BLE001 (a Triton without PDL, a GPU before Hopper)
                print(f"{rows:2d} {variant:9s} failed: {type(err).__name__}: {err}", flush=True)
                continue
            control = "library" if variant.startswith("lib") else "copy"
            seen.setdefault(variant, out)
            print(f"{rows:2d} {variant:9s} {us:6.2f} us a call  bits of {control}: "
                  f"{torch.equal(out, seen.get(control, out))}", flush=True)


if __name__ == "__main__":
    main()
