"""Trained drafts for the GPU tests, trained on first use and cached ($SPECPCG_DRAFT_CACHE or
.cache/drafts).

EAGLE3 is the default command's draft: the benchmarks use it too, so a machine trains it once.
The others train on a shorter budget and fewer prompts (sharing one generation of the target's
answers): three drafts at the default budget would take half an hour, more than a GPU session
has for its whole suite. $SPECPCG_GPU_DRAFTS ("EAGLE3=DIR,EAGLE=DIR") names drafts already
trained elsewhere, so a session that brought its drafts trains nothing."""

import os

CACHE = os.environ.get("SPECPCG_DRAFT_CACHE", ".cache/drafts")
QUICK = {"num_prompts": 3000, "minutes": 4.0}


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
