"""Decode throughput by parallel layout (tp x pp), and one GPU against other code side by side.

Each (code, layout) runs in a process of its own: a parallel engine owns its process group,
and another checkout's code (--code DIR, e.g. the commit before parallelism landed, from `git
archive`; measured at 1x1 only) imports its own specpcg. Default model in its default dtype; each batch is --batches
greedy requests of --prompt-len random ids and --max-new-tokens new tokens, EOS ignored; output
tok/s is the median of --repeats after a warm-up batch. --rounds alternates the systems that
many times, so a drift of the machine falls on all of them.

    python benchmarks/bench_parallel.py --layouts 1x1 1x2                  # pp 2 on 2 GPUs
    python benchmarks/bench_parallel.py --layouts 1x1 --code /tmp/before --rounds 2
    python benchmarks/bench_parallel.py --table-only benchmarks/results/parallel.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common

WORKER = "--worker"


def measure(spec: dict) -> list:
    """In the worker process: [{batch, tok_s, ...}] for the engine `spec` describes."""
    import random

    import torch

    from specpcg import Engine

    tp, pp = spec["layout"]
    engine = Engine(model_path=spec["model_path"], tp_size=tp, pp_size=pp, show_progress=False)
    params = {"max_new_tokens": spec["new"], "temperature": 0, "ignore_eos": True}
    rng, out = random.Random(0), []
    try:
        for bs in spec["batches"]:
            ids = [[rng.randrange(100, 30000) for _ in range(spec["prompt_len"])]
                   for _ in range(bs)]
            engine.generate(input_ids=ids, sampling_params=params)  # warm-up
            times = []
            for _ in range(spec["repeats"]):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                t0 = time.perf_counter()
                engine.generate(input_ids=ids, sampling_params=params)
                times.append(time.perf_counter() - t0)
            sec = common.median(times)
            out.append({"batch": bs, "tok_s": bs * spec["new"] / sec, "seconds": sec})
    finally:
        engine.shutdown()
    return out


def run_system(code: str, layout: tuple, args) -> list:
    """Runs one system in a fresh process with `code` first on its path; its JSON result."""
    spec = {"layout": layout, "model_path": args.model_path, "batches": args.batches,
            "prompt_len": args.prompt_len, "new": args.max_new_tokens, "repeats": args.repeats}
    return common.run_json_worker(__file__, WORKER, spec, code)


def code_label(code: str) -> str:
    here = os.path.realpath(common.REPO_ROOT)
    if os.path.realpath(code) == here:
        return common.git_commit() or "this checkout"
    name = os.path.basename(code.rstrip("/"))
    if not os.path.exists(os.path.join(code, ".git")):  # an archive: its folder names it
        return name
    head = subprocess.run(["git", "-C", code, "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True)
    return head.stdout.strip() or name


def run_all(args) -> None:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    codes = [str(common.REPO_ROOT)] + args.code
    layouts = [tuple(int(x) for x in text.split("x")) for text in args.layouts]
    for rnd in range(args.rounds):
        for layout in layouts:
            for code in codes if layout == (1, 1) else codes[:1]:  # other code: one GPU only
                label = code_label(code)
                print(f"round {rnd + 1}: {label} at tp x pp = {layout}", flush=True)
                for point in run_system(code, layout, args):
                    common.append_jsonl(args.out, [{
                        "bench": "parallel", **common.machine_info(device),
                        "time": common.now_iso(), "system": f"{label} tp{layout[0]}pp{layout[1]}",
                        "code": label, "tp": layout[0], "pp": layout[1], "round": rnd,
                        "prompt_len": args.prompt_len, "new_tokens": args.max_new_tokens,
                        **point}])


def _cells(records: list) -> dict:
    """{system: {batch: median tok/s over rounds}} of the last device's lines."""
    last = [r for r in records if r.get("bench") == "parallel"]
    if not last:
        raise ValueError("no parallel benchmark lines to render")
    rows: dict = {}
    for r in last:
        if r["device"] == last[-1]["device"]:
            rows.setdefault(r["system"], {}).setdefault(r["batch"], []).append(r["tok_s"])
    return {s: {b: common.median(v) for b, v in cols.items()} for s, cols in rows.items()}


def render_table(records: list) -> str:
    cells = _cells(records)
    systems, batches = list(cells), sorted({b for c in cells.values() for b in c})
    first = cells[systems[0]]
    cols = [("system", lambda s: s)]
    cols += [(f"bs {b} tok/s", lambda s, b=b: cells[s].get(b)) for b in batches]
    cols += [(f"bs {b} vs {systems[0]}", lambda s, b=b: common.ratio(cells[s].get(b),
                                                                      first.get(b)))
             for b in batches]
    return common.column_table(systems, cols)


def render_plot(records: list, png) -> None:
    cells = _cells(records)
    common.line_plot([{"title": "decode throughput by layout", "xlabel": "batch size",
                       "ylabel": "output tok/s", "logx": True, "logy": True,
                       "series": {s: sorted(c.items()) for s, c in cells.items()}}],
                     png, f"bench_parallel on {records[-1]['device']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--layouts", nargs="+", default=["1x1"], help="TPxPP, e.g. 1x1 1x2 2x1")
    p.add_argument("--code", nargs="*", default=[], metavar="DIR",
                   help="other checkouts measured beside this one, at 1x1")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "parallel.jsonl"))
    common.measure_or_render(p, argv, run_all, render_table, render_plot)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER:
        print(json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
