"""Where a switch from plain decoding to speculation spends its time.

Up to e6fbb0f an adaptive engine's look at speculation started with one synchronous speculative
step: the draft first caught up on every position the plain steps passed, then drafted,
verified and read its accept lengths back before the overlapped pipeline could refill. On an
H200 such a call took 7-30 ms at batch 1-64 against steps of 1-2 ms (`probe_jit.py --draft`,
e6fbb0f), and the looks it opened cost a weakly trained EAGLE3 head 7-12% of no-spec at batch
4-64. Since, a head (and STANDALONE) catches up first, eagerly, and the look's first step is an
overlapped one (`catch_up_to_paths`); with no overlapped step possible (sampling, logprobs, a
request waiting) the synchronous step remains.

This probe scripts the engine's choice instead of measuring it: --plain K plain steps, then
--spec S speculative ones, over and over, through one batch per size. Each scheduler call is
timed as the engine runs it (one line per call: kind, batch, seconds, whether it followed a
switch); with --phases, the draft's catch-up before an overlapped step and the parts of every
synchronous speculative step (the draft's hand-over and catch-up, its proposal, the verify
forward, the accept, the commit) are timed too, each
between two device synchronizations (which stalls the overlapped pipeline, so run without it
for the calls' own times). The summary line per batch size: mean seconds of each call kind,
after a switch and steady, and the phases' means.

    python benchmarks/probe_switch.py [--algorithm EAGLE3] [--draft DIR | --untrained]
        [--batches 1 16 64] [--plain 64] [--spec 3] [--phases] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import defaultdict

import common

common.add_repo_to_path()

CALLS = {"_run_overlapped": "plain", "_run_spec_overlapped": "spec", "_run_decode": "sync"}


def script_choices(engine, plain: int, spec: int) -> None:
    """The engine speculates `spec` steps after every `plain` plain ones, whatever it measures
    (the controller still records every step)."""
    pattern = itertools.cycle([False] * plain + [True] * spec)
    engine.scheduler.adaptive.use_spec = lambda *args, **kwargs: next(pattern)


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def wrap(obj, name: str, log: list, entry, sync=None) -> None:
    """Times obj.name; entry(seconds) makes its log line. sync: called before and after."""
    fn = getattr(obj, name)

    def timed(*a, **k):
        if sync:
            sync()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        if sync:
            sync()
        log.append(entry(time.perf_counter() - t0))
        return out
    setattr(obj, name, timed)


def instrument(engine, phases: bool) -> list:
    """Times every decode call (and with `phases` the parts of a synchronous speculative
    step); returns the log."""
    import specpcg.speculative.loop as loop_module

    s, log = engine.scheduler, []
    for name, kind in CALLS.items():
        wrap(s, name, log, lambda sec, kind=kind: {"kind": kind, "bs": len(s.running), "s": sec})
    if phases:
        sync = lambda: _sync(engine.device)  # noqa: E731
        draft, loop = s.spec.draft, s.spec
        parts = [(draft, "_hand_over"), (draft, "catch_up_to_paths"),
                 (draft, "_eager_catch_up"), (draft, "propose"),
                 (loop, "_verify"), (loop, "_commit"), (loop_module, "accept")]
        for obj, name in parts:
            if hasattr(obj, name):
                wrap(obj, name, log, lambda sec, name=name: {"kind": "phase", "phase": name,
                                                             "s": sec}, sync)
    return log


def summarize(log: list) -> dict:
    """Mean seconds per call kind, split by whether the call followed a switch of side (the
    first call of each side after the other ran), and per phase."""
    sums = defaultdict(lambda: [0, 0.0])
    last = None
    for e in log:
        if e["kind"] == "phase":
            key = "phase " + e["phase"]
        else:
            side = e["kind"] != "plain"
            key = e["kind"] + (" after switch" if last is not None and side != last else "")
            last = side
        sums[key][0] += 1
        sums[key][1] += e["s"]
    return {k: {"calls": n, "mean_ms": round(1000 * t / n, 3)} for k, (n, t) in sums.items()}


def main(argv=None) -> None:
    from bench_accept import close
    from bench_adaptive import add_probe_args, probe_engine, prompts_for

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--plain", type=int, default=64, help="plain steps before each look")
    p.add_argument("--spec", type=int, default=3, help="speculative steps of each look")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--phases", action="store_true",
                   help="time a synchronous step's parts between device synchronizations")
    p.add_argument("--out", default=None, help="append JSON lines: each call, then the summary")
    args = p.parse_args(argv)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    most = max(args.batches)
    engine, draft = probe_engine(args, "adaptive", most)
    script_choices(engine, args.plain, args.spec)
    out = open(args.out, "a") if args.out else None
    for bs in args.batches:
        prompts = prompts_for(engine, most, 128)[:bs]
        engine.generate(input_ids=prompts, sampling_params=params)  # graphs, compiles
        log = instrument(engine, args.phases)
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        line = {"probe": "switch", "algorithm": args.algorithm, "draft": draft, "batch": bs,
                "plain": args.plain, "spec": args.spec, "phases": args.phases,
                "wall_s": round(time.perf_counter() - t0, 4), "calls": summarize(log),
                **common.machine_info(engine.device)}
        print(json.dumps(line), flush=True)
        if out:
            for e in log:
                out.write(json.dumps({"batch": bs, **e}) + "\n")
            out.write(json.dumps(line) + "\n")
        unwrap(engine)
    close(engine)
    if out:
        out.close()


def unwrap(engine) -> None:
    """Drops the timers (instance attributes over the class's methods; the module's accept
    is put back from its own module)."""
    import specpcg.speculative.loop as loop_module
    from specpcg.speculative.accept import accept

    s = engine.scheduler
    for obj in (s, s.spec, s.spec.draft):
        for name in list(vars(obj)):
            if name in CALLS or name in ("_hand_over", "catch_up_to_paths", "_eager_catch_up",
                                         "propose", "_verify", "_commit"):
                del vars(obj)[name]
    loop_module.accept = accept


if __name__ == "__main__":
    main()
