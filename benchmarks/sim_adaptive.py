"""Adaptive speculation's choices against pinned speculation and plain decoding, simulated.

The engine's controller (`AdaptiveSpeculation`, with the finish estimate it gets when nothing
waits) decides every step of simulated batches. Each request accepts draft tokens with its own
probability, drawn around a mean with a spread across requests; a step's seconds come from
per-request rates measured on an H100 (NEXTN (3, 1, 4) on the default model, bench_adaptive at
dae63fc), with 5% noise. Batches run one after another on one controller, as in a served engine.
A line per (acceptance, spread, batch): simulated seconds of pinned speculation, of plain
decoding and of adaptive, adaptive's speed against the faster pinned side, and its switches of
side by what chose them (`adaptive_switches`: a look, the finish estimate, a warm-up, ...).
A switch of side costs SWITCH_STEPS plain steps more, unrecorded, as on a GPU (the per-call log of
probe_adaptive_steps.py: each switch drains the overlapped pipeline and leaves a call that only
launches its step); prefills are left out, so it checks the decisions, not the engine. With
--catch-up A B a switch into speculation costs instead what a draft's catch-up does: A ms and B us
per position it missed (each request's plain steps since its last speculative one, and its
PROMPT_LEN-token prompt at its batch's first speculative step), as `probe_catchup.py` measures it
(H200, EAGLE3 at 57098ca: 4.1 ms after 100 plain steps at batch 4, 8.2 ms at batch 64: about 3.8 ms
and 0.7 us); a switch out of it still costs SWITCH_STEPS plain steps. --alphas sets the mean chance
that a draft token is accepted: 0.05 is an untrained draft, where speculating never pays. --shadow
gives the controller shadow verifies as NGRAM's engine does (specpcg/speculative/shadow.py): each
request's new tokens are covered by verifies drawn at its accept chance of the moment, whichever
side ran, and the controller reads the batch's pooled recent accept length every step (every new
token judged; --shadow-budget N: N verifies a step, shared as the engine's ShadowVerify shares its
4), on rates alone (adaptive-shadow-rates);
--shadow-finish N prices them by the finish estimate when nothing waits, over each request's
last N: the engine's default with N = 32 (RECENT). --catch-up A B C: an engine's first look
from plain steps costs C ms more, once (a first catch-up's one-time costs).

    python benchmarks/sim_adaptive.py [--spreads 0 0.1 0.2] [--alphas 0.7] [--batches 4 16 64]
        [--seeds 6] [--hiccup PROB X] [--look-budget 0.03] [--growth] [--shadow]
        [--shadow-finish N] [--shadow-budget N] [--catch-up A_MS B_US [C_MS] [--untold-lag]
        [--prompt-len N]]
        [--rates h100-nextn|h100-ngram-chat|...] [--sequence] [--unplaced] [--rounds 5]
        [--max-every N]
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import common

common.add_repo_to_path()

from specpcg.speculative import adaptive, bucket  # noqa: E402
from specpcg.speculative.adaptive import AdaptiveSpeculation, bucket_of  # noqa: E402
from specpcg.speculative.finish import Finish  # noqa: E402
from specpcg.speculative.shadow import MAX_LAG, RECENT, _count, accept_length  # noqa: E402
from sim_rates import CHAIN_TOKENS, MEAN_ACCEPT, PLAIN_RATE, RATES, SPEC_RATE  # noqa: E402
from sim_cli import parser, render_plot, render_table  # noqa: E402

SWITCH_STEPS = 1.0  # a switch's cost in plain steps at the batch's size
POLICIES = ("spec", "plain", "adaptive")
PROMPT_LEN = 100  # --catch-up: the positions a request's draft misses before its first step
DRAFT_TOKENS = 4  # the chain (3, 1, 4): at most 4 tokens a verify (--rates may change it)

# --calibrate: step seconds per (speculative?, bucket) and the requests' accept chances,
# measured on a GPU (`calibrate`); None: sim_rates.py's H100 rates and a normal spread of chances.
STEP_S = ALPHAS = None
CATCH_UP = None  # --catch-up: seconds a switch into speculation, per position, [first look's more]
# With --catch-up the controller is told the positions a switch catches up on, as the engine
# tells it (`catch_up_positions`); --untold-lag: only the plain steps since the last speculative.
TELL_LAG = True
# --shadow-budget N: shadow verifies a step, as the engine shares them (0: every new token is
# judged, as before this option)
SHADOW_BUDGET = 0
PLACE = True  # a batch of one's output position told, as by the engine (--unplaced: not)


def step_seconds(spec: bool, batch: int) -> float:
    key = bucket_of(batch)
    if STEP_S is not None:
        known = [k for s, k in STEP_S if s == spec]
        return STEP_S[(spec, min(known, key=lambda k: abs(k.bit_length() - key.bit_length())))]
    return MEAN_ACCEPT / SPEC_RATE[key] if spec else 1.0 / PLAIN_RATE[key]


def alpha_of(accept_length: float) -> float:
    """The accept chance per draft token that gives a chain of DRAFT_TOKENS this mean accept
    length (1 + a + ... + a^(DRAFT_TOKENS - 1)), by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sum(mid ** k for k in range(DRAFT_TOKENS)) < accept_length:
            lo = mid
        else:
            hi = mid
    return lo


