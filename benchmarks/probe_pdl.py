"""Programmatic dependent launch (PDL) on a chain of few-row linear layers (CUDA, Hopper on).

A batch-1 decode step is a chain of about 250 small kernels replayed from one CUDA graph, and
each waits for the one before to finish before it starts: its launch and its first reads of
weights (which depend on nothing before it) sit in that gap. With PDL a kernel may start while
the one before ends: it loads its first weights, then waits (`griddepcontrol.wait`) before it
reads the activations the kernel before wrote.

This probe runs the default model's linear layers as a chain of dependent calls, layer after
layer (qkv, o, gate/up with SiLU-and-mul, down; each layer's weights its own, out of L2 as in a
real step), captured in one CUDA graph, at 1 and 8 rows, through kernels/gemv_triton.gemv
with PDL off ("library") and on ("lib-pdl", kernels/dispatch.pdl, as the engine runs on
Hopper), each twice, alternating; then, past one row, each --tiles variant twice (PDL on, other
tiles for some depths: a split or a deep step makes a program's depth one step, whose weights
are read before the wait). Lines: rows, variant, us per call (a replay of the chain over
its calls), and whether the chain's output has the bits of the first run without PDL (a read
before the wait would show as a difference). The results files of d79f8e8 and 944702a also
list variants of copies of the kernels ("copy", "pdl", "pdl-early") that the probe then carried.
Each line also gives the largest difference from the first variant's output (a variant of
other sums differs in rounding only) and the output's largest value: without --norms the
chain's values fall to zero within a few layers (a SiLU-and-mul of small values is quadratic
in them), so only --norms (an RMSNorm of each layer's input and a residual before qkv and
gate/up, as in the model) makes the bits comparable. Every variant's inputs come from one seed.

    python benchmarks/probe_pdl.py [--layers 30] [--rows 1 8] [--norms] \
        [--tiles one5:576=32,128,4,1,5:1536=32,256,4,1,6 norm ...] [--cublas] [--rope] > out.txt
    python benchmarks/probe_pdl.py --plot OUT.png "LABEL=FILE:VARIANT+FILE:VARIANT" ...
"""

from __future__ import annotations

import argparse

import torch
import triton

import common

common.add_repo_to_path()

HIDDEN, QKV, INTER = 576, 960, 1536  # the default model's shapes


def parse_tiles(spec: str) -> tuple:
    """"NAME:576=32,128,4,1,5:960x576=32,1024,4,1,1" -> (NAME, {576: (32, 128, 4, 1, 5),
    (960, 576): ...}): tiles (BLOCK_N, BLOCK_K, warps, stages, SPLITS) by depth or by a
    weight's shape (which wins), with PDL on; other weights keep the library's tiling."""
    name, *pairs = spec.split(":")
    tiles = {}
    for pair in pairs:
        key, tile = pair.split("=")
        shape = tuple(int(v) for v in key.split("x"))
        tiles[shape if len(shape) == 2 else shape[0]] = tuple(int(v) for v in tile.split(","))
    return name, tiles


def call(variant: str, x, w, out, silu: bool, tiles: dict, norm: tuple | None = None) -> None:
    """kernels/gemv_triton.gemv with PDL off ("library", "nopdl...") or on (any other variant),
    with the variant's tile for w's shape or depth, if it has one; "cublas": what the model runs
    past gemv.MAX_ROWS rows (cuBLAS, then the SiLU-and-mul kernel for gate/up)."""
    import torch.nn.functional as F

    from kernels import dispatch, fused_ops
    from kernels.gemv_triton import gemv

    if variant == "cublas":
        if silu:
            fused_ops.silu_and_mul(F.linear(x, w), out=out)
        else:
            torch.mm(x, w.t(), out=out)
        return
    dispatch._pdl_devices[x.device.index or 0] = not variant.startswith(("library", "nopdl"))
    tile = tiles.get(tuple(w.shape), tiles.get(w.shape[1]))
    if norm is not None and "norm" not in variant:  # the norm's kernel, then the matmul
        residual, norm_weight, residual_out, normed = norm
        fused_ops.fused_add_rms_norm(x, residual, norm_weight, 1e-5, out=normed,
                                     residual_out=residual_out)
        x, norm = normed, None
    elif norm is not None:
        norm = (norm[0], norm[1], 1e-5, norm[2])
    gemv(x, w, None, out, silu, tile=tile, norm=norm)


def roped_qkv(x, w, bufs: dict, norms: bool) -> None:
    """The qkv projection as the model's roped launch (kernels/gemv_rope_triton.gemv_rope:
    the norm, the matmul, the rotary of q and k at each row's position, k and v to the caches
    at each row's slot), the default model's 9 heads of 64 and 3 of k and v."""
    from kernels import dispatch
    from kernels.gemv_rope_triton import gemv_rope

    if x.is_cuda:  # PDL on, as for every variant but "library"
        dispatch._pdl_devices[x.device.index or 0] = True
    norm = (bufs["res"] if norms else None, bufs["nw"], 1e-5, bufs["res2"] if norms else None)
    gemv_rope(x, w, None, bufs["qkv"], norm, bufs["rope"])


