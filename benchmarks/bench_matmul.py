"""The batch-invariant matmul against cuBLAS, per layer shape, rows and tiling (CUDA only).

    python benchmarks/bench_matmul.py [--models default llama-3-8b] [--rows 1 16 64 512]

Each line: one weight shape of a model, M rows, a tiling (or cuBLAS), microseconds per call.
Calls are timed inside one CUDA graph that cycles through copies of the weight, so the weight
comes from memory and not from L2, as in a decode step of a real model; The table (and
matmul.png) sums one step's linear layers per model and M: cuBLAS, the tiling `cuda_tiling`
picks now, and the best tiling of each layer.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from common import (RESULTS_DIR, add_repo_to_path, append_jsonl, fmt, grouped_bar_plot,
                    machine_info, markdown_table, now_iso, render_results, replay_us)

add_repo_to_path()

from kernels import matmul_triton as mm  # noqa: E402

# (name, N, K) per linear of one layer, and the LM head
SHAPES = {
    "default": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                ("down", 576, 1536), ("lm_head", 49152, 576)],
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                   ("down", 4096, 14336), ("lm_head", 128256, 4096)],
}
LAYERS = {"default": 30, "llama-3-8b": 32}
WORKING_SET = 512 << 20  # bytes of weight copies the timed graph cycles through (> L2)


def candidates(k: int) -> list:
    out = []
    for bn, split, bk, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (64, 128), (3, 4)):
        if k // split >= 256 and not (bk == 128 and stages == 4):
            out.append(mm.Tiling(block_n=bn, block_k=bk, split_k=split, num_stages=stages))
    return out


def time_us(call, weights: list, x: torch.Tensor, replays: int = 5) -> float:
    for w in weights[:2]:  # compile and warm up outside the graph
        call(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(x, w)
    return replay_us(graph, replays) / len(weights)


def bench_shape(model: str, name: str, n: int, k: int, rows: list, out: list) -> None:
    dev = torch.device("cuda")
    copies = max(1, WORKING_SET // (n * k * 2))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        base = dict(bench="matmul", model=model, layer=name, n=n, k=k, m=m)
        us = time_us(lambda a, w: torch.nn.functional.linear(a, w), weights, x)
        out.append({**base, "impl": "cublas", "us": us})
        for t in candidates(k):
            us = time_us(lambda a, w, t=t: mm.matmul(a, w, None, y, t), weights, x)
            out.append({**base, "impl": "triton", "tiling": t.__dict__, "us": us})
    del weights
    torch.cuda.empty_cache()


def launches() -> list:
    """Wide launches for many rows: every one keeps the rule tiling's K steps and split order."""
    shapes = [(64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 8, 4), (128, 64, 8, 4), (128, 128, 8, 3),
              (128, 128, 4, 3), (128, 128, 8, 4), (128, 256, 8, 2), (128, 256, 8, 3),
              (256, 128, 8, 2), (128, 256, 4, 3)]
    return [mm.Launch(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                      fuse_splits=True, tma=tma)
            for bm, bn, warps, stages in shapes for tma in (False, True)]


