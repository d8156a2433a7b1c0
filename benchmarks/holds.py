"""Variants of an adaptive engine that bench_adaptive.py and the probes set beside the engine's
own controller (bench_adaptive's EXTRA_SYSTEMS): each takes a built engine and changes one
thing about how it chooses or what it measures, as an earlier version of the engine did.
"""

from __future__ import annotations


def rates_only(engine) -> None:
    """The engine's adaptive controller without the finish estimate (adaptive-rate)."""
    adaptive = engine.scheduler.adaptive
    choose = adaptive.use_spec
    adaptive.use_spec = lambda batch_size, finish=None, behind=None, position=None: choose(
        batch_size, None, behind, position)


def plain_only(engine) -> None:
    """The engine's adaptive controller choosing plain steps at every step (plain)."""
    engine.scheduler.adaptive.use_spec = lambda *args, **kwargs: False


def untold_lag(engine) -> None:
    """The controller as before the draft told it its lag (adaptive-untold): a switch into
    speculation priced by the plain steps' positions alone, without the prompts the draft has
    not run on."""
    adaptive = engine.scheduler.adaptive
    choose = adaptive.use_spec
    adaptive.use_spec = lambda batch_size, finish=None, behind=None, position=None: choose(
        batch_size, finish, None, position)


def shadow_rates(engine) -> None:
    """Shadow verifies priced on rates alone, with or without requests waiting, as the engine
    chose before the finish estimate priced them (adaptive-shadow-rates; shadow.py)."""
    engine.scheduler.adaptive.shadow_rates_only = True


def shadow_relook(engine, below: int = 8) -> None:
    """Buckets with shadow verifies look at the side not chosen as other buckets do while it
    holds fewer than `below` recorded steps (adaptive-shadow-relook; Bucket.relook_below)."""
    engine.scheduler.adaptive.relook_below = below


def finish_recent8(engine) -> None:
    """The finish estimate over each request's last 8 shadow verifies, not RECENT
    (adaptive-finish8): in simulation it follows acceptance rising along an answer as rates
    alone do, and keeps the straggler's protection where acceptance is uneven; on an H200's
    chat prompts it lost to rates alone at batch 4 / 16 / 64 (docs/PERFORMANCE.md)."""
    engine.scheduler.adaptive.shadow_rates_only = False
    if engine.scheduler.shadow is not None:
        engine.scheduler.shadow.recent = 8


def whole_budget(engine) -> None:
    """Looks priced as before LOOK_CLOSE (adaptive-whole-budget): the whole LOOK_BUDGET each."""
    engine.scheduler.adaptive.look_close = float("inf")


def symmetric(engine) -> None:
    """The margin into speculation as before SPEC_HOME (adaptive-symmetric): SWITCH_MARGIN
    faster, as out of it, even where a look from plain steps costs the draft's catch-up."""
    from specpcg.speculative.bucket import SWITCH_MARGIN

    engine.scheduler.adaptive.into_spec = SWITCH_MARGIN


def unflushed(engine) -> None:
    """The step a switch flushes left uncounted, as before `AdaptiveSpeculation.flushed`
    (adaptive-unflushed): a switch into speculation without the draft's catch-up that ran
    before that step's read, a look's last speculative step unrecorded."""
    engine.scheduler.adaptive.count_flushed = False


def min16(engine) -> None:
    """The finish estimate's priors from 16 finished requests on, as before MIN_ACCEPTS = 4
    (adaptive-min16)."""
    engine.scheduler.adaptive.min_accepts = 16


def eager_prompts(engine) -> None:
    """The draft without its prompt runner (pinned-eager-prompts, adaptive-eager-prompts), as
    before drafts/resume.PROMPT_WIDTH: a new prompt past the look runners' reach, or every
    new prompt when pinned, catches up in one eager forward."""
    from drafts.resume import PROMPT_WIDTH, ResumeCatchUp

    draft = engine.scheduler.spec.draft
    if getattr(draft, "resume", None) is None:  # no catch-up runners at all (NGRAM)
        return
    keep = [r for r in draft.resume.runners if r.width != PROMPT_WIDTH]
    draft.resume = ResumeCatchUp(keep) if keep else None


def unplaced(engine) -> None:
    """A batch of one's speculation measured over its whole answers, as before
    `Bucket.place` (adaptive-unplaced), and chosen on the finish estimate when nothing waits."""
    engine.scheduler.adaptive.place_batch_of_one = False


def lean(engine) -> None:
    """The controller's bookkeeping between two looks thinned (adaptive-lean): a look's wait
    priced again only when it comes due, and the wait between two re-choices on the finish
    estimate doubling up to 1,024 steps once settled. What a plain step's choice costs the
    host, set beside `plain` (no choice at all) and the adaptive engine itself. It sets the
    controller's module constants, so every engine of the process: for bench_alone.py's
    workers or a probe's process of its own, not bench_adaptive's engines side by side."""
    import specpcg.speculative.adaptive as adaptive

    adaptive.LOOK_PRICED_EVERY = 1 << 20
    adaptive.REDECIDE_MAX_EVERY = 1024


def then_plain(engine, chosen_steps: int = 256) -> None:
    """The controller left to choose the first `chosen_steps` steps of each batch size above
    32 (the untimed batch: its warm-up and looks), plain steps without asking after that
    (adaptive-then-plain): whether an engine that speculated before decodes plain as fast as
    one held from the start."""
    adaptive = engine.scheduler.adaptive
    choose, asked = adaptive.use_spec, {}

    def use_spec(batch_size, finish=None, behind=None, position=None):
        if batch_size <= 32:
            return choose(batch_size, finish, behind, position)
        asked[batch_size] = asked.get(batch_size, 0) + 1
        return asked[batch_size] <= chosen_steps and choose(batch_size, finish, behind, position)
    adaptive.use_spec = use_spec


HOLDS = {"adaptive-rate": rates_only, "plain": plain_only, "adaptive-finish8": finish_recent8,
         "adaptive-shadow-rates": shadow_rates, "adaptive-shadow-relook": shadow_relook,
         "adaptive-whole-budget": whole_budget, "adaptive-untold": untold_lag,
         "adaptive-symmetric": symmetric, "adaptive-unflushed": unflushed,
         "adaptive-min16": min16, "pinned-eager-prompts": eager_prompts,
         "adaptive-eager-prompts": eager_prompts, "adaptive-unplaced": unplaced,
         "adaptive-lean": lean, "adaptive-then-plain": then_plain}
