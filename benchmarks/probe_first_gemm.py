"""Host time of a draft head's GEMMs at the row counts its catch-ups meet (GPU): the first call
at a row count against later ones, and the caching allocator's device allocations.

A draft's eager catch-up (a DRAFT_EXTEND forward over the positions it missed) has a row count
of its own nearly every time; cuBLAS picks its kernel at a shape's first call, which is what
kernels/gemv.bucketed_rows keeps off the catch-up's path. One JSON line per row count: per
weight, [ms until the call returned, ms until the device finished, device allocations,
allocation retries]. With CUDA_MODULE_LOADING=EAGER set, the first-call cost stays (H200).

    python benchmarks/probe_first_gemm.py --draft DIR [--rows 503 503 777 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import common

common.add_repo_to_path()

ROWS = [503, 503, 503, 511, 512, 777, 1024, 1024, 2047, 6400, 6400, 6413, 503]


def _allocs() -> tuple:
    import torch

    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_alloc_retries", 0)


def time_gemms(weights: dict, rows: int) -> dict:
    import torch
    import torch.nn.functional as F

    line = {"rows": rows}
    for name, w in weights.items():
        x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
        torch.cuda.synchronize()
        a0, t0 = _allocs(), time.perf_counter()
        F.linear(x, w)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2, a1 = time.perf_counter(), _allocs()
        line[name] = [round(1e3 * (t1 - t0), 3), round(1e3 * (t2 - t0), 3), a1[0] - a0[0],
                      a1[1] - a0[1]]
    return line


def main(argv=None) -> None:
    from bench_adaptive import add_probe_args, probe_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(p)
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    engine, _ = probe_engine(args, "adaptive", 64)
    head = engine.scheduler.spec.draft.model
    mlp = head.midlayer.mlp
    weights = {"fc": head.fc.weight, "gate_up": mlp.gate_up_proj.weight,
               "down": mlp.down_proj.weight}
    print(json.dumps({name: [list(w.shape), str(w.dtype)] for name, w in weights.items()}))
    for rows in args.rows:
        line = {"probe": "first_gemm", **time_gemms(weights, rows),
                **common.machine_info(engine.device)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
