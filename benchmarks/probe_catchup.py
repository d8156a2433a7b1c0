"""Where a draft's catch-up after many plain steps spends its time (GPU).

An adaptive engine is scripted to run --plain plain steps, then 3 speculative ones (probe_switch's
`script_choices`), so each look's draft first catches up on every position the plain steps
passed: past the resume graphs' reach (drafts/resume.py), one eager DRAFT_EXTEND forward. Its
`catch_up_to_paths` and `_eager_catch_up` are timed between device synchronizations, and a
profiler records the outermost call (--profiler: cProfile, whose overhead is inside the times,
torch.profiler, or none, for clean times). Per batch size: one JSON line (milliseconds per
call), then cProfile's top functions by own and by cumulative time, in microseconds, or
torch.profiler's table of the last catch-up's ops.

    python benchmarks/probe_catchup.py --draft DIR [--batches 4 64] [--plain 100] [--out FILE]
        [--max-chunks N]  (N replays of the resume graphs reach further before going eager)
        [--profiler cprofile|torch|none] [--pinned]

--pinned: a pinned engine instead, no plain steps: the catch-ups are the draft's on each new
prompt, at the first speculative step after its prefill.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import common

common.add_repo_to_path()

TIMED = ("catch_up_to_paths", "_eager_catch_up")


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _TorchProfiles:
    """torch.profiler over each outermost catch-up (host ops and their device kernels); keeps
    the last one's table of ops by own host time."""

    def __init__(self):
        self.current, self.table = None, ""

    def enable(self):
        from torch.profiler import ProfilerActivity, profile

        import torch

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        self.current = profile(activities=acts)
        self.current.__enter__()

    def disable(self):
        self.current.__exit__(None, None, None)
        self.table = self.current.key_averages().table(sort_by="self_cpu_time_total",
                                                       row_limit=30)


class _NoProfile:
    def enable(self):
        pass

    def disable(self):
        pass


PROFILERS = {"cprofile": cProfile.Profile, "torch": _TorchProfiles, "none": _NoProfile}


def profile_catch_ups(draft, run, profiler: str = "cprofile") -> tuple:
    """Runs run() with the draft's catch-ups timed and the outermost ones profiled (a profiler
    of PROFILERS: cProfile's own overhead is inside the times it reports); returns
    ([(name, ms)], the profiler)."""
    prof, times, depth = PROFILERS[profiler](), [], [0]
    for name in TIMED:
        fn = getattr(draft, name)

        def timed(*a, fn=fn, name=name, **k):
            _sync()
            t0 = time.perf_counter()
            depth[0] += 1
            if depth[0] == 1:
                prof.enable()
            try:
                out = fn(*a, **k)
                _sync()
            finally:
                if depth[0] == 1:
                    prof.disable()
                depth[0] -= 1
            times.append((name, round(1000 * (time.perf_counter() - t0), 3)))
            return out
        setattr(draft, name, timed)
    try:
        run()
    finally:
        for name in TIMED:
            vars(draft).pop(name, None)
    return times, prof


def top(prof, order: str, n: int = 25) -> list:
    """The profile's n largest functions by `order` ("tottime" or "cumtime"): [function,
    calls, own us, cumulative us] (pstats' own print rounds to milliseconds)."""
    rows = [(f"{file.rsplit('/', 1)[-1]}:{line}({fn})", calls, tt, ct)
            for (file, line, fn), (_, calls, tt, ct, _) in pstats.Stats(prof).stats.items()]
    rows.sort(key=lambda r: r[2] if order == "tottime" else r[3], reverse=True)
    return [[name, calls, round(1e6 * tt, 1), round(1e6 * ct, 1)] for name, calls, tt, ct in rows[:n]]


def main(argv=None) -> None:
    from bench_accept import close
    from bench_adaptive import add_probe_args, probe_engine, prompts_for
    from drafts import resume
    from probe_switch import script_choices

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[4, 64])
    p.add_argument("--plain", type=int, default=100, help="plain steps before each look")
    p.add_argument("--pinned", action="store_true",
                   help="pinned speculation: the catch-ups are the prompts' after each prefill")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-chunks", type=int, default=None,
                   help="resume graph replays allowed per catch-up (drafts/resume.MAX_CHUNKS)")
    p.add_argument("--profiler", choices=list(PROFILERS), default="cprofile",
                   help="cprofile (its overhead inside the times), torch (ops and kernels) or none")
    p.add_argument("--out", default=None, help="append each batch's JSON line")
    args = p.parse_args(argv)
    if args.max_chunks is not None:
        resume.MAX_CHUNKS = args.max_chunks
    most = max(args.batches)
    engine, _ = probe_engine(args, "pinned" if args.pinned else "adaptive", most)
    if not args.pinned:
        script_choices(engine, args.plain, 3)
    draft = engine.scheduler.spec.draft
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    for bs in args.batches:
        prompts = prompts_for(engine, most, 128)[:bs]
        engine.generate(input_ids=prompts, sampling_params=params)  # graphs, compiles
        times, prof = profile_catch_ups(
            draft, lambda: engine.generate(input_ids=prompts, sampling_params=params),
            args.profiler)
        line = {"probe": "catchup", "batch": bs, "plain": None if args.pinned else args.plain,
                "ms": times, "prompt_lens": [len(x) for x in prompts],
                "max_chunks": resume.MAX_CHUNKS, "profiler": args.profiler,
                **common.machine_info(engine.device)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
        if args.profiler == "cprofile":
            for order in ("tottime", "cumtime"):
                print(json.dumps({"batch": bs, "top_by": order, "us": top(prof, order)}))
        elif args.profiler == "torch":
            print(f"batch {bs}: the last catch-up's ops\n{prof.table}", flush=True)
    close(engine)


if __name__ == "__main__":
    main()
