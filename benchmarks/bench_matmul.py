"""The batch-invariant matmul against cuBLAS, per layer shape, rows and tiling (CUDA only).

    python benchmarks/bench_matmul.py [--models default llama-3-8b] [--rows 1 16 64 512]

Each line: one weight shape of a model, M rows, a tiling (or cuBLAS), microseconds per call.
Calls are timed inside one CUDA graph that cycles through copies of the weight, so the weight
comes from memory and not from L2, as in a decode step of a real model; `rule` marks the tiling
`tiling_for` picks. The summary prints, per model and M, one step's linear layers summed:
cuBLAS, the rule's tiling, and the best tiling of each layer.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from common import add_repo_to_path, append_jsonl, machine_info, now_iso, RESULTS_DIR

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
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(weights))


def bench_shape(model: str, name: str, n: int, k: int, rows: list, out: list) -> None:
    dev = torch.device("cuda")
    copies = max(1, WORKING_SET // (n * k * 2))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    rule = mm.tiling_for(n, k, dev)
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        base = dict(bench="matmul", model=model, layer=name, n=n, k=k, m=m)
        us = time_us(lambda a, w: torch.nn.functional.linear(a, w), weights, x)
        out.append({**base, "impl": "cublas", "us": us})
        for t in candidates(k):
            us = time_us(lambda a, w, t=t: mm.matmul(a, w, None, y, t), weights, x)
            out.append({**base, "impl": "triton", "tiling": t.__dict__, "rule": t == rule,
                        "us": us})
        del x, y
    del weights
    torch.cuda.empty_cache()


def summary(lines: list) -> None:
    for model in sorted({l["model"] for l in lines}):
        for m in sorted({l["m"] for l in lines}):
            pick = [l for l in lines if l["model"] == model and l["m"] == m]
            per = {}
            for l in pick:
                d = per.setdefault(l["layer"], {"best": float("inf")})
                if l["impl"] == "cublas":
                    d["cublas"] = l["us"]
                else:
                    d["best"] = min(d["best"], l["us"])
                    if l["rule"]:
                        d["rule"] = l["us"]
            step = {key: sum(d[key] * (1 if layer == "lm_head" else LAYERS[model])
                             for layer, d in per.items()) for key in ("cublas", "rule", "best")}
            print(f"{model:>11} M={m:<4} step linears us: cublas {step['cublas']:9.1f}  "
                  f"rule {step['rule']:9.1f} ({step['cublas'] / step['rule']:.2f}x)  "
                  f"best {step['best']:9.1f} ({step['cublas'] / step['best']:.2f}x)")
            for layer, d in per.items():
                best = min((l for l in pick if l["layer"] == layer and l["impl"] == "triton"),
                           key=lambda l: l["us"])
                print(f"    {layer:8} cublas {d['cublas']:8.1f} rule {d['rule']:8.1f} "
                      f"best {d['best']:8.1f} {best['tiling']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 512])
    ap.add_argument("--out", default=str(RESULTS_DIR / "matmul.jsonl"))
    args = ap.parse_args()
    lines = []
    for model in args.models:
        for name, n, k in SHAPES[model]:
            bench_shape(model, name, n, k, args.rows, lines)
            print(f"{model} {name} done", flush=True)
    info = {**machine_info(torch.device("cuda")), "time": now_iso()}
    append_jsonl(args.out, [{**l, **info} for l in lines])
    summary(lines)


if __name__ == "__main__":
    main()
