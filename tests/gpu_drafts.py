"""Trained drafts for the GPU tests, trained on first use and cached ($SPECPCG_DRAFT_CACHE or
.cache/drafts).

EAGLE3 is the default command's draft: the benchmarks and the GSM8K matrix use it too, so a
machine trains it once. The others train on a shorter budget and fewer prompts (sharing one
generation of the target's answers). $SPECPCG_GPU_DRAFTS ("EAGLE3=DIR,EAGLE=DIR") names drafts
already trained, so a run that brought its drafts trains nothing.

Where a GPU call has a few minutes, train the suite's heads first, in one call, one at a time:

    python -m tests.gpu_drafts [--algorithms EAGLE3 EAGLE NEXTN] [--minutes 2.5]

prints the SPECPCG_GPU_DRAFTS value for test_cuda_eagle.py and test_spec_overlap.py (the GSM8K
matrix's accept-length floors want gpu_draft's longer budgets). On one H100, trained in turn at
3.5 / 2.5 / 2.5 minutes, EAGLE3, EAGLE and NEXTN took 202 + 141 + 141 s; EAGLE3 and NEXTN trained
at 2.4 minutes accepted 1.76 and 1.88 tokens a step in test_cuda_eagle.py (it asks for 1.5).
Never train heads as processes side by side: on one GPU each generated the answers itself and
stepped about 3x slower, a sixth of the optimiser steps it runs alone."""

import argparse
import os

CACHE = os.environ.get("SPECPCG_DRAFT_CACHE", ".cache/drafts")
QUICK = {"num_prompts": 3000, "minutes": 4.0}
# The CLI's default: enough for test_cuda_eagle.py and test_spec_overlap.py (the figures
# above); the GSM8K matrix's accept-length floors want gpu_draft's own budgets.
SHORT = {"num_prompts": 2000, "minutes": 2.5}
SUITE = ("EAGLE3", "EAGLE", "NEXTN")


def given_drafts() -> dict:
    """$SPECPCG_GPU_DRAFTS as {algorithm: directory}."""
    pairs = [p.split("=", 1) for p in os.environ.get("SPECPCG_GPU_DRAFTS", "").split(",") if p]
    return {algo.upper(): path for algo, path in pairs}


def gpu_draft(algo: str) -> str:
    from drafts.train import ensure_draft

    given = given_drafts().get(algo)
    if given is not None:
        if not os.path.isdir(given):
            raise FileNotFoundError(f"SPECPCG_GPU_DRAFTS names {algo}={given!r}: no such directory")
        return given

    if algo == "EAGLE3":
        return ensure_draft(algo, cache_dir=CACHE)
    return ensure_draft(algo, cache_dir=CACHE, **QUICK)


def train_suite(algorithms, minutes: float, num_prompts: int, cache_dir: str = CACHE) -> str:
    """Each head trained (or found cached) in turn; the SPECPCG_GPU_DRAFTS value naming them."""
    from drafts.train import ensure_draft

    named = []
    for algo in algorithms:
        path = ensure_draft(algo, cache_dir=cache_dir, num_prompts=num_prompts, minutes=minutes)
        print(f"[gpu_drafts] {algo}: {path}", flush=True)
        named.append(f"{algo}={path}")
    return ",".join(named)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Train the GPU suite's heads, one after another.")
    p.add_argument("--algorithms", nargs="+", choices=SUITE, default=list(SUITE))
    p.add_argument("--minutes", type=float, default=SHORT["minutes"], help="each head's budget")
    p.add_argument("--num-prompts", type=int, default=SHORT["num_prompts"])
    p.add_argument("--cache-dir", default=CACHE)
    a = p.parse_args(argv)
    if len(set(a.algorithms)) != len(a.algorithms):
        p.error(f"--algorithms names one twice: {a.algorithms}")
    print("SPECPCG_GPU_DRAFTS=" + train_suite(a.algorithms, a.minutes, a.num_prompts, a.cache_dir))


if __name__ == "__main__":
    main()