def calibrate(path: str) -> tuple:
    """(step seconds per (speculative?, bucket), accept chances) from a probe_adaptive_steps.py
    log: the median call of each side per bucket of the batch it ran (speculative calls of the
    pinned system, plain ones of no-spec), and one chance per request of the pinned system's
    largest batch, from its accept length. Calls that emitted nothing (a launch) are left out."""
    calls, lengths, rows = {}, [], list(common.read_jsonl(path))
    for r in rows:
        side = {("pinned", "spec"): True, ("no-spec", "plain"): False}.get(
            (r.get("system"), r.get("kind")))
        if side is not None and r["bs"] > 0 and r["tokens"] > 0:
            calls.setdefault((side, bucket_of(r["bs"])), []).append(r["s"])
    pinned = [r for r in rows if r.get("probe") and r["system"] == "pinned"]
    if pinned:
        lengths = max(pinned, key=lambda r: r["batch"])["accept_lengths"]
    if not lengths or not any(s for s, _ in calls) or not any(not s for s, _ in calls):
        raise ValueError(f"--calibrate {path!r}: needs the pinned and no-spec systems' calls "
                         f"and the pinned system's accept lengths (probe_adaptive_steps.py)")
    return ({k: common.median(v) for k, v in calls.items()},
            [alpha_of(x) for x in lengths])


@dataclass
class SimRequest:
    alpha: float  # chance that each next draft token is accepted
    out: int = 0
    spec_verify_ct: int = 0  # its verifies and their accepted drafts, as the engine counts
    spec_accepted_drafts: int = 0
    # shadow verifies (--shadow): the fields the engine's requests carry, and the tokens of
    # this request's output that no shadow verify has covered yet
    shadow_recent: object = None
    shadow_tokens: int = 0
    shadow_verifies: int = 0
    unjudged: int = 0
    behind: int = 0  # positions its draft has not caught up on (--catch-up): PROMPT_LEN first


def _shadow(rng: random.Random, r: SimRequest, got: int, new_tokens: int, growth: bool,
            keep: int) -> None:
    """Shadow verifies over a request's `got` new tokens, one after another as the engine
    places them (each covers the tokens it would have emitted); the request keeps its last
    `keep`."""
    r.unjudged += got
    while r.unjudged > 0:
        tokens = _accepted(rng, _alpha_at(r, new_tokens, growth))
        _count(r, tokens, keep)
        r.unjudged -= tokens


def _shadow_budgeted(rng: random.Random, running: list, new_tokens: int, growth: bool,
                     keep: int, start: int) -> int:
    """--shadow-budget N: the engine's way, N shadow verifies a step shared round-robin from
    running[start], each request's unjudged tokens capped at MAX_LAG (it skips ahead); returns
    where the next step starts (the request whose verifies may go on)."""
    budget, n = SHADOW_BUDGET, len(running)
    for k in range(n):
        r = running[(start + k) % n]
        r.unjudged = min(r.unjudged, MAX_LAG)
        while budget and r.unjudged >= DRAFT_TOKENS - 1:
            tokens = _accepted(rng, _alpha_at(r, new_tokens, growth, r.out - r.unjudged))
            _count(r, tokens, keep)
            r.unjudged -= tokens
            budget -= 1
        if not budget:
            return (start + k) % n
    return start


