"""Triton kernels compiled while an engine serves: which kernels (and which specialization of
their integer arguments) compile after a first batch of each size has run, and how long the
host waited for each. A kernel that compiles inside a timed batch stalls the engine for the
compile (about 0.1-0.3 s on a GPU host); Triton specializes integer arguments on == 1 and on
divisibility by 16, so a length met for the first time can compile a new variant.

Every scheduler call slower than --slow-ms is logged too, with what stalls.StallWatch counted
inside it (garbage collections, compiles, graph captures, the allocator's device calls).

    python benchmarks/probe_jit.py [--algorithm EAGLE3] [--draft DIR | --untrained]
        [--batches 1 16] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import common
from stalls import StallWatch

common.add_repo_to_path()


def watch_steps(engine, watch, slow: list, slow_s: float) -> None:
    """Logs into `slow` each scheduler call slower than slow_s, with what the watch (a
    stalls.StallWatch) counted inside it."""
    s = engine.scheduler
    for name in ("_run_decode", "_run_overlapped", "_run_spec_overlapped", "_run_prefill"):
        fn = getattr(s, name)

        def timed(*a, _fn=fn, _name=name, **k):
            bs, before, t0 = len(s.running), watch.counts(), time.perf_counter()
            out = _fn(*a, **k)
            dt = time.perf_counter() - t0
            if dt > slow_s:
                slow.append({"call": _name, "bs": bs, "s": round(dt, 4), **watch.since(before)})
            return out
        setattr(s, name, timed)


def main(argv=None) -> None:
    from bench_adaptive import add_probe_args, probe_engine, prompts_for

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3, help="batches of each size")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--pinned", action="store_true", help="speculate at every step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    most = max(args.batches)
    engine, _ = probe_engine(args, "pinned" if args.pinned else "adaptive", most)
    watch, slow = StallWatch(engine.device), []
    watch_steps(engine, watch, slow, args.slow_ms / 1e3)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = prompts_for(engine, most, 128)
    lines = []
    for bs in args.batches:
        for rnd in range(args.rounds):
            n, s, before = len(watch.compiles), len(slow), watch.counts()
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts[:bs], sampling_params=params)
            wall = time.perf_counter() - t0
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            line = {"probe": "jit", "algorithm": args.algorithm, "batch": bs, "round": rnd,
                    "tok_s": round(tokens / wall), "stalls": watch.since(before),
                    "compiles": watch.compiles[n:], "slow_calls": slow[s:],
                    **common.machine_info(engine.device)}
            lines.append(line)
            print(json.dumps({k: line[k] for k in ("batch", "round", "tok_s", "stalls")}),
                  [(e["kernel"], e["s"]) for e in line["compiles"]][:12], "slow:",
                  [{k: v for k, v in e.items() if k != "bs"} for e in line["slow_calls"]][:8],
                  flush=True)
    if args.out:
        common.append_jsonl(args.out, lines)


if __name__ == "__main__":
    main()
