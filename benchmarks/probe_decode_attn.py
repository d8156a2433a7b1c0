"""Decode attention alone: a chain of the default model's attention layers in one CUDA graph.

A batch-1 decode step of the default model runs 30 decode attention calls, one a layer. This
probe replays such a chain (each layer's query is the output of the layer before, each layer
its own KV pool; PDL as the engine launches it on Hopper) for batch sizes, context lengths and
chain-verify widths (--nodes: queries a request, each node seeing the row up to itself), and
prints one JSON line a measurement: us a call, and whether the chain's output has the bits of
the first variant's. Variants: "this" (specpcg/attention/triton_kernels.py of this checkout)
and any --module NAME=PATH (another copy of that file, e.g. another commit's), run alternately,
each twice. A chain verify's nodes share a program (nodes_per_program = --nodes) unless --stack
S also runs each variant with S nodes a program ("NAME/S", where S divides the nodes): the
programs a request then double or more, each with fewer query rows; the bits must not change.

    python benchmarks/probe_decode_attn.py [--batches 1 4 16] [--contexts 64 256 1024 4096] \
        [--nodes 1 8] [--module old=devrun/old/specpcg/attention/triton_kernels.py] \
        [--stack 4] > out.jsonl
    python benchmarks/probe_decode_attn.py --shape llama-3-8b --layers 32 ...
    python benchmarks/probe_decode_attn.py --plot OUT.png RESULTS.jsonl [VARIANT ...]
"""

from __future__ import annotations

import argparse
import json

import torch

import common

common.add_repo_to_path()

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}  # heads, KV heads, head dim


def layer_pools(layers: int, batch: int, context: int, nodes: int, heads: tuple, dev) -> list:
    """Each layer's (k, v) pool (heads: SHAPES'): the batch's rows of context + nodes keys."""
    slots, shape = batch * (context + nodes), heads[1:]
    return [(torch.randn(slots, *shape, device=dev, dtype=torch.bfloat16),
             torch.randn(slots, *shape, device=dev, dtype=torch.bfloat16))
            for _ in range(layers)]


def step_inputs(batch: int, context: int, nodes: int, dev) -> dict:
    """req_to_token, pool indices and seq lens of batch * nodes queries: node j of request i
    sees request i's row up to context + j + 1 keys."""
    width = context + nodes
    rows = torch.arange(batch * width, device=dev, dtype=torch.int32).view(batch, width)
    indices = torch.arange(batch, device=dev, dtype=torch.int32).repeat_interleave(nodes)
    lens = (context + 1 + torch.arange(nodes, device=dev, dtype=torch.int32)).repeat(batch)
    return {"req_to_token": rows, "req_pool_indices": indices, "seq_lens": lens}


def measure(module, pools: list, inputs: dict, batch: int, nodes: int, heads: tuple,
            replays: int, stack: int) -> tuple:
    """(us a call, the chain's output) of the layers' calls replayed from one graph, `stack`
    of a request's nodes a program."""
    dev = pools[0][0].device
    queries, (heads, kv_heads, head_dim) = batch * nodes, heads
    splits = module.pick_num_kv_splits(queries // stack, kv_heads,
                                       torch.cuda.get_device_properties(dev).multi_processor_count)
    torch.manual_seed(1)
    bufs = [torch.randn(queries, heads, head_dim, device=dev, dtype=torch.bfloat16)
            for _ in range(2)]
    start = bufs[0].clone()
    counters = [module.arrival_counters(queries, kv_heads, dev) for _ in pools]

    def chain():
        for i, ((k, v), arrived) in enumerate(zip(pools, counters)):
            module.decode_attention(
                bufs[i % 2], k, v, bufs[(i + 1) % 2], inputs["req_to_token"],
                inputs["req_pool_indices"], inputs["seq_lens"], queries, splits,
                head_dim ** -0.5, arrived=arrived, nodes_per_program=stack)
    chain()  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    us = common.replay_us(graph, replays) / len(pools)
    bufs[0].copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    return us, bufs[len(pools) % 2].clone()


def runs(variants: list, nodes: int, stacks: list) -> list:
    """(name, module, nodes a program) of one panel: each variant with all its nodes in one
    program, then with each of `stacks` that divides them ("NAME/S"); all of it twice."""
    out = [(name, module, nodes) for name, module in variants]
    out += [(f"{name}/{s}", module, s) for s in stacks if s < nodes and nodes % s == 0
            for name, module in variants]
    return out * 2


def plot(path: str, results: str, variants: list, shape: str) -> None:
    """us a call by context of one shape: a panel a (nodes, batch), a line a variant (all, or
    those named), each point the median of its lines."""
    found: dict = {}
    for r in common.read_jsonl(results):
        if (variants and r["variant"] not in variants) or r.get("shape", "smollm2-135m") != shape:
            continue
        panel = (r["nodes"], r["batch"])
        series = found.setdefault(panel, {}).setdefault(r["variant"], {})
        series.setdefault(r["context"], []).append(r["us_per_call"])
    panels = [{"title": f"{shape}, batch {batch}" + (f", {nodes} nodes a request" if nodes > 1
                                                     else ""),
               "xlabel": "context (keys)", "ylabel": "us a call", "logx": True,
               "series": {name: [(c, common.median(v)) for c, v in by_ctx.items()]
                          for name, by_ctx in by_variant.items()}}
              for (nodes, batch), by_variant in sorted(found.items())]
    if not panels:
        raise ValueError(f"no results of shape {shape} and variants {variants} in {results!r}")
    common.line_plot(panels, path, f"decode attention, a chain of layers: {results}")
    print(f"plot: {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot", nargs="+", metavar=("PNG", "RESULTS"), default=None,
                   help="plot a results file instead: PNG RESULTS [VARIANT ...], of --shape")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--contexts", nargs="+", type=int, default=[64, 256, 1024, 4096])
    p.add_argument("--nodes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--module", nargs="*", default=[], metavar="NAME=PATH")
    p.add_argument("--stack", nargs="*", type=int, default=[], metavar="S",
                   help="also S of a request's nodes a program (verify panels)")
    args = p.parse_args(argv)
    if args.plot:
        if len(args.plot) < 2:
            p.error("--plot needs PNG and RESULTS")
        return plot(args.plot[0], args.plot[1], args.plot[2:], args.shape)
    from specpcg.attention import triton_kernels

    variants = [("this", triton_kernels)]
    for name, path in (spec.split("=", 1) for spec in args.module):
        variants.append((name, common.load_module(f"probe_attn_{name}", path)))
    dev = torch.device("cuda")
    machine, heads = common.device_name(dev), SHAPES[args.shape]
    for nodes in args.nodes:
        for batch in args.batches:
            for context in args.contexts:
                torch.manual_seed(0)
                pools = layer_pools(args.layers, batch, context, nodes, heads, dev)
                inputs = step_inputs(batch, context, nodes, dev)
                first = None
                for name, module, stack in runs(variants, nodes, args.stack):
                    us, out = measure(module, pools, inputs, batch, nodes, heads,
                                      args.replays, stack)
                    first = out if first is None else first
                    print(json.dumps({
                        "bench": "probe_decode_attn", "shape": args.shape, "variant": name,
                        "batch": batch,
                        "nodes": nodes, "stack": stack, "context": context,
                        "layers": args.layers,
                        "us_per_call": round(us, 3), "bits_of_first": torch.equal(out, first),
                        "commit": common.git_commit(), "machine": machine}), flush=True)


if __name__ == "__main__":
    main()