def _accepted(rng: random.Random, alpha: float) -> int:
    tokens = 1  # the verify's own token
    while tokens < DRAFT_TOKENS and rng.random() < alpha:
        tokens += 1
    return tokens


def _choose(policy: str, ctrl, running: list, new_tokens: int, shadowed: bool) -> bool:
    if policy != "adaptive":
        return policy == "spec"
    finish = Finish.of(running, remaining=tuple(new_tokens - r.out for r in running),
                       shadowed=shadowed)
    behind = sum(r.behind for r in running) if CATCH_UP is not None and TELL_LAG else None
    position = running[0].out if len(running) == 1 and PLACE else None
    return ctrl.use_spec(len(running), finish, behind, position)


def switch_seconds(spec: bool, last, running: list, ctrl=None) -> float:
    """What the step's switch adds (last: the step before's side; None: a batch's first)."""
    if CATCH_UP is None:
        return (SWITCH_STEPS * step_seconds(False, len(running))
                if last is not None and spec != last else 0.0)
    if spec and last is not True:
        first = 0.0  # an engine's first look from plain steps pays CATCH_UP[2:] once
        if last is False and ctrl is not None and not getattr(ctrl, "sim_warm", False):
            first, ctrl.sim_warm = sum(CATCH_UP[2:]), True
        return first + CATCH_UP[0] + CATCH_UP[1] * sum(r.behind for r in running)
    return SWITCH_STEPS * step_seconds(False, len(running)) if last and not spec else 0.0


def _alpha_at(r: SimRequest, new_tokens: int, growth: bool, at: Optional[int] = None) -> float:
    """A request's accept chance at its next token: its own, or with `growth` rising from 0
    at its first output token to twice its own at its last (capped): NGRAM's drafts are copies
    of earlier text, and a chat answer repeats itself more the longer it gets (on the CPU, the
    default model's first chat prompt at (7, 1, 8): accept length 1.00 / 1.04 / 1.26 / 2.17 by
    quarter of its verifies)."""
    at = r.out if at is None else at  # the output position (default: the request's next)
    return min(r.alpha * 2 * at / new_tokens, 0.97) if growth else r.alpha


def run_batch(policy: str, ctrl, rng: random.Random, batch: int, spread: float,
              new_tokens: int = 128, mean_alpha: float = 0.7, hiccup: tuple = (0.0, 1.0),
              growth: bool = False, shadow: int = 0,
              requests: Optional[random.Random] = None) -> float:
    """Simulated seconds for `batch` requests of `new_tokens` each under `policy` (spec, plain
    or adaptive, which asks and teaches `ctrl`). hiccup: (probability, factor) that a step of
    either side takes factor times as long (the host stalled: a collection, another process);
    growth: acceptance rises along each output (`_alpha_at`); shadow: the controller gets
    shadow verifies, each request keeping its last `shadow` (0: none; module docstring);
    requests: draws the requests' accept chances (default: rng), so that every policy meets the
    same requests where its steps draw differently (`_rngs`)."""
    draw = requests or rng
    running = [SimRequest(draw.choice(ALPHAS) if ALPHAS is not None
                          else min(max(draw.gauss(mean_alpha, spread), 0.05), 0.97),
                          behind=PROMPT_LEN)
               for _ in range(batch)]
    seconds, last, first = 0.0, None, 0  # first: where --shadow-budget's round starts
    while running:
        spec = _choose(policy, ctrl, running, new_tokens, bool(shadow))
        step = step_seconds(spec, len(running)) * rng.uniform(0.95, 1.05)
        step += switch_seconds(spec, last, running, ctrl)
        last = spec
        if rng.random() < hiccup[0]:
            step *= hiccup[1]
        emitted = 0
        for r in running:
            got = min(_accepted(rng, _alpha_at(r, new_tokens, growth)) if spec else 1,
                      new_tokens - r.out)
            r.out += got
            emitted += got
            r.behind = 0 if spec else r.behind + 1
            if spec:
                r.spec_verify_ct += 1
                r.spec_accepted_drafts += got - 1
            if shadow and policy == "adaptive":
                if SHADOW_BUDGET:
                    r.unjudged += got
                else:
                    _shadow(rng, r, got, new_tokens, growth, shadow)
        if shadow and policy == "adaptive" and SHADOW_BUDGET:
            first = _shadow_budgeted(rng, running, new_tokens, growth, shadow, first)
        if policy == "adaptive":
            ctrl.record(len(running), spec, emitted, step)
            if shadow:
                ctrl.shadow(accept_length(running))
        seconds += step
        if policy == "adaptive":
            for r in running:
                if r.out >= new_tokens:
                    ctrl.finished(r)
        running = [r for r in running if r.out < new_tokens]
    return seconds


