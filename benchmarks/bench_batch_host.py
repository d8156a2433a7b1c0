"""Host time of building a draft's catch-up batch (no GPU needed): the slots written to
req_to_token on the host before the batch (`extend_many` + `make_batch`), against leaving them
to the forward (`alloc_batch`, rows_pending: the runner writes them from the batch's tensors).

A request's draft catches up on every position its plain steps passed; after 94 plain steps at
batch 64 that is about 6,000 positions in one batch. Per (batch, positions per request), the
median microseconds of each way over --repeats builds, side by side in one run; the second way
includes the row write the forward then does (on a CPU device it runs at once).

    python benchmarks/bench_batch_host.py [--shapes 1x100 4x100 16x100 64x94] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import NamedTuple

import common

common.add_repo_to_path()

import torch  # noqa: E402

from specpcg.batch import alloc_batch, make_batch  # noqa: E402
from specpcg.core import ForwardMode  # noqa: E402
from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool  # noqa: E402

PROMPT = 128  # positions each request holds before its catch-up


class _Row(NamedTuple):  # what make_batch reads of a request
    req_pool_idx: int
    num_cached: int


def _cache(batch: int, positions: int, repeats: int) -> KVCache:
    slots = batch * (PROMPT + positions * (repeats + 1)) + 1
    return KVCache(KVPool(slots, 1, 1, 8, torch.float32, "cpu"),
                   ReqToTokenPool(batch, PROMPT + positions * (repeats + 1), "cpu"))


def time_us(batch: int, positions: int, repeats: int, rows_pending: bool) -> float:
    """Median microseconds to allocate and build one catch-up batch (its rows written)."""
    kv, rng = _cache(batch, positions, repeats), random.Random(0)
    idx = [kv.new_request() for _ in range(batch)]
    kv.extend_many(idx, [PROMPT] * batch)
    times = []
    for rep in range(repeats):
        rows = [_Row(i, PROMPT + rep * positions) for i in idx]
        ids = [[rng.randrange(49152) for _ in range(positions)] for _ in range(batch)]
        t0 = time.perf_counter()
        if rows_pending:
            kv.write_rows(alloc_batch(kv, ForwardMode.DRAFT_EXTEND, rows, ids, "cpu"))
        else:
            kv.extend_many(idx, [positions] * batch)
            make_batch(kv, ForwardMode.DRAFT_EXTEND, rows, ids, "cpu")
        times.append(time.perf_counter() - t0)
    return 1e6 * common.median(times)


def render_table(records: list) -> str:
    latest = [r for r in records if r.get("git") == records[-1].get("git")] if records else []
    rows = [[str(r["batch"]), str(r["positions"]), f"{r['host_rows_us']:.0f}",
             f"{r['pending_rows_us']:.0f}", f"{r['ratio']:.2f}x"] for r in latest]
    return common.markdown_table(["batch", "positions per request", "rows on the host (us)",
                                  "rows left to the forward (us)", "speedup"], rows)


def render_plot(records: list, path) -> None:
    latest = [r for r in records if r.get("git") == records[-1].get("git")] if records else []
    panel = {"title": "a catch-up batch's host time", "ylabel": "us",
             "labels": [f"bs {r['batch']} x {r['positions']}" for r in latest],
             "values": {"rows on the host": [r["host_rows_us"] for r in latest],
                        "rows left to the forward": [r["pending_rows_us"] for r in latest]}}
    common.grouped_bar_plot([panel], ["rows on the host", "rows left to the forward"], path,
                            "building a draft's catch-up batch")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x100", "4x100", "16x100", "64x94"],
                   help="BATCHxPOSITIONS: requests, and positions each catches up on")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "batch_host.jsonl"))
    args = p.parse_args(argv)
    import platform

    lines = []
    for shape in args.shapes:
        batch, positions = (int(x) for x in shape.split("x"))
        host = time_us(batch, positions, args.repeats, rows_pending=False)
        pending = time_us(batch, positions, args.repeats, rows_pending=True)
        lines.append({"bench": "batch_host", "batch": batch, "positions": positions,
                      "host_rows_us": host, "pending_rows_us": pending, "ratio": host / pending,
                      "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
                      "cpu": platform.processor() or platform.machine(),
                      "git": common.git_commit(), "time": common.now_iso()})
        print(f"[batch_host] bs {batch} x {positions}: {host:.0f} us -> {pending:.0f} us",
              flush=True)
    common.append_jsonl(args.out, lines)
    common.render_results(args.out, render_table, render_plot)


if __name__ == "__main__":
    main()
