"""Triton kernels compiled while an engine serves: which kernels (and which specialization of
their integer arguments) compile after a first batch of each size has run, and how long the
host waited for each. A kernel that compiles inside a timed batch stalls the engine for the
compile (about 0.1-0.3 s on a GPU host); Triton specializes integer arguments on == 1 and on
divisibility by 16, so a length met for the first time can compile a new variant.

Every decode call slower than --slow-ms is logged too, with the compiles it contained.

    python benchmarks/probe_jit.py [--algorithm EAGLE3] [--draft DIR | --untrained]
        [--batches 1 16] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import common

common.add_repo_to_path()


def watch_compiles(events: list) -> None:
    """Logs every Triton compile (kernel, argument signature, seconds) into `events`."""
    from triton import knobs

    started = {}

    def before(**kw):
        started[str(kw.get("key"))] = time.perf_counter()
        return False  # compile as usual

    def after(**kw):
        t0 = started.pop(str(kw.get("key")), None)
        events.append({"kind": "compile", "kernel": getattr(kw.get("fn"), "name", "?"),
                       "repr": str(kw.get("repr"))[:400],
                       "s": None if t0 is None else round(time.perf_counter() - t0, 4)})

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


def watch_steps(engine, events: list, slow_s: float) -> None:
    """Logs each scheduler decode call slower than slow_s, after the compiles it held."""
    s = engine.scheduler
    for name in ("_run_decode", "_run_overlapped", "_run_spec_overlapped", "_run_prefill"):
        fn = getattr(s, name)

        def timed(*a, _fn=fn, _name=name, **k):
            n, bs, t0 = len(events), len(s.running), time.perf_counter()
            out = _fn(*a, **k)
            dt = time.perf_counter() - t0
            if dt > slow_s:
                events.append({"kind": "slow", "call": _name, "bs": bs, "s": round(dt, 4),
                               "compiles_inside": len(events) - n})
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
    events: list = []
    watch_compiles(events)
    watch_steps(engine, events, args.slow_ms / 1e3)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = prompts_for(engine, most, 128)
    lines = []
    for bs in args.batches:
        for rnd in range(args.rounds):
            n, t0 = len(events), time.perf_counter()
            outs = engine.generate(input_ids=prompts[:bs], sampling_params=params)
            wall = time.perf_counter() - t0
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            new = events[n:]
            line = {"probe": "jit", "algorithm": args.algorithm, "batch": bs, "round": rnd,
                    "tok_s": round(tokens / wall), "compiles": [e for e in new
                                                               if e["kind"] == "compile"],
                    "slow_calls": [e for e in new if e["kind"] == "slow"],
                    **common.machine_info(engine.device)}
            lines.append(line)
            print(json.dumps({k: line[k] for k in ("batch", "round", "tok_s")}),
                  f"{len(line['compiles'])} compiles,",
                  [(e["kernel"], e["s"]) for e in line["compiles"]][:12],
                  "slow:", [(e["call"], e["s"], e["compiles_inside"]) for e in line["slow_calls"]],
                  flush=True)
    if args.out:
        common.append_jsonl(args.out, lines)


if __name__ == "__main__":
    main()
