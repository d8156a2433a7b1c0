"""Prefill attention alone: a chain of the default model's extend attention layers in one CUDA
graph, as a piecewise prefill runs them (30 calls, one a layer, each layer's query the output of
the layer before, each layer its own KV pool), for batches of prompts of one length (no cached
prefix). One JSON line a measurement: us a call, and whether the chain's output has the bits of
the first variant's. Variants: "this" (specpcg/attention/triton_extend.py of this checkout, with
its block shape, then each --configs M,N,WARPS,STAGES) and any --module NAME=PATH (another
copy of a file with `extend_attention`, e.g. another commit's triton_kernels.py), run in turn,
all of it twice.

    python benchmarks/probe_extend_attn.py [--cells 1x512 8x512 1x2048] \
        [--configs 32,64,4,2 128,64,8,2] [--module old=devrun/old_triton_kernels.py] > out.jsonl
    python benchmarks/probe_extend_attn.py --shape llama-3-8b --layers 32 ...
    python benchmarks/probe_extend_attn.py --plot OUT.png RESULTS.jsonl [VARIANT ...]
"""

from __future__ import annotations

import argparse
import json

import torch

import common

common.add_repo_to_path()
from probe_decode_attn import SHAPES  # noqa: E402


def cell_inputs(batch: int, length: int, dev) -> dict:
    """The extend kernel's batch arguments for `batch` prompts of `length` tokens, each in its
    own row of the pool (request i's keys at slots i * length ..)."""
    i32 = lambda v: torch.tensor(v, device=dev, dtype=torch.int32)  # noqa: E731
    rows = torch.arange(batch * length, device=dev, dtype=torch.int32).view(batch, length)
    return {"req_to_token": rows, "req_pool_indices": i32(list(range(batch))),
            "seq_lens": i32([length] * batch), "extend_lens": i32([length] * batch),
            "q_starts": i32([i * length for i in range(batch + 1)])}


def measure(run, layers: int, batch: int, length: int, heads: tuple, replays: int) -> tuple:
    """(us a call, the chain's output) of `layers` calls of run(q, k, v, out, inputs) replayed
    from one graph."""
    dev = torch.device("cuda")
    heads, kv_heads, head_dim = heads
    torch.manual_seed(0)
    tokens = batch * length
    pools = [(torch.randn(tokens, kv_heads, head_dim, device=dev, dtype=torch.bfloat16),
              torch.randn(tokens, kv_heads, head_dim, device=dev, dtype=torch.bfloat16))
             for _ in range(layers)]
    inputs = cell_inputs(batch, length, dev)
    bufs = [torch.randn(tokens, heads, head_dim, device=dev, dtype=torch.bfloat16)
            for _ in range(2)]
    start = bufs[0].clone()

    def chain():
        for i, (k, v) in enumerate(pools):
            run(bufs[i % 2], k, v, bufs[(i + 1) % 2], inputs)
    chain()  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    us = common.replay_us(graph, replays) / layers
    bufs[0].copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    return us, bufs[layers % 2].clone()


def runner(module, batch: int, length: int, config):
    def run(q, k, v, out, inputs):
        kwargs = {"config": config} if config is not None else {}
        module.extend_attention(q, k, v, out, inputs["req_to_token"],
                                inputs["req_pool_indices"], inputs["seq_lens"],
                                inputs["extend_lens"], inputs["q_starts"], length, batch,
                                q.shape[2] ** -0.5, **kwargs)
    return run


def variants(args) -> list:
    """(name, module, config) of each variant."""
    from specpcg.attention import triton_extend

    out = [("this", triton_extend, None)]
    out += [(f"this/{c}", triton_extend, tuple(int(x) for x in c.split(","))) for c in args.configs]
    for name, path in (spec.split("=", 1) for spec in args.module):
        out.append((name, common.load_module(f"probe_attn_{name}", path), None))
    return out


def plot(path: str, results: str, names: list) -> None:
    """us a call by prompt length: a panel a (shape, batch), a line a variant (all, or those
    named), each point the least of its lines."""
    found: dict = {}
    for r in common.read_jsonl(results):
        if names and r["variant"] not in names:
            continue
        series = found.setdefault((r["shape"], r["batch"]), {}).setdefault(r["variant"], {})
        series.setdefault(r["length"], []).append(r["us_per_call"])
    if not found:
        raise ValueError(f"no results of variants {names} in {results!r}")
    panels = [{"title": f"{shape}, batch {batch}", "xlabel": "prompt tokens",
               "ylabel": "us a call", "logx": True,
               "series": {name: [(n, min(v)) for n, v in by_len.items()]
                          for name, by_len in by_variant.items()}}
              for (shape, batch), by_variant in sorted(found.items())]
    common.line_plot(panels, path, f"prefill attention, a chain of layers: {results}")
    print(f"plot: {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--cells", nargs="+", default=["1x128", "1x512", "8x256", "8x512", "1x2048",
                                                   "1x4096"], metavar="BATCHxLENGTH")
    p.add_argument("--configs", nargs="*", default=[], metavar="M,N,WARPS,STAGES")
    p.add_argument("--module", nargs="*", default=[], metavar="NAME=PATH")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--plot", nargs="+", metavar=("PNG", "RESULTS"), default=None,
                   help="plot results files instead: PNG RESULTS [VARIANT ...]")
    args = p.parse_args(argv)
    if args.plot:
        if len(args.plot) < 2:
            p.error("--plot needs PNG and RESULTS")
        return plot(args.plot[0], args.plot[1], args.plot[2:])
    machine, heads = common.device_name(torch.device("cuda")), SHAPES[args.shape]
    for cell in args.cells:
        batch, length = (int(x) for x in cell.split("x"))
        first = None
        for name, module, config in variants(args) * 2:
            us, out = measure(runner(module, batch, length, config), args.layers, batch, length,
                              heads, args.replays)
            first = out if first is None else first
            print(json.dumps({
                "bench": "probe_extend_attn", "shape": args.shape, "variant": name,
                "batch": batch, "length": length, "layers": args.layers,
                "us_per_call": round(us, 3), "bits_of_first": torch.equal(out, first),
                "commit": common.git_commit(), "machine": machine}), flush=True)


if __name__ == "__main__":
    main()