def _kept(shadow: bool, shadow_finish: int) -> int:
    """The shadow verifies each request keeps (0: the controller gets none)."""
    return (shadow_finish or RECENT) if shadow or shadow_finish else 0


def _rngs(seed: int) -> tuple:
    """(steps, requests): one seed's draws for the steps and for the requests' accept chances.
    NOTE: with one stream for both, a policy's own draws (a speculative step's acceptances,
    shadow verifies) moved the next batch's requests, and pinned and adaptive met different
    requests: at spread 0.25 a cell whose adaptive engine speculated on every step pinned did
    measured 0.893 of pinned."""
    return random.Random(seed), random.Random(seed + 1_000_003)


def _controller(shadow_finish: int) -> AdaptiveSpeculation:
    ctrl = AdaptiveSpeculation()
    ctrl.shadow_rates_only = not shadow_finish  # with shadow verifies: on rates alone
    return ctrl


def simulate(batch: int, spread: float, seeds: int, batches: int = 5,
             hiccup: tuple = (0.0, 1.0), mean_alpha: float = 0.7, growth: bool = False,
             shadow: bool = False, shadow_finish: int = 0) -> dict:
    """{policy: simulated seconds} over `seeds` engines of `batches` batches each, and
    {policy + "_seed0": [seconds of each batch of seed 0]} (a controller's warm-up shows in its
    first batch). shadow_finish: shadow verifies priced by the finish estimate over each
    request's last `shadow_finish` (0: on rates alone, over the engine's RECENT)."""
    keep = _kept(shadow, shadow_finish)
    out = {"switches": Counter()}
    for policy in POLICIES:
        total = 0.0
        for seed in range(seeds):
            ctrl, (rng, requests) = _controller(shadow_finish), _rngs(seed)
            each = []
            for _ in range(batches):
                each.append(run_batch(policy, ctrl, rng, batch, spread, hiccup=hiccup,
                                      mean_alpha=mean_alpha, growth=growth, shadow=keep,
                                      requests=requests))
                ctrl.interrupt()  # the next batch's prefill
            total += sum(each)
            out["switches"] += ctrl.switches()
            if seed == 0:
                out[policy + "_seed0"] = each
        out[policy] = total
    return out


def simulate_sequence(sizes: list, spread: float, seeds: int, mean_alpha: float = 0.7,
                      timed: int = 2, growth: bool = False, shadow: bool = False,
                      shadow_finish: int = 0) -> dict:
    """--sequence: batch sizes in order on one controller per seed, as bench_adaptive runs one
    engine (one untimed batch of each size, then `timed` timed ones): {size: {policy: timed
    seconds over all seeds}}. Priors and switch costs carry over from the sizes before.
    growth, shadow, shadow_finish: as `simulate`'s."""
    keep = _kept(shadow, shadow_finish)
    out = {b: {**dict.fromkeys(POLICIES, 0.0), "switches": Counter()} for b in sizes}
    for policy in POLICIES:
        for seed in range(seeds):
            ctrl, (rng, requests) = _controller(shadow_finish), _rngs(seed)
            for b in sizes:
                for i in range(1 + timed):
                    before = ctrl.switches()
                    seconds = run_batch(policy, ctrl, rng, b, spread, mean_alpha=mean_alpha,
                                        growth=growth, shadow=keep, requests=requests)
                    ctrl.interrupt()
                    out[b][policy] += seconds if i else 0.0
                    if i:  # the timed batches' switches, the tail's smaller buckets included
                        out[b]["switches"] += ctrl.switches() - before
    return out


