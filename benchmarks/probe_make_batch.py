"""The host's time to build a forward's batch (`specpcg.batch.make_batch`) of several tokens a
request: a prefill, a verify, a draft's eager catch-up. A real KV cache on the CPU; the copy to
the device is a memcpy here, so what is timed is the Python and numpy work. With --tree
NAME=DIR, DIR's `specpcg/batch.py` is timed beside this tree's in the same process, the two
taking turns a round at a time. Medians of --repeats calls, the least of --rounds.

    python benchmarks/probe_make_batch.py [--cells 1x8 64x8 8x512 64x250] [--tree old=DIR]
        [--repeats 200] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

import common

common.add_repo_to_path()

CELLS = ("1x8", "1x64", "16x8", "16x64", "64x8", "64x64", "8x512", "64x250")
CACHED = 100  # positions each request holds before the batch's tokens


def setup(bs: int, n: int) -> tuple:
    from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool

    kv = KVCache(KVPool(bs * (CACHED + n) + 1, 1, 1, 4, torch.float32, "cpu"),
                 ReqToTokenPool(bs, CACHED + n, "cpu"))
    reqs = []
    for _ in range(bs):
        row = kv.new_request()
        kv.extend(row, CACHED + n)
        reqs.append(SimpleNamespace(req_pool_idx=row, num_cached=CACHED))
    return kv, reqs, [[(7 * i + j) % 1000 for j in range(n)] for i in range(bs)]


def timed(make_batch, kv, reqs, ids, repeats: int) -> float:
    from specpcg.core import ForwardMode

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        make_batch(kv, ForwardMode.EXTEND, reqs, ids, "cpu")
        times.append(time.perf_counter() - start)
    return common.median(times) * 1e6


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", default=list(CELLS), help="BATCHxTOKENS a request")
    p.add_argument("--tree", default=None, metavar="NAME=DIR", help="another tree's batch.py")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    here = common.REPO_ROOT / "specpcg" / "batch.py"
    trees = {"this": common.load_module("batch_this", here)}
    if args.tree:
        name, path = args.tree.split("=", 1)
        trees[name] = common.load_module(f"batch_{name}", f"{path}/specpcg/batch.py")
    lines = []
    for cell in args.cells:
        bs, n = map(int, cell.split("x"))
        kv, reqs, ids = setup(bs, n)
        best = {name: float("inf") for name in trees}
        for _ in range(args.rounds):
            for name, module in trees.items():
                best[name] = min(best[name], timed(module.make_batch, kv, reqs, ids, args.repeats))
        line = {"bench": "probe_make_batch", "batch": bs, "tokens_per_request": n,
                **{f"us_{name}": round(us, 1) for name, us in best.items()},
                **common.machine_info(torch.device("cpu"))}
        print(f"[probe_make_batch] {bs:3} x {n:3}: " + ", ".join(
            f"{name} {us:.1f} us" for name, us in best.items()), flush=True)
        lines.append(line)
    if args.out:
        common.append_jsonl(args.out, lines)
    return lines


if __name__ == "__main__":
    main()
