"""Does an NGRAM engine's host work set a plain step's pace? One NGRAM engine decodes the same
held-out chat prompts (128 greedy tokens) a round at a time, its arms in turn:

- `plain`: held to plain steps, no shadow verifies (the scheduler's `shadow` taken away);
- `plain+shadow`: held to plain steps, the shadow verifies on every step (bench_adaptive's
  `plain` system);
- `adaptive`: its own controller (which at batch 64 on chat prompts decodes plain).

With --no-spec a no-spec engine runs instead (arm `no-spec`), so that two processes, one after
the other, put the engines side by side without a neighbour's graphs in either.

Per round: tok/s; the plain decode steps overlapped; the shadow verifies' rounds; per step the
seconds the host spent blocked on the step before's tokens (HostCopy.tolist), in the shadow
verifies and in the controller's choice; and the round's garbage collections
(benchmarks/stalls.py). Where the device sets the pace the host waits there for much of a step;
where the host does, that wait falls to nothing and the step's wall time grows by its work.
On one H200 at batch 64 (0327117) the host still waited 150-620 us a step with the shadow
verifies' 54-82 us and the choice's 32-52 us on it: the device set the pace
(docs/PERFORMANCE.md, "What sets a plain step's pace at batch 64").

    python benchmarks/probe_shadow_cost.py --batch 64 [--rounds 8] [--no-spec] [--out F.jsonl]
"""

from __future__ import annotations

import argparse
import gc
import time

import common

common.add_repo_to_path()

ARMS = ("plain", "plain+shadow", "adaptive")


class Timers:
    """Seconds spent in a few functions, patched on their classes while the probe runs."""

    def __init__(self, targets: dict):
        self.targets, self.spent, self.calls = targets, {}, {}
        self.saved = {}

    def __enter__(self):
        for name, (cls, attr) in self.targets.items():
            real = self.saved[name] = getattr(cls, attr)
            setattr(cls, attr, self._timed(name, real))
        return self

    def __exit__(self, *exc):
        for name, (cls, attr) in self.targets.items():
            setattr(cls, attr, self.saved[name])

    def _timed(self, name: str, real):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


def set_arm(engine, arm: str, own: tuple) -> None:
    """Puts the NGRAM engine in `arm`; own: its controller's use_spec and its shadow."""
    sched = engine.scheduler
    use_spec, shadow = own
    sched.adaptive.use_spec = use_spec if arm == "adaptive" else (lambda *a, **k: False)
    sched.shadow = None if arm == "plain" else shadow


def timers():
    from specpcg.scheduler import Scheduler
    from specpcg.speculative.shadow import ShadowVerify
    from specpcg.transfer import HostCopy

    return Timers({"blocked": (HostCopy, "tolist"), "shadow": (Scheduler, "_shadow_verify"),
                   "observe": (ShadowVerify, "observe"),
                   "choice": (Scheduler, "_next_speculates"),
                   "step": (Scheduler, "_run_overlapped")})


def round_record(arm: str, bs: int, tokens: int, dt: float, t: Timers, stalls: dict) -> dict:
    steps = t.calls.get("step", 0)
    per = lambda name: round(t.spent.get(name, 0.0) / steps * 1e6, 1) if steps else None  # noqa
    return {"arm": arm, "batch": bs, "tok_per_s": round(tokens / dt, 1), "overlapped_steps": steps,
            "shadow_rounds": t.calls.get("observe", 0),
            "wall_us_per_step": round(dt / steps * 1e6, 1) if steps else None,
            "blocked_us_per_step": per("blocked"), "shadow_us_per_step": per("shadow"),
            "choice_us_per_step": per("choice"), "step_call_us_per_step": per("step"),
            "stalls": stalls}


def run(args, extra: dict = None) -> list:
    """extra: more Engine arguments (the tests' CPU engine)."""
    from bench_adaptive import engine_kwargs, prompts_for
    from stalls import StallWatch

    from specpcg import Engine

    kw = engine_kwargs("no-spec" if args.no_spec else "adaptive", "NGRAM", None, (7, 1, 8))
    engine = Engine(model_path=args.model_path, show_progress=False,
                    max_running_requests=args.batch, **kw, **(extra or {}))
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    arms = ("no-spec",) if args.no_spec else ARMS
    own = None if args.no_spec else (engine.scheduler.adaptive.use_spec, engine.scheduler.shadow)
    prompts = prompts_for(engine, args.batch, args.prompt_len)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    records, watch = [], StallWatch(engine.device)
    with timers() as t:
        for arm in arms:  # one untimed batch each: graphs, buckets and caches warm
            if own:
                set_arm(engine, arm, own)
            engine.generate(input_ids=prompts, sampling_params=params)
        for r in range(args.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                if own:
                    set_arm(engine, arm, own)
                t.reset()
                before = watch.counts()
                common.synchronize(engine.device)
                t0 = time.perf_counter()
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                common.synchronize(engine.device)
                dt = time.perf_counter() - t0
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                records.append(round_record(arm, args.batch, tokens, dt, t, watch.since(before)))
                print(f"[probe_shadow_cost] {records[-1]}", flush=True)
    watch.close()
    engine.shutdown()
    info = {"bench": "shadow_cost", "git": common.git_commit(), "gc_threshold": gc.get_threshold(),
            **common.machine_info(engine.device)}
    return [{**info, **rec} for rec in records]


def summary(records: list) -> str:
    lines = ["arm | batch | tok/s (median) | wall us/step | blocked | shadow | choice"]
    for arm in dict.fromkeys(r["arm"] for r in records):
        rows = [r for r in records if r["arm"] == arm]
        med = lambda k: common.median(r[k] for r in rows if r[k] is not None)  # noqa: E731
        lines.append(f"{arm} | {rows[0]['batch']} | {med('tok_per_s'):,.0f} | "
                     f"{med('wall_us_per_step'):.0f} | {med('blocked_us_per_step'):.0f} | "
                     f"{med('shadow_us_per_step'):.0f} | {med('choice_us_per_step'):.0f}")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8, help="timed batches per arm")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-spec", action="store_true", help="a no-spec engine instead")
    p.add_argument("--gc-threshold", type=int, default=None,
                   help="the collector's first threshold, set once the engine is built")
    p.add_argument("--prompt-len", type=int, default=64, help="repeated-id prompts' length "
                   "(an engine without a tokenizer)")
    p.add_argument("--out", default=None, help="append the rounds as JSON lines here")
    return p.parse_args(argv)


def main(argv=None) -> list:
    args = parse(argv)
    records = run(args)
    print(summary(records))
    if args.out:
        common.append_jsonl(args.out, records)
    return records


if __name__ == "__main__":
    main()