def main(argv=None) -> None:
    global STEP_S, ALPHAS, CATCH_UP, TELL_LAG, MEAN_ACCEPT, SPEC_RATE, PLAIN_RATE, PROMPT_LEN, PLACE
    global DRAFT_TOKENS, SHADOW_BUDGET
    args = parser(PROMPT_LEN, __doc__).parse_args(argv)
    if args.catch_up and len(args.catch_up) not in (2, 3):  # before any global is set
        raise SystemExit(f"--catch-up takes A_MS B_US [C_MS], got {args.catch_up}")
    MEAN_ACCEPT, SPEC_RATE, PLAIN_RATE = RATES[args.rates]
    DRAFT_TOKENS = CHAIN_TOKENS.get(args.rates, DRAFT_TOKENS)
    SHADOW_BUDGET = args.shadow_budget
    PROMPT_LEN = args.prompt_len
    if args.catch_up:
        a_ms, b_us, c_ms = (args.catch_up + [0.0])[:3]
        CATCH_UP = (a_ms / 1e3, b_us / 1e6, c_ms / 1e3)
    TELL_LAG, PLACE = not args.untold_lag, not args.unplaced
    if args.calibrate:
        STEP_S, ALPHAS = calibrate(args.calibrate)
        args.alphas, args.spreads = [sum(ALPHAS) / len(ALPHAS)], [0.0]
    if args.look_budget is not None:
        bucket.LOOK_BUDGET = args.look_budget
    if args.max_every is not None:
        bucket.EXPLORE_MAX_EVERY = adaptive.EXPLORE_MAX_EVERY = args.max_every
    lines, sequences = [], {}
    for alpha, spread, batch in itertools.product(args.alphas, args.spreads, args.batches):
        if args.sequence:
            if (alpha, spread) not in sequences:
                sequences[alpha, spread] = simulate_sequence(
                    args.batches, spread, args.seeds, alpha, growth=args.growth,
                    shadow=args.shadow, shadow_finish=args.shadow_finish)
            t = {**sequences[alpha, spread][batch], **{p + "_seed0": None for p in POLICIES}}
        else:
            t = simulate(batch, spread, args.seeds, hiccup=tuple(args.hiccup), mean_alpha=alpha,
                         growth=args.growth, shadow=args.shadow,
                         shadow_finish=args.shadow_finish, batches=args.rounds)
        lines.append({"bench": "sim_adaptive", "alpha": alpha, "spread": spread, "batch": batch,
                      "sequence": args.sequence, "switch_steps": SWITCH_STEPS,
                      "catch_up_ms_us": args.catch_up, "lag_told": bool(args.catch_up) and TELL_LAG,
                      "rates": args.rates, "prompt_len": PROMPT_LEN, "placed": PLACE,
                      "hiccup": args.hiccup, "growth": args.growth,
                      "shadow": args.shadow or bool(args.shadow_finish),
                      "shadow_finish": args.shadow_finish,
                      "shadow_budget": args.shadow_budget, "look_budget": bucket.LOOK_BUDGET,
                      "calibrated": args.calibrate, "max_every": bucket.EXPLORE_MAX_EVERY,
                      "rounds": args.rounds, "spec_s": t["spec"], "plain_s": t["plain"],
                      "adaptive_s": t["adaptive"],
                      # adaptive's switches of side by what chose them, over the seeds
                      "adaptive_switches": dict(sorted(t["switches"].items())),
                      "vs_best": min(t["spec"], t["plain"]) / t["adaptive"],
                      "seed0_batches_s": {p: t[p + "_seed0"] for p in POLICIES},
                      "seeds": args.seeds, "git": common.git_commit(), "time": common.now_iso()})
        print(f"[sim_adaptive] alpha {alpha} spread {spread} batch {batch} hiccup "
              f"{args.hiccup}: adaptive {lines[-1]['vs_best']:.3f} of the faster pinned side",
              flush=True)
    common.append_jsonl(args.out, lines)
    common.render_results(args.out, render_table, render_plot)


if __name__ == "__main__":
    main()
