"""NGRAM proposal cost: first propose on a long context (builds the index) and steady-state
proposes (incremental), against the time of one target step. Host-only work, so it runs anywhere.

    python benchmarks/bench_ngram.py [--context 4096] [--batch 1 16] [--out benchmarks/results/ngram.jsonl]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import common

common.add_repo_to_path()

from drafts.ngram import NgramDraft  # noqa: E402
from specpcg.core import Request, SamplingParams  # noqa: E402
from specpcg.speculative.config import SpecConfig  # noqa: E402


def _requests(batch: int, context: int, seed: int) -> list:
    rng = random.Random(seed)
    # Text-like ids: a small vocabulary with repeats, so n-gram matches exist.
    return [Request(prompt_ids=[rng.randrange(2000) for _ in range(context)], params=SamplingParams())
            for _ in range(batch)]


def measure(batch: int, context: int, spec: SpecConfig, steps: int = 50) -> dict:
    draft = NgramDraft()
    reqs = _requests(batch, context, seed=batch)
    t0 = time.perf_counter()
    draft.propose(reqs, spec)  # first call indexes every request's whole context
    first_ms = 1000 * (time.perf_counter() - t0)
    times = []
    for _ in range(steps):
        for r in reqs:  # as after a verify step that committed 2 tokens
            r.output_ids += [r.all_ids[-7], r.all_ids[-6]]
        t0 = time.perf_counter()
        draft.propose(reqs, spec)
        times.append(1000 * (time.perf_counter() - t0))
    return {"bench": "ngram", "batch_size": batch, "context": context, "topk": spec.topk,
            "num_draft_tokens": spec.num_draft_tokens, "first_propose_ms": first_ms,
            "steady_propose_ms": common.median(times),
            **common.machine_info(torch.device("cpu"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--out", default=str(common.RESULTS_DIR / "ngram.jsonl"))
    args = p.parse_args()
    records = []
    for topk, tokens in ((1, 4), (4, 8)):
        spec = SpecConfig("NGRAM", num_steps=3 if topk == 1 else 4, topk=topk, num_draft_tokens=tokens)
        for bs in args.batch:
            rec = measure(bs, args.context, spec)
            records.append(rec)
            print(f"topk {topk} draft tokens {tokens} batch {bs} context {args.context}: first "
                  f"{rec['first_propose_ms']:.1f} ms, steady {rec['steady_propose_ms']:.3f} ms")
    common.append_jsonl(args.out, records)


if __name__ == "__main__":
    main()