def rope_buffers(rows: int, dev) -> tuple:
    """gemv_rope's rope argument for `rows` rows: positions 37.., a cos/sin table, slots in
    reverse order, and caches of 64 slots."""
    half = torch.arange(32, device=dev) / 32
    angles = torch.arange(4096, device=dev)[:, None] * 10000.0 ** -half[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    cache = [torch.zeros(64, 3, 64, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    return (torch.arange(37, 37 + rows, device=dev), cos_sin,
            torch.arange(rows, device=dev).flip(0), *cache, 9, 3, 64)


def chain(variant: str, layers: list, x: torch.Tensor, bufs: dict, tiles: dict,
          norms: bool = False) -> torch.Tensor:
    """Every layer's four linear calls, each reading the one before's output. norms: qkv and
    gate/up each take an RMSNorm of their input plus a residual first, as in the model: in
    their launch where the variant's name says "norm", else the norm's kernel before them. A
    variant named with "rope" runs qkv as the roped launch (`roped_qkv`, its norm inside)."""
    h = x
    for qkv, o, gate_up, down in layers:
        norm = (bufs["res"], bufs["nw"], bufs["res2"], bufs["normed"]) if norms else None
        if "rope" in variant:
            roped_qkv(h, qkv, bufs, norms)
        else:
            call(variant, h, qkv, bufs["qkv"], False, tiles, norm)
        call(variant, bufs["qkv"][:, :HIDDEN], o, bufs["o"], False, tiles)
        norm = (bufs["res2"], bufs["nw"], bufs["res"], bufs["normed"]) if norms else None
        call(variant, bufs["o"], gate_up, bufs["act"], True, tiles, norm)
        call(variant, bufs["act"], down, bufs["h"], False, tiles)
        h = bufs["h"]
    return h


def measure(variant: str, layers: list, rows: int, replays: int, tiles: dict,
            norms: bool = False) -> tuple:
    dev = layers[0][0].device
    seeded = torch.Generator(device=dev).manual_seed(rows)  # every variant's inputs alike
    x = torch.randn(rows, HIDDEN, device=dev, generator=seeded).to(torch.bfloat16)
    bufs = {name: torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            for name, n in (("qkv", QKV), ("o", HIDDEN), ("act", INTER), ("h", HIDDEN),
                            ("res2", HIDDEN), ("normed", HIDDEN))}
    bufs["res"] = torch.randn(rows, HIDDEN, device=dev, generator=seeded).to(torch.bfloat16)
    bufs["nw"] = (torch.rand(HIDDEN, device=dev, generator=seeded) + 0.5).to(torch.bfloat16)
    bufs["rope"] = rope_buffers(rows, dev)
    start_res = bufs["res"].clone()
    chain(variant, layers, x, bufs, tiles, norms)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bufs["res"].copy_(start_res)  # each replay from the same residual
        out = chain(variant, layers, x, bufs, tiles, norms)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / (4 * len(layers)), out.clone()


def read_results(path: str) -> dict:
    """{(rows, variant): [us a call, ...]} of a results file this probe wrote."""
    found: dict = {}
    for line in open(path):
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[2] != "failed:":
            found.setdefault((int(parts[0]), parts[1]), []).append(float(parts[2]))
    return found


def plot(path: str, specs: list) -> None:
    """us a call by rows, a line a series: "LABEL=FILE:VARIANT+FILE:VARIANT..." (each point the
    median of the variant's lines at those rows)."""
    panel = {"title": "a chain of the default model's linear layers, us a call",
             "xlabel": "rows", "ylabel": "us a call", "logx": True, "series": {}}
    for spec in specs:
        label, sources = spec.split("=", 1)
        points = panel["series"].setdefault(label, [])
        for source in sources.split("+"):
            file, variant = source.rsplit(":", 1)
            for (rows, name), values in read_results(file).items():
                if name == variant:
                    points.append((rows, common.median(values)))
    common.line_plot([panel], path, "benchmarks/probe_pdl.py results")
    print(f"plot: {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot", nargs="+", metavar=("PNG", "SERIES"), default=None,
                   help="plot results files instead: PNG, then LABEL=FILE:VARIANT+... each")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--cublas", action="store_true", help="also cuBLAS (and SiLU-and-mul)")
    p.add_argument("--norms", action="store_true", help="qkv and gate/up after an RMSNorm, "
                   "in their launch for variants named with 'norm', else the norm's kernel")
    p.add_argument("--tiles", nargs="*", default=[],
                   help="variants with other tiles by depth (parse_tiles), rows past 1; PDL "
                   "on unless the name starts with nopdl")
    p.add_argument("--rope", action="store_true", help="also qkv as the roped launch ('rope', "
                   "kernels/gemv_rope_triton), beside 'norm' (the norm in the qkv launch)")
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot[0], args.plot[1:])
    dev = torch.device("cuda")
    torch.manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
    layers = [(weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * INTER, HIDDEN),
               weight(HIDDEN, INTER)) for _ in range(args.layers)]
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, "
          f"{args.layers} layers, {4 * args.layers} calls a chain", flush=True)
    for rows in args.rows:
        first = None
        variants = [("library", {}), ("lib-pdl", {})] * 2
        variants += [parse_tiles(t) for t in args.tiles] * 2 if rows > 1 else []
        variants += [("cublas", {})] * 2 if args.cublas else []
        variants += [("rope", {}), ("norm", {})] * 2 if args.rope else []
        for variant, tiles in variants:
            try:
                us, out = measure(variant, layers, rows, args.replays, tiles, args.norms)
            except Exception as err:  # noqa: BLE001 (a Triton without PDL, a GPU before Hopper)
                print(f"{rows:2d} {variant:14s} failed: {type(err).__name__}: {err}", flush=True)
                continue
            first = out if first is None else first
            diff = (out.float() - first.float()).abs().max().item()
            print(f"{rows:2d} {variant:14s} {us:6.2f} us a call  bits of the first: "
                  f"{torch.equal(out, first)}  max |diff| {diff:.3g}  "
                  f"max |out| {out.float().abs().max().item():.3g}", flush=True)


if __name__ == "__main__":
    main()