def bench_launches(model: str, name: str, n: int, k: int, rows: list, out: list) -> None:
    """The rule tiling under each launch: microseconds, and whether every row keeps the bits
    of the decode launch (the workspace path)."""
    dev = torch.device("cuda")
    copies = max(1, WORKING_SET // (n * k * 2))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    t = mm.tiling_for(n, k, dev)
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y, ref = (torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
        mm.matmul(x, weights[0], None, ref, t, mm.Launch())
        base = dict(bench="matmul_launch", model=model, layer=name, n=n, k=k, m=m,
                    tiling=t.__dict__)
        out.append({**base, "impl": "cublas",
                    "us": time_us(lambda a, w: torch.nn.functional.linear(a, w), weights, x)})
        for lc in [mm.Launch(), *launches()]:
            try:
                mm.matmul(x, weights[0], None, y, t, lc)
            except triton.runtime.errors.OutOfResources:  # too many stages of too wide tiles
                continue
            same = bool(torch.equal(y, ref))
            us = time_us(lambda a, w, lc=lc: mm.matmul(a, w, None, y, t, lc), weights, x)
            out.append({**base, "impl": "triton", "launch": lc.__dict__, "rule":
                        lc == mm.launch_for(m, n, dev), "bitwise": same, "us": us})
    del weights
    torch.cuda.empty_cache()


def step_sums(lines: list) -> dict:
    """(model, M) -> one step's linear layers summed (LM head once, the others per layer), in
    us: cuBLAS, the current tiling rule (`cuda_tiling` at the run's SM count) and the best
    tiling of each layer."""
    out = {}
    for l in lines:
        key = (l["model"], l["m"])
        d = out.setdefault(key, {}).setdefault(l["layer"], {"best": float("inf")})
        if l["impl"] == "cublas":
            d["cublas"] = l["us"]
            continue
        d["best"] = min(d["best"], l["us"])
        # NOTE: lines before the "sms" field came from one H100 (132 SMs)
        if mm.Tiling(**l["tiling"]) == mm.cuda_tiling(l["n"], l["k"], l.get("sms", 132)):
            d["rule"] = l["us"]
    return {key: {side: sum(d.get(side, float("nan")) * (1 if layer == "lm_head"
                                                        else LAYERS[key[0]])
                            for layer, d in per.items()) for side in ("cublas", "rule", "best")}
            for key, per in out.items()}


SPLIT_LOOP_RUNS = {"1de8f5b"}  # fused splits ran one loop each then, a form since removed


def _launch_of(line: dict):
    """The line's Launch, or None for a form since removed (SPLIT_LOOP_RUNS). Lines of
    f3c91d5 name the current form flush_in_loop; later ones add tma."""
    fields = dict(line["launch"])
    fields.pop("flush_in_loop", None)
    if fields["fuse_splits"] and line.get("git") in SPLIT_LOOP_RUNS:
        return None
    return mm.Launch(**fields)


def launch_sums(lines: list) -> dict:
    """(model, M) -> one step's linear layers summed, in us, for the latest launch run: cuBLAS,
    the decode launch (fp32 workspace for split K) and the launch `cuda_launch` picks now."""
    latest = [l for l in lines if l.get("git") == lines[-1].get("git")] if lines else []
    out = {}
    for l in latest:
        d = out.setdefault((l["model"], l["m"]), {}).setdefault(l["layer"], {})
        if l["impl"] == "cublas":
            d["cublas"] = l["us"]
            continue
        lc = _launch_of(l)
        if lc is None:
            continue
        if lc == mm.Launch():
            d["decode"] = l["us"]
        if lc == mm.cuda_launch(l["m"], l["n"], l.get("sms", 132), l.get("tma", False)):
            d["rule"] = l["us"]
    return {key: {side: sum(d.get(side, float("nan")) * (1 if layer == "lm_head"
                                                        else LAYERS[key[0]])
                            for layer, d in per.items()) for side in ("cublas", "decode", "rule")}
            for key, per in out.items()}


def render_table(records: list) -> str:
    launch = launch_sums([r for r in records if r.get("bench") == "matmul_launch"])
    rows = [[model, str(m), fmt(t["cublas"]), fmt(t["decode"]), fmt(t["rule"]),
             fmt(t["cublas"] / t["decode"]), fmt(t["cublas"] / t["rule"])]
            for (model, m), t in sorted(launch.items())]
    wide = markdown_table(["model", "rows", "cuBLAS us", "decode launch us", "launch rule us",
                           "decode launch vs cuBLAS", "launch rule vs cuBLAS"], rows)
    return tiling_table(records) + ("\n\nMany rows, by launch (`--launches`):\n\n" + wide
                                    if rows else "")


def tiling_table(records: list) -> str:
    rows = []
    for (model, m), t in sorted(step_sums([r for r in records if r.get("bench") == "matmul"]).items()):
        rows.append([model, str(m), fmt(t["cublas"]), fmt(t["rule"]), fmt(t["best"]),
                     fmt(t["cublas"] / t["rule"]), fmt(t["cublas"] / t["best"])])
    return markdown_table(["model", "rows", "cuBLAS us", "rule us", "best us",
                           "rule vs cuBLAS", "best vs cuBLAS"], rows)


def render_plot(records: list, path) -> None:
    sums = step_sums([r for r in records if r.get("bench") == "matmul"])
    panels = []
    for model in sorted({m for m, _ in sums}):
        keys = sorted(k for k in sums if k[0] == model)
        panels.append({"title": model, "ylabel": "speed vs cuBLAS (one step's linears)",
                       "labels": [f"M={m}" for _, m in keys],
                       "values": {side: [sums[k]["cublas"] / sums[k][side] for k in keys]
                                  for side in ("rule", "best")}})
    if not panels:  # a file of --launches lines alone
        return
    grouped_bar_plot(panels, ["rule", "best"], path,
                     "batch-invariant matmul vs cuBLAS (bf16; above 1: faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 512])
    ap.add_argument("--out", default=str(RESULTS_DIR / "matmul.jsonl"))
    ap.add_argument("--table-only", metavar="FILE", default=None)
    ap.add_argument("--launches", action="store_true",
                    help="time the rule tiling under every wide launch instead (rows >= 128)")
    args = ap.parse_args()
    if args.table_only:
        return render_results(args.table_only, render_table, render_plot)
    lines = []
    for model in args.models:
        for name, n, k in SHAPES[model]:
            if args.launches:
                bench_launches(model, name, n, k, args.rows, lines)
            else:
                bench_shape(model, name, n, k, args.rows, lines)
            print(f"{model} {name} done", flush=True)
    dev = torch.device("cuda")
    info = {**machine_info(dev), "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
            "tma": mm._has_tma(dev.index or 0), "time": now_iso()}
    append_jsonl(args.out, [{**l, **info} for l in lines])
    render_results(args.out, render_table, render_plot)


if __name__ == "__main__":
    main()
