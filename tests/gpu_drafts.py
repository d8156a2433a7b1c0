"""Trained drafts for the GPU tests, trained on first use and cached ($SPECPCG_DRAFT_CACHE or
.cache/drafts).

EAGLE3 is the default command's draft: the benchmarks use it too, so a machine trains it once.
The others train on a shorter budget and fewer prompts (sharing one generation of the target's
answers): three drafts at the default budget would take half an hour, more than a GPU session
has for its whole suite."""

import os

CACHE = os.environ.get("SPECPCG_DRAFT_CACHE", ".cache/drafts")
QUICK = {"num_prompts": 3000, "minutes": 4.0}


def gpu_draft(algo: str) -> str:
    from drafts.train import ensure_draft

    if algo == "EAGLE3":
        return ensure_draft(algo, cache_dir=CACHE)
    return ensure_draft(algo, cache_dir=CACHE, **QUICK)
