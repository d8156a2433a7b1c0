"""Every scheduler call of one batch, timed: where an adaptive engine's time goes, against the
same prompts pinned to speculation and without speculation (--systems: one per process keeps
each engine's GPU memory its own).

Per system and batch size, one untimed batch, then --rounds batches (the adaptive engine's
state carrying from one to the next, as in bench_adaptive's repeats) with every scheduler call
logged: its kind (prefill, plain, spec, a synchronous decode, a flush of the other side's step
in flight), the running batch, the wall seconds, the tokens it appended and the fewest and most
outputs a running request holds after it; and every step the adaptive controller recorded
(side, tokens, seconds), every choice it made, every side it borrowed for a step after a
prefill, and every step's side with what chose it where it switched ("use"). The summary line
per system, batch and round sums each kind's calls, lists each request's accept length, sets
the controller's recorded rates beside the calls' real ones (a side whose recorded steps run
faster than its calls do is over-measured), and sums the host's time outside the calls
("outside": before the first, between two, after the last, the largest gaps).

With --script P S the adaptive engine runs S speculative steps after every P plain ones
(probe_switch's `script_choices`), whatever it measures: a look every P steps, to set a look's
speculative steps beside pinned speculation's steady ones.

    python benchmarks/probe_adaptive_steps.py [--algorithm NGRAM] [--draft DIR | --untrained]
        [--batches 16 64] [--max-new-tokens 128] [--systems adaptive] [--script P S]
        [--rounds N] [--profile N] [--log-untimed] [--out FILE]

With --profile N, one more batch per system and size runs under cProfile: its N heaviest engine
functions by self time and by cumulative time, printed and written as lines
`"probe": "adaptive_steps_profile"` (two engines profiled alike show which host work one of
them adds; cProfile's seconds are several times the real ones).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from statistics import median

import common

common.add_repo_to_path()

from bench_adaptive import EXTRA_SYSTEMS  # noqa: E402
from specpcg.speculative.bucket import bucket_of  # noqa: E402

SYSTEMS = ("no-spec", "pinned", "adaptive")
WRAPPED = ("record", "_choose", "_borrowed", "use_spec")  # the controller's, by instrument()
CALLS = {"_run_prefill": "prefill", "_run_overlapped": "plain", "_run_spec_overlapped": "spec",
         "_run_decode": "sync"}


def instrument(engine) -> list:
    """Wraps the scheduler's step kinds, flushes and the controller's record; returns the log
    each call appends to (dicts)."""
    s, log, seen = engine.scheduler, [], {}

    def appended() -> int:
        for r in s.running:
            seen[id(r)] = r
        return sum(len(r.output_ids) for r in seen.values())

    def wrap(obj, name: str, kind: str) -> None:
        fn = getattr(obj, name)

        def timed_call(*a, **k):
            bs, before, t0 = len(s.running), appended(), time.perf_counter()
            out = fn(*a, **k)
            lens = [len(r.output_ids) for r in s.running] or [0]
            # The running batch's spread of outputs: how far speculation's leaders run ahead of
            # the request that ends the batch.
            log.append({"kind": kind, "bs": bs, "t": t0, "s": time.perf_counter() - t0,
                        "tokens": appended() - before, "out_min": min(lens),
                        "out_max": max(lens)})
            inflight = getattr(s.spec_overlap, "inflight", None)
            if kind == "spec" and inflight is not None:  # the chain depth it launched
                log[-1]["width"] = inflight.width
            return out
        setattr(obj, name, timed_call)

    for name, kind in CALLS.items():
        wrap(s, name, kind)
    for ov, kind in ((s.overlap, "flush-plain"), (s.spec_overlap, "flush-spec")):
        if ov is not None:
            wrap(ov, "flush", kind)
    if s.adaptive is not None:
        record = s.adaptive.record

        def logged(batch_size, spec, tokens, seconds):
            log.append({"kind": "record", "bs": batch_size, "spec": spec, "tokens": tokens,
                        "s": seconds})
            record(batch_size, spec, tokens, seconds)
        s.adaptive.record = logged
        choose = s.adaptive._choose

        def chosen(b, finish, *rest):
            # NOTE: the log once cleared last_finish before each choice, to log only estimates
            # made by it; the controller reads it between choices (Bucket.lead, look_share),
            # so the logged engine chose otherwise than the real one. A fresh estimate is a new
            # tuple instead.
            before = b.last_finish
            spec = choose(b, finish, *rest)
            fresh = b.last_finish is not before
            log.append({"kind": "choose", "bs": len(s.running), "spec": spec,
                        "waiting": len(s.waiting), "finish_s": b.last_finish if fresh else None,
                        "rates": [b.spec.tok_s, b.decode.tok_s],
                        "step_s": [b.spec.step_s, b.decode.step_s],
                        "switch_s": [b.switches.cost(True), b.switches.cost(False)],
                        "accepts": len(s.adaptive.accepts)})
            return spec
        s.adaptive._choose = chosen
        borrowed = s.adaptive._borrowed

        def borrowed_logged(key):
            spec = borrowed(key)
            log.append({"kind": "borrowed", "bs": len(s.running), "spec": spec,
                        "buckets": {k: b.spec_chosen for k, b in s.adaptive._buckets.items()}})
            return spec
        s.adaptive._borrowed = borrowed_logged
        wrap_use_spec(s.adaptive, log)
    return log


def wrap_use_spec(ctrl, log: list) -> None:
    """Logs every step's side ("use"), with what chose it where the side switched
    (switches.SWITCH_WHY), the bucket's steps since and between its looks, the draft's lag
    where the controller counted it for this step, and the call's own microseconds ("us",
    this logging outside them: probe_controller_host.py)."""
    use_spec = ctrl.use_spec

    def used(batch_size, finish=None, behind=None, position=None):
        before = Counter(ctrl.switched)
        t0 = time.perf_counter()
        spec = use_spec(batch_size, finish, behind, position)
        us = (time.perf_counter() - t0) * 1e6
        b = ctrl._buckets.get(bucket_of(batch_size))  # None: a hold never asked the controller
        why = [why for (_, why), n in (ctrl.switched - before).items() if n]
        log.append({"kind": "use", "us": us, "bs": batch_size, "spec": spec,
                    "why": why[0] if why else None,
                    "since_look": b and b.since_explore, "look_every": b and b.explore_every,
                    "lag": ctrl._behind if isinstance(ctrl._behind, int) else None})
        return spec
    ctrl.use_spec = used


def gaps(log: list, start: float, end: float) -> dict:
    """The host's time outside the timed calls: before the first, between two (summed, and the
    largest few with the call after them), after the last."""
    calls = [e for e in log if "t" in e]
    if not calls:
        return {}
    between = [(b["t"] - a["t"] - a["s"], i + 1) for i, (a, b) in enumerate(zip(calls, calls[1:]))]
    largest = sorted(between, reverse=True)[:5]
    return {"before_first_s": round(calls[0]["t"] - start, 5),
            "between_s": round(sum(g for g, _ in between), 5),
            "after_last_s": round(end - calls[-1]["t"] - calls[-1]["s"], 5),
            "largest": [[round(g, 5), i, calls[i]["kind"]] for g, i in largest]}


def periods(log: list, width: int = 8) -> dict:
    """Per side ("plain", "spec"), a step's period (the start of its call to the start of the
    next call of the same side) by running batch size in bins of `width`: [steps, median ms].
    A step's time includes the host's work after its call; a side whose batch thins (a
    speculating batch of 64) runs its later steps cheaper, which its bucket's one price misses."""
    calls = [e for e in log if "t" in e]
    by = defaultdict(lambda: defaultdict(list))
    for a, b in zip(calls, calls[1:]):
        if a["kind"] in ("plain", "spec") and b["kind"] == a["kind"]:
            by[a["kind"]][a["bs"] // width * width].append((b["t"] - a["t"]) * 1e3)
    return {kind: {size: [len(v), round(median(v), 3)] for size, v in sorted(bins.items())}
            for kind, bins in by.items()}


def summary(log: list, wall: float, tokens: int) -> dict:
    """Per call kind: calls, seconds, tokens; per recorded side: steps, tokens per request and
    step, and the rate the controller saw against the side's calls' own."""
    kinds = defaultdict(lambda: {"calls": 0, "s": 0.0, "tokens": 0})
    rec = defaultdict(lambda: {"steps": 0, "s": 0.0, "per_req": 0.0})
    for e in log:
        if e["kind"] in ("choose", "borrowed", "use"):
            continue
        if e["kind"] == "record":
            r = rec["spec" if e["spec"] else "plain"]
            r["steps"] += 1
            r["s"] += e["s"]
            r["per_req"] += e["tokens"] / e["bs"]
        else:
            k = kinds[e["kind"]]
            k["calls"] += 1
            k["s"] += e["s"]
            k["tokens"] += e["tokens"]
    for r in rec.values():
        r["tok_s_per_req"] = round(r["per_req"] / r["s"], 1) if r["s"] else 0.0
        r["s"], r["per_req"] = round(r["s"], 4), round(r["per_req"], 1)
    for k in kinds.values():
        k["s"] = round(k["s"], 4)
    # A switch flushes the other side's step in flight, so the two sides' calls never meet.
    sides = [e["kind"] for e in log if e["kind"] in ("plain", "spec")]
    switches = sum(a != b for a, b in zip(sides, sides[1:]))
    return {"wall_s": round(wall, 4), "tok_s": round(tokens / wall), "calls": dict(kinds),
            "recorded": dict(rec), "plain_spec_switches": switches}


def logged_round(engine, args, system: str, bs: int, rnd: int, prompts: list, params: dict,
                 out) -> None:
    """One batch with every scheduler call logged: its summary line printed, and with `out`
    each call's line then the summary appended."""
    adaptive = engine.scheduler.adaptive
    # A hold (bench_adaptive's HOLDS) may have set one of these on the controller itself: it
    # is put back below, else the hold held the first round only.
    held = {k: v for k, v in vars(adaptive).items() if k in WRAPPED} if adaptive else {}
    log = instrument(engine)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    end = time.perf_counter()
    wall = end - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    line = {"probe": "adaptive_steps", "system": system, "algorithm": args.algorithm,
            "script": args.script if system == "adaptive" else None,
            "batch": bs, "round": rnd, **summary(log, wall, tokens),
            "outside": gaps(log, t0, end), "period_ms_by_size": periods(log),
            "accept_lengths": sorted(round(o["meta_info"].get("spec_accept_length", 0), 3)
                                     for o in outs),
            "output_digests": [common.output_digest(o["output_ids"]) for o in outs],
            **({"output_ids": [o["output_ids"] for o in outs]} if args.log_outputs else {}),
            **common.machine_info(engine.device)}
    print(json.dumps(line), flush=True)
    if out:
        for e in log:
            out.write(json.dumps({"system": system, "batch": bs, "round": rnd, **e}) + "\n")
        out.write(json.dumps(line) + "\n")
    for name in CALLS:  # drop the wrappers
        engine.scheduler.__dict__.pop(name, None)
    for ov in (engine.scheduler.overlap, engine.scheduler.spec_overlap):
        if ov is not None:
            ov.__dict__.pop("flush", None)
    if adaptive is not None:
        for name in WRAPPED:
            adaptive.__dict__.pop(name, None)
        adaptive.__dict__.update(held)


def untimed_round(engine, args, system: str, bs: int, prompts: list, params: dict, out,
                  watch) -> None:
    """The batch before the logged ones: untimed, or with --log-untimed logged as round -1
    with what could stall it. A first engine's first speculative steps may compile kernels
    or read cold buffers, and the controller's rates keep them (the module docstring)."""
    if watch is None:
        engine.generate(input_ids=prompts, sampling_params=params)
        return
    before = watch.counts()
    logged_round(engine, args, system, bs, -1, prompts, params, out)
    line = json.dumps({"probe": "adaptive_steps_stalls", "system": system, "batch": bs,
                       "round": -1, "stalls": watch.since(before)})
    print(line, flush=True)
    if out:
        out.write(line + "\n")


def profiled_round(engine, system: str, bs: int, prompts: list, params: dict, top: int,
                   out) -> None:
    """One more batch under cProfile (the module docstring's --profile)."""
    from profiling import print_rows, profile_rows

    for sort in ("tottime", "cumtime"):
        rows = profile_rows(lambda: engine.generate(input_ids=prompts, sampling_params=params),
                            top, sort)
        print_rows(f"{system}, batch {bs}, by {sort}:", rows)
        if out:
            out.write(json.dumps({"probe": "adaptive_steps_profile", "system": system,
                                  "batch": bs, "sort": sort, "rows": rows,
                                  **common.machine_info(engine.device)}) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--algorithm", default="NGRAM")
    p.add_argument("--draft", default=None)
    p.add_argument("--untrained", action="store_true", help="a random head (bench_adaptive's)")
    p.add_argument("--setting", default="3,1,4", help="steps,topk,tokens (bench_adaptive's)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                   choices=SYSTEMS + EXTRA_SYSTEMS,
                   help="bench_adaptive's holds too (adaptive-min16, plain, ...)")
    p.add_argument("--rounds", type=int, default=1,
                   help="logged batches per size, after the untimed one (bench_adaptive's "
                        "--repeats: the adaptive engine's state carries from one to the next)")
    p.add_argument("--script", type=int, nargs=2, default=None, metavar=("PLAIN", "SPEC"))
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then one batch per size under cProfile: its N heaviest functions")
    p.add_argument("--out", default=None,
                   help="append JSON lines: one per call, then the summary")
    p.add_argument("--log-untimed", action="store_true",
                   help="log the untimed batch too (round -1), with the Triton compiles, "
                        "collections and captures in it (stalls.StallWatch)")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 on CUDA)")
    p.add_argument("--log-outputs", action="store_true",
                   help="each request's output ids in its round's summary line")
    args = p.parse_args(argv)
    from bench_accept import close
    from bench_adaptive import HOLDS, engine_kwargs, prompts_for, untrained_drafts
    from specpcg import Engine

    if args.untrained:
        args.draft = untrained_drafts([args.algorithm], args.model_path)[args.algorithm]

    setting = common.parse_setting(args.setting)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    out = open(args.out, "a") if args.out else None
    watch = None
    for system in args.systems:
        most = max(args.batches)  # as bench_adaptive sizes its engines
        engine = Engine(model_path=args.model_path, show_progress=False, dtype=args.dtype,
                        max_running_requests=most, cuda_graph_max_bs=most,
                        **engine_kwargs(system, args.algorithm, args.draft, setting))
        if system in HOLDS:
            HOLDS[system](engine)
        if args.log_untimed and watch is None:
            from stalls import StallWatch

            watch = StallWatch(engine.device)  # process-wide hooks: one for every engine
        if args.script and system == "adaptive":
            from probe_switch import script_choices

            script_choices(engine, *args.script)
        for bs in args.batches:
            prompts = prompts_for(engine, max(args.batches), 128)[:bs]
            untimed_round(engine, args, system, bs, prompts, params, out, watch)
            for rnd in range(args.rounds):
                logged_round(engine, args, system, bs, rnd, prompts, params, out)
            if args.profile:
                profiled_round(engine, system, bs, prompts, params, args.profile, out)
        # NOTE: shutdown alone left the next engine no memory for its KV cache (H100, 7f5f586).
        close(engine)
    if out:
        out.close()


if __name__ == "__main__":
    main()
