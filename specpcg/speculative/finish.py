"""What finishing a running batch takes, for adaptive speculation when no request waits.

With none waiting, the running batch is all there is, and it ends with its slowest request; a
speculative step helps only as much as it advances that request (specpcg/speculative/adaptive.py
says why and what it measured). `Finish` holds what each request still needs; `finish_seconds`
prices a side's steps as the batch shrinks.

Each side's time to finish counts the batch shrinking as its requests finish (`finish_seconds`):
a step of b requests costs what that side's steps measured in b's bucket (where they never ran
there, between the nearest measures above and below: bucket.measured_step_s). When it costed every
step at the full batch's price, EAGLE3 at batch 16 ran 375 of its 418 steps in bucket 16 plain,
70% of its tokens (H100, 02575f1: 1.04x no-spec), where speculating at every step ran 1.14x: the
straggler's last steps run in a batch of a few requests, which speculates cheaply. On the GPU
(H100, 8142307 and e676939, a wider EAGLE3 head, two runs of `bench_adaptive`) the estimate
ranked the two sides as pinned runs measure them (its bucket-16 choice of plain steps where
pinned speculation ran 0.81x no-spec), yet the adaptive engine ran 0.65-0.87x at batch 16 and
64, and without the estimate (rates alone, the `adaptive-rate` rows) 0.80-0.90x: neither reaches
no-spec there, because a plain step in an engine with a draft runs slower than a no-spec
engine's (EAGLE3's bucket 64: 249 against 292 tok/s per request; its plain steps capture hidden
states for the draft's catch-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specpcg.speculative.shadow import recent_counts

# A request's own accept length is shrunk toward a prior by this many verifies' worth: a young
# request's few verifies would otherwise decide the batch's straggler by chance.
PRIOR_VERIFIES = 4
# The prior: with at least MIN_ACCEPTS finished requests' accept lengths at hand (each from
# MIN_VERIFIES verifies or more, the last KEPT_ACCEPTS), the batch's requests get their
# quantiles, one each (`priors`); else the bucket's mean. NOTE: with 16, a STANDALONE draft at
# batch 4 on an H200 (d14091e, 7-15 finished requests at hand) priced every young request at the
# bucket's mean accept length (about 2.3, where the batch's slowest took 1.66 a verify pinned),
# speculated a few steps into each batch and went back after 8-30 steps: 0.94-0.95x no-spec
# where plain steps ran 0.99-1.00x. Simulated, 4 against 16 moved nothing beyond the spread;
# side by side on the H200 (f7f3aa9, bench_adaptive's adaptive-min16, two runs at batch 1, 4
# and 16) 4 was never behind: 1.005x no-spec on average against 0.982x, within the rounds'
# spread, and neither engine speculated in a timed batch of 4 there.
MIN_ACCEPTS = 4
KEPT_ACCEPTS = 256
# A finished request counts with this many verifies. NOTE: with 8, the requests of batches that
# chose plain steps (a warm-up's 3 speculative steps, a look's 3) never counted: simulating
# bench_adaptive's engine (`sim_adaptive.py --sequence`, calibrated on the H200), the batch of
# 64 began with 15 priors in some seeds, priced every request at the mean and speculated on 82
# steps where plain ones were faster. With 3, batch 16 / 64 went 0.984 / 0.983 -> 0.986 / 0.989
# of the faster pinned side (0.963 / 0.951 -> 0.965 / 0.959 with catch-up switches); the default
# grid 0.9725 -> 0.9733; no cell of the calibrated, grid or --shadow runs lost more than 0.01.
MIN_VERIFIES = 3
# A request that shadow verifies priced (NGRAM: specpcg/speculative/shadow.py) needs this many
# real verifies: one that decoded plain verified only in a warm-up's or a look's few steps (a
# batch's warm-up comes at its answers' starts, where NGRAM on chat prompts accepts least: 1.0 in
# an answer's first quarter, 2.2 in its last). With 3, every timed batch of 64 decoded all its
# tokens plain (0.96-0.98x no-spec where pinned speculation ran 1.09-1.13x: H100, 747870e in two
# runs, bench_alone.py); with 16, side by side on one H100 (ceead47 against 747870e, two passes),
# 1.03 / 1.26 / 1.00x at batch 4 / 16 / 64 against 0.94 / 1.20 / 0.96x (pinned 1.01 / 1.22 /
# 1.09x), its last batch of 64 speculating on 40% of its tokens (1.05x). NOTE: counted over all of
# its shadow verifies instead (8f4f6fe), batch 16 ran 1.11x against 1.25x and batch 64 stayed
# plain: the shadow's 4 verifies a step give each of 16 requests one every 4 steps, where
# speculating, it verifies every step.
SHADOWED_MIN_VERIFIES = 16


def priors(n: int, accepts) -> list:
    """The accept lengths n requests' own verifies are shrunk toward: the finished requests'
    `accepts` at n evenly spaced quantiles, in the batch's order. NOTE: a batch's end waits for
    its slowest request, and with the mean as every young request's prior a batch speculated
    until its straggler showed: at batch 64 on an H200 (EAGLE3, 9e54277) two of 64 chat
    requests accepted 1.01 tokens a verify where the mean was 1.50, and pinned speculation ran
    127 steps for 128 tokens at 0.90x no-spec; simulated with those requests
    (`sim_adaptive.py --calibrate`), the estimate still speculated on 14-29 of a batch's
    steps. Ranked by their own verifies instead, the request unlucky so far took the lowest
    quantile too, its bad luck counted twice: 0.92 against 0.95 of the faster side at batch
    16 in simulation (accept chance 0.7, spread 0.1)."""
    ranked = sorted(accepts)
    return [ranked[min(int((k + 0.5) * len(ranked) / n), len(ranked) - 1)] for k in range(n)]


@dataclass(frozen=True)
class Finish:
    """What finishing the running batch takes, for a batch with no request waiting: per
    request, the tokens it may still emit (max_new_tokens left: EOS may come sooner), and the
    tokens its verifies emitted and how many verifies it had.

    A verify's tokens are its accepted drafts and its own token, counted as they were verified.
    NOTE: counted as the outputs no plain step emitted, they took in the prefill's token too: a
    draft that never accepted measured an accept length of 1 + 1 / verifies, and on the
    Llama-3-8B shape (H200, NGRAM, random weights) the estimate chose speculative steps 5-10%
    slower than plain ones for 23 of 121 recorded steps at batch 1 and 85 of 123 at batch 64
    (probe_adaptive_steps.py)."""
    remaining: tuple
    spec_tokens: tuple
    verifies: tuple

    def spec_steps(self, mean_accept: float, accepts=()) -> float:
        """Speculative steps until every request is done; each request's accept length is its
        own, shrunk toward a prior (PRIOR_VERIFIES): the bucket's mean, or with MIN_ACCEPTS
        finished requests' `accepts`, their quantiles (`priors`)."""
        return max(self.spec_steps_each(mean_accept, accepts), default=0.0)

    def spec_steps_each(self, mean_accept: float, accepts=()) -> list:
        """Per request, the speculative steps it still needs (spec_steps' accept lengths)."""
        n = len(self.remaining)
        prior = priors(n, accepts) if len(accepts) >= MIN_ACCEPTS else [mean_accept] * n
        return [rem / max((tokens + PRIOR_VERIFIES * p) / (verifies + PRIOR_VERIFIES), 1.0)
                for rem, tokens, verifies, p in zip(self.remaining, self.spec_tokens,
                                                    self.verifies, prior)]

    @staticmethod
    def of(reqs: list, remaining: Optional[tuple] = None, shadowed: bool = False) -> "Finish":
        """remaining: the tokens each request may still emit (default: its max_new_tokens
        left). A request with shadow verifies (specpcg/speculative/shadow.py) is priced at its
        recent ones: they cover its plain steps too, where its real verifies cover only the
        looks, and they follow its acceptance along the answer. shadowed: the engine runs
        shadow verifies, so a request with none yet is priced at its prior alone (`_counts`)."""
        alone = len(reqs) == 1
        counts = [_counts(r, alone, shadowed) for r in reqs]
        if remaining is None:
            remaining = tuple(max(r.params.max_new_tokens - len(r.output_ids), 1) for r in reqs)
        return Finish(
            remaining=remaining,
            spec_tokens=tuple(t for _, t in counts),
            verifies=tuple(v for v, _ in counts))


