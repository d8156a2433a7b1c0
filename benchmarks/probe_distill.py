"""Where the trainer's self-distillation time goes: the target answering N training prompts.

Runs `drafts.distill.self_distill` on the trainer's default data with the trainer's engine
settings, and times every scheduler step by kind (prefill or decode), with its batch size and
its tokens. One JSON line: answers and tokens per second, then per kind the number of steps,
their total seconds, and their mean requests and tokens. A generation that spends most of its
time in prefill steps of a few requests each is admission-bound, not decode-bound.

    python benchmarks/probe_distill.py --num-prompts 3000 [--out FILE] [--engine-kw JSON]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import common

common.add_repo_to_path()


def _timed_steps(sched, stats: dict) -> None:
    """Wraps the scheduler's step kinds so each call adds (seconds, requests, tokens)."""
    def wrap(name: str, kind: str, count):
        fn = getattr(sched, name)

        def timed(*args):
            start, reqs, tokens = time.perf_counter(), *count(args)
            out = fn(*args)
            s = stats[kind]
            s["steps"] += 1
            s["s"] += time.perf_counter() - start
            s["reqs"] += reqs
            s["tokens"] += tokens
            return out
        setattr(sched, name, timed)

    wrap("_run_prefill", "prefill", lambda a: (len(a[0]), sum(n for _, n in a[0])))
    running = lambda a: (len(sched.running), len(sched.running))  # noqa: E731
    wrap("_run_overlapped", "decode", running)
    wrap("_run_decode", "decode", running)


def main() -> None:
    from drafts.data import DEFAULT_DATA, training_samples
    from drafts.distill import self_distill
    from drafts.train import TrainOptions, _make_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=3000)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--engine-kw", default="{}", help="JSON: engine options to override")
    ap.add_argument("--out", default=None, help="JSON lines file to append to")
    args = ap.parse_args()
    o = TrainOptions(num_prompts=args.num_prompts, show_progress=False)
    samples = training_samples(args.data, o.num_prompts, o.seed)
    extra = json.loads(args.engine_kw)
    engine = _make_engine(None, o, **extra)
    stats = defaultdict(lambda: {"steps": 0, "s": 0.0, "reqs": 0, "tokens": 0})
    _timed_steps(engine.scheduler, stats)
    start = time.perf_counter()
    seqs = self_distill(engine, samples, o.max_new_tokens, o.max_turns, o.max_prompt_tokens,
                        show_progress=False)
    wall = time.perf_counter() - start
    answer_tokens = seqs.num_answer_tokens
    rec = {"bench": "probe_distill", "num_prompts": args.num_prompts, "engine_kw": extra,
           "sequences": len(seqs.token_ids), "answer_tokens": answer_tokens, "wall_s": wall,
           "answer_tok_s": answer_tokens / wall,
           **{f"{k}_{f}": v[f] for k, v in stats.items() for f in ("steps", "s", "reqs", "tokens")},
           **common.machine_info(engine.device), "git": common.git_commit()}
    engine.shutdown()
    print(json.dumps(rec), flush=True)
    if args.out:
        common.append_jsonl(args.out, [rec])


if __name__ == "__main__":
    main()
