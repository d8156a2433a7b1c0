"""Shadow verifies: what a draft would have accepted, judged on the tokens that came anyway.

Adaptive speculation (specpcg/speculative/adaptive.py) must know a draft's accept length to
choose between speculative and plain steps. Measured on speculative steps alone, a batch that
decodes plainly learns it only by looking: switching to speculation for a few steps, which
drains the overlapped pipeline twice and runs steps the choice says are slower. On the default
model's chat prompts NGRAM's looks and their switches cost about 5% at batch 1 (0.94x no-spec
on an H200, 51 speculative steps of 364, a switch measured at 1.8 ms against a 0.76 ms step).

A draft that needs no forward of its own (NGRAM) can instead be asked, for a context the
request has already decoded past, what it would have proposed there, and the verify judged on
the tokens the target emitted next: greedy, exactly what a verify accepts; sampled, a one-hot
chain draft matches the sampled token with the probability a verify accepts it. The shadow
places its verifies where a speculating request would: the next one just past what the last
one accepted (context += accepted + 1). Verifies at every position would count a copied passage
at every one of its tokens, where speculation verifies it once per chain: uniform positions
overstate the accept length wherever acceptance comes in runs.

The host's budget is EVALS_PER_STEP shadow verifies a decode step, shared round-robin by the
running requests; a request the shadow falls MAX_LAG tokens behind skips ahead, starting a new
run of verifies (one verify a run lands by chance rather than where speculation would).

The running batch's accept length pools its requests' last RECENT shadow verifies (one
request running alone: its last RECENT_ALONE; `accept_length`), not a window over the steps of
a batch size: acceptance changes along an answer and from one prompt to the next (NGRAM on
chat: 1.0 in an answer's first quarter, 2.2 in its last), and a window of a batch size's last
32 shadow verifies carried one answer's end into the next one's start at batch 1 (H200, default
model: it measured 2.03 tokens a verify where the speculative steps it chose accepted the first
draft 11% of the time, 0.965x no-spec).

How adaptive speculation uses them: NGRAM needs no looks to know its accept length. Shadow
verifies judge what its draft would have accepted on the tokens plain steps emit anyway, so a
bucket with enough of them prices a speculative step at their accept length and its own measured
seconds, and looks only to keep those seconds current (adaptive.py, `look_every`). With requests
waiting such a draft chooses on rates; with none, on the finish estimate (adaptive.py), whose
straggler is the request whose last RECENT verifies accepted least. At batch 64 on chat prompts
NGRAM's slowest requests accept 1.04-1.17 tokens a verify where the mean is 2.1: a batch that
speculates ends after 124 steps against plain decoding's 127, at 1.2x a plain step's time
(H200, b188932). There the finish estimate decodes plain, where rates alone speculated and went
plain at the batch's tail, switching back and forth. Each engine alone in its process
(bench_alone.py, H200, fde4feb), the finish estimate ran 1.23 / 1.07 / 1.05 / 0.97x no-spec at
batch 1 / 4 / 16 / 64, rates alone 1.14 / 1.04 / 1.05 / 0.90x; batch 64 alone, 0.96x against
0.88x (pinned 0.93x); two more passes of it 1.21 / 1.02 / 1.01 / 1.05x (0327117). The shadow
verifies' host work (54-82 us a step at batch 64 on the H200) runs while the device runs the
step: the host still waited 150-620 us a step for it (benchmarks/probe_shadow_cost.py). Side by
side in one process (180be28 and before), where a neighbour's graphs slowed plain steps, rates
alone had looked as good (1.05 / 1.13 / 1.12 / 0.98x against 1.06 / 1.10 / 1.01 / 0.99x), and
the finish estimate over each request's last 8 verifies ran 0.91x at batch 64.
`shadow_rates_only = True` chooses on rates alone; in simulation it lost where equal-length
requests' acceptance differs widely with nothing waiting (sim_adaptive.py --shadow: 0.87 / 0.79
of the faster side at batch 16 / 64).
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Optional

EVALS_PER_STEP = 4
MAX_LAG = 64
RECENT = 32  # a request's accept length is measured over its last RECENT shadow verifies
# Running alone, over its last RECENT_ALONE: one request has no straggler to guard against, only
# its acceptance's turns to follow. NGRAM on a chat answer accepted nothing over its first 45
# tokens, then 1.7 a verify (traced on a CPU); 32 verifies of nothing held a batch of one
# plain for 80 of its 256 tokens on an H100, 1.50x no-spec where pinned speculation ran 2.12x
# (3cf0971, bench_alone.py). Simulated at batch 1 (`sim_adaptive.py
# --batches 1 --shadow --shadow-finish N`, 8 cells, 8 seeds), 16 against 32 ran 1.027 / 1.010
# of the faster pinned side with acceptance rising along each answer (`--growth`) and steady,
# against 1.011 / 1.006; 8 ran 1.035 / 0.996 (its worst steady cell 0.970).
RECENT_ALONE = 16
MIN_VERIFIES = 8  # the batch's accept length needs this many (else it is not known)


def _count(req, tokens: int, keep: int = RECENT) -> None:
    """A shadow verify of `req` would have emitted `tokens` (its accepted drafts, the bonus);
    the request keeps its last `keep`."""
    recent = req.shadow_recent
    if recent is None:
        recent = req.shadow_recent = deque(maxlen=keep)
    if len(recent) == recent.maxlen:
        req.shadow_tokens -= recent[0]
    recent.append(tokens)
    req.shadow_tokens += tokens
    req.shadow_verifies += 1


def recent_counts(req, alone: bool) -> tuple:
    """(verifies, tokens) of a request's recent shadow verifies: its last RECENT, or running
    alone its last RECENT_ALONE."""
    recent = req.shadow_recent
    if not alone or len(recent) <= RECENT_ALONE:
        return len(recent), req.shadow_tokens
    return RECENT_ALONE, sum(islice(reversed(recent), RECENT_ALONE))


def accept_length(reqs: list) -> Optional[float]:
    """Tokens per verify of the requests' recent shadow verifies, pooled (None with fewer than
    MIN_VERIFIES of them)."""
    if len(reqs) == 1 and reqs[0].shadow_recent:
        verifies, tokens = recent_counts(reqs[0], alone=True)
    else:  # every step, every running request: sums kept as verifies come
        tokens = verifies = 0
        for req in reqs:
            if req.shadow_recent:
                tokens += req.shadow_tokens
                verifies += len(req.shadow_recent)
    return tokens / verifies if verifies >= MIN_VERIFIES else None


class ShadowVerify:
    def __init__(self, draft, spec, evals_per_step: int = EVALS_PER_STEP, recent: int = RECENT):
        """draft: a DraftWorker with `shadow_accept`; spec: the SpecConfig it drafts for;
        recent: each request's accept length is over its last `recent` shadow verifies."""
        self.draft, self.spec = draft, spec
        self.evals_per_step, self.recent = evals_per_step, recent
        self._next = 0  # the request (by position in the running list) served first next time

    @staticmethod
    def supported(draft) -> bool:
        return hasattr(draft, "shadow_accept")

    def observe(self, reqs: list, depth: Optional[int] = None) -> list:
        """Runs up to evals_per_step shadow verifies over the requests' tokens not judged yet;
        returns the drafts each accepted. depth: a chain verified only that deep (its drafts
        past it are never accepted: specpcg/speculative/depth.py)."""
        out, budget, n = [], self.evals_per_step, len(reqs)
        start = self._next % n if n else 0
        for k in range(n):
            budget = self._advance(reqs[(start + k) % n], budget, out, depth)
            if budget == 0:
                self._next = (start + k) % n  # its verifies may go on: it comes first next time
                break
        return out

    def _advance(self, req, budget: int, out: list, depth: Optional[int]) -> int:
        width = self.spec.num_draft_tokens - 1
        # The first speculative step drafts after the prefill's token.
        context = req.shadow_context or len(req.prompt_ids) + 1
        end = req.seq_len - width  # the last context whose verify the tokens can judge
        if end - context > MAX_LAG:
            context = end - MAX_LAG
        while budget and context <= end:
            accepted = self.draft.shadow_accept(req, context, self.spec)
            if accepted is None:
                break
            if depth is not None:
                accepted = min(accepted, depth)
            out.append(accepted)
            _count(req, accepted + 1, self.recent)
            context += accepted + 1
            budget -= 1
        req.shadow_context = context
        return budget