def _counts(req, alone: bool, shadowed: bool) -> tuple:
    """(verifies, tokens) a request is priced at (Finish.of). NOTE: in an engine with shadow
    verifies, a request they had not reached yet was priced at its real verifies, a warm-up's
    or a look's few at its answer's start, where NGRAM on chat accepts least. At batch 64 the
    shadow's 4 verifies a step, spent on the request it last left, leave some requests
    unverified for 100 steps and more. Simulated with that budget, NGRAM's step times and
    acceptance rising along each answer (`sim_adaptive.py --rates h100-ngram-chat
    --shadow-budget 4 --growth --sequence`), requests were priced at about 1.0 a verify and
    batches of 64 decoded plain where pinned speculation ran 1.11x / 1.09x plain (0.896 / 0.919
    of pinned), as on the GPU after batches of one; priced at their prior alone, 1.001 / 1.023
    (sim_prior_ngram_rising_b4_{before,after}.jsonl; the grid's mean 0.9875 -> 0.9987, and
    0.9685 -> 0.9824 with each seed's requests drawn apart: sim_crn_prior_*). On one H100 a
    batch of 64 after batches of one then ran 1.11-1.13x no-spec against 1.06x, every step
    plain, before (pinned 1.15x; docs/PERFORMANCE.md)."""
    if req.shadow_recent:
        return recent_counts(req, alone)
    if shadowed:
        return 0, 0
    return req.spec_verify_ct, req.spec_verify_ct + req.spec_accepted_drafts


def ends_within(finish, tokens: int) -> bool:
    """Whether a running batch ends within `tokens` tokens of every request. finish: a Finish
    or a function making one (nothing waits), or None (requests wait: it does not end)."""
    if finish is None:
        return False
    finish = finish() if callable(finish) else finish
    return max(finish.remaining, default=0) <= tokens


def finished_accept(req) -> Optional[float]:
    """A finished request's accept length for `priors` (its verifies' tokens per verify), or
    None with fewer than MIN_VERIFIES verifies (SHADOWED_MIN_VERIFIES for a request that shadow
    verifies priced)."""
    n = req.spec_verify_ct
    least = SHADOWED_MIN_VERIFIES if req.shadow_verifies else MIN_VERIFIES
    return (n + req.spec_accepted_drafts) / n if n >= least else None


def finish_seconds(steps_each: list, step_s) -> float:
    """Seconds until every request is done when request i needs steps_each[i] more steps and a
    step of b running requests takes step_s(b): the batch shrinks as requests finish, so the
    slowest request's last steps run in a small batch (cheaper on a GPU than a full one)."""
    total, done, left = 0.0, 0.0, len(steps_each)
    for steps in sorted(steps_each):
        total += (steps - done) * step_s(left)
        done, left = steps, left - 1
    return total
