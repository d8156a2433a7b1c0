"""What a few-row launch pays for a depth padded to a power of two (CUDA).

From 2 rows a shallow weight's launch takes its whole depth K in one tensor-core step of
next_power_of_2(K) (kernels/gemv_triton.tiling): the default model's 576 runs as 1,024, its
padded columns masked. This probe replays chains of square K x K launches (each call reading
the one before's output, each its own weight; PDL as the engine launches, on from Hopper) from
one CUDA graph, for depths and row counts, plain or with the RMSNorm (and a residual) in the
launch, and prints one JSON line a measurement: us a call, the least and the median of five
timings.

    python benchmarks/probe_padded_depth.py [--depths 512 576 640] [--rows 8] [--calls 120] \\
        > out.jsonl
    python benchmarks/probe_padded_depth.py --plot OUT.png RESULTS.jsonl ...

A plot draws us a call by depth, a panel for plain launches and one for normed ones, a line for
each row count (and each "tree" a line carries, where results of several kernels were tagged).
"""

from __future__ import annotations

import argparse
import json

import torch

import common

common.add_repo_to_path()


def chain(weights: list, x: torch.Tensor, bufs: tuple, norm: tuple | None) -> torch.Tensor:
    """Every weight's launch in turn, each on the one before's output; norm: (residual, norm
    weight, residual_out) for launches that RMSNorm their rows first (x + residual each)."""
    from kernels.gemv_triton import gemv

    h = x
    for i, w in enumerate(weights):
        out = bufs[i % 2]
        gemv(h, w, None, out, False, norm=(norm[0], norm[1], 1e-5, norm[2]) if norm else None)
        h = out
    return h


def measure(depth: int, rows: int, normed: bool, calls: int, replays: int) -> dict:
    dev = torch.device("cuda")
    seeded = torch.Generator(device=dev).manual_seed(depth)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=seeded).to(torch.bfloat16)
    weights = [rand(depth, depth) * depth ** -0.5 for _ in range(calls)]
    x, residual = rand(rows, depth), rand(rows, depth)
    bufs = tuple(torch.empty(rows, depth, device=dev, dtype=torch.bfloat16) for _ in range(2))
    norm = (residual, torch.ones(depth, device=dev, dtype=torch.bfloat16),
            torch.empty_like(residual)) if normed else None
    chain(weights, x, bufs, norm)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(weights, x, bufs, norm)
    times = sorted(common.replay_us(graph, replays) / calls for _ in range(5))
    return {"probe": "padded_depth", "depth": depth, "rows": rows, "norm": normed,
            "us_a_call": round(times[0], 3), "median_us": round(times[2], 3)}


def plot_panels(lines: list) -> list:
    """line_plot's panels of results lines: plain and normed launches, a series per row count
    (and tree), each point the median of that depth's measurements (us_a_call)."""
    found: dict = {}
    for line in lines:
        label = f"{line['rows']} rows" + (f", {line['tree']}" if "tree" in line else "")
        found.setdefault((line["norm"], label), {}).setdefault(line["depth"], []).append(
            line["us_a_call"])
    panels = []
    for normed in (False, True):
        series = {label: [(d, common.median(v)) for d, v in sorted(by_depth.items())]
                  for (norm, label), by_depth in sorted(found.items()) if norm == normed}
        panels.append({"title": "with the RMSNorm in the launch" if normed else "plain launches",
                       "xlabel": "depth K", "ylabel": "us a call", "logx": False,
                       "series": series})
    return panels


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", nargs="+", type=int, default=[512, 576, 640])
    p.add_argument("--rows", nargs="+", type=int, default=[8])
    p.add_argument("--calls", type=int, default=120)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--plot", nargs="+", metavar=("PNG", "RESULTS"), default=None,
                   help="plot results files instead: PNG, then JSON lines files")
    args = p.parse_args(argv)
    if args.plot:
        lines = [line for path in args.plot[1:] for line in common.read_jsonl(path)]
        common.line_plot(plot_panels(lines), args.plot[0],
                         "benchmarks/probe_padded_depth.py: a chain of square few-row launches")
        return print(f"plot: {args.plot[0]}")
    info = {"device": torch.cuda.get_device_name(), "git": common.git_commit()}
    for rows in args.rows:
        for normed in (False, True):
            for depth in args.depths:
                line = measure(depth, rows, normed, args.calls, args.replays)
                print(json.dumps({**line, **info}), flush=True)


if __name__ == "__main__":
    main()
