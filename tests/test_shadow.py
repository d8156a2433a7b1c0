"""Shadow verifies: NGRAM's drafts judged on tokens already decoded, for adaptive speculation
(specpcg/speculative/shadow.py). A shadow verify must accept exactly what a verify of the same
context would have, and the shadow must place its verifies where speculation does."""

import random

import pytest

from drafts.ngram import NgramDraft
from specpcg.core import Request, SamplingParams
from specpcg.speculative.adaptive import WARMUP_STEPS, AdaptiveSpeculation
from specpcg.speculative.config import SpecConfig
from specpcg.speculative import shadow as shadow_mod
from specpcg.speculative.finish import Finish
from specpcg.speculative.shadow import (MIN_VERIFIES, RECENT, ShadowVerify, _count,
                                        accept_length)

CHAIN = SpecConfig("NGRAM", 7, 1, 8)
TREE = SpecConfig("NGRAM", 4, 4, 8)


def _request(tokens: list, prompt_len: int, greedy: bool = True) -> Request:
    params = SamplingParams(temperature=0.0 if greedy else 0.8)
    return Request(prompt_ids=tokens[:prompt_len], params=params,
                   output_ids=list(tokens[prompt_len:]))


def _tokens(seed: int, n: int = 90) -> list:
    """Text over a few tokens with copied passages: matches of every length, misses too."""
    rng = random.Random(seed)
    out = [rng.randrange(6) for _ in range(12)]
    while len(out) < n:
        if rng.random() < 0.5 and len(out) > 8:
            start = rng.randrange(len(out) - 4)
            out += out[start:start + rng.randrange(2, 10)]
        else:
            out.append(rng.randrange(6))
    return out[:n]


def _walked(row: list, parents: list, actual: list) -> int:
    """The drafts of a proposal (row[0] the root) a greedy verify accepts on `actual`."""
    node, depth = 0, 0
    for tok in actual:
        kids = [j for j in range(1, len(row)) if parents[j] == node and row[j] == tok]
        if not kids:
            break
        node, depth = kids[0], depth + 1
    return depth


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("seed", range(4))
def test_a_shadow_verify_accepts_what_a_propose_of_that_context_would(spec, seed):
    tokens, prompt_len, width = _tokens(seed), 10, spec.num_draft_tokens - 1
    full, shadow = _request(tokens, prompt_len), NgramDraft()
    accepted = []
    for context in range(prompt_len + 1, len(tokens) - width + 1):
        then = _request(tokens[:context], prompt_len)
        proposal = NgramDraft().propose([then], spec)
        row = proposal.draft_tokens[0].tolist()
        parents = (list(range(-1, width)) if spec.is_chain
                   else proposal.parents[0].tolist())
        expected = _walked(row, parents, tokens[context:context + width])
        got = shadow.shadow_accept(full, context, spec)
        assert got == expected, (context, got, expected)
        accepted.append(got)
    assert max(accepted) >= 2 and min(accepted) == 0  # the text has runs and misses
    # Not judged before the tokens that judge it are known.
    assert shadow.shadow_accept(full, len(tokens) - width + 1, spec) is None


def test_a_sampled_request_is_judged_on_chains_only():
    req = _request(_tokens(0), 10, greedy=False)
    assert NgramDraft().shadow_accept(req, 20, CHAIN) is not None
    assert NgramDraft().shadow_accept(req, 20, TREE) is None


def test_the_shadow_verifies_where_the_last_verify_left_off(monkeypatch):
    monkeypatch.setattr(shadow_mod, "MAX_LAG", 10_000)  # judged all at once, not as decoded
    tokens, prompt_len = _tokens(1, 200), 10
    req, draft = _request(tokens, prompt_len), NgramDraft()
    got = ShadowVerify(draft, CHAIN, evals_per_step=10_000).observe([req])
    context, expected = prompt_len + 1, []
    while context + 7 <= len(tokens):
        m = NgramDraft().shadow_accept(req, context, CHAIN)
        expected.append(m)
        context += m + 1
    assert got == expected and len(set(got)) > 2
    recent = [m + 1 for m in got[-shadow_mod.RECENT:]]
    assert req.shadow_verifies == len(got) and list(req.shadow_recent) == recent
    assert req.shadow_tokens == sum(recent)
    # Running alone, its accept length is its last RECENT_ALONE verifies'.
    alone = recent[-shadow_mod.RECENT_ALONE:]
    assert len(alone) < len(recent)
    assert accept_length([req]) == pytest.approx(sum(alone) / len(alone))
    # Nothing new to judge: nothing more.
    assert ShadowVerify(draft, CHAIN).observe([req]) == []


def test_the_budget_is_shared_by_turns_and_a_late_request_skips_ahead():
    reqs = [_request(_tokens(s, 60), 10) for s in range(3)]
    sv = ShadowVerify(NgramDraft(), CHAIN, evals_per_step=4)
    assert len(sv.observe(reqs)) == 4
    served = [r.shadow_verifies for r in reqs]
    assert served[0] > 0 and sum(served) == 4
    for _ in range(20):
        sv.observe(reqs)
    assert all(r.shadow_verifies > 0 for r in reqs)
    # A request far ahead of its shadow restarts MAX_LAG tokens before its last judged context.
    long = _request(_tokens(7, 400), 10)
    ShadowVerify(NgramDraft(), CHAIN, evals_per_step=1).observe([long])
    assert long.shadow_context >= 400 - 7 - shadow_mod.MAX_LAG


def test_the_chain_depth_cuts_what_a_shadow_verify_accepts(monkeypatch):
    monkeypatch.setattr(shadow_mod, "MAX_LAG", 10_000)
    tokens = _tokens(2, 200)
    full = ShadowVerify(NgramDraft(), CHAIN, 10_000).observe([_request(tokens, 10)])
    cut = ShadowVerify(NgramDraft(), CHAIN, 10_000).observe([_request(tokens, 10)], depth=1)
    assert max(full) > 1 and set(cut) <= {0, 1} and len(cut) > len(full)


def test_the_batch_accept_length_pools_recent_shadow_verifies():
    reqs = [_request(_tokens(s), 10) for s in range(3)]
    assert accept_length(reqs) is None  # none yet
    for req, tokens in zip(reqs, ([1] * 40, [8, 1, 1], [])):
        for t in tokens:
            _count(req, t)
    # The first request's last RECENT verifies (its oldest 8 dropped), the second's three.
    assert len(reqs[0].shadow_recent) == RECENT and reqs[0].shadow_tokens == RECENT
    assert accept_length(reqs) == pytest.approx((RECENT + 10) / (RECENT + 3))
    assert 3 < MIN_VERIFIES and accept_length(reqs[1:]) is None


def test_finish_prices_a_request_at_its_recent_shadow_verifies():
    req = _request(_tokens(0), 10)
    req.spec_verify_ct, req.spec_accepted_drafts = 2, 1
    f = Finish.of([req])
    assert f.verifies == (2,) and f.spec_tokens == (3,)
    for t in [1] * 40 + [3] * 8:
        _count(req, t)
    other = _request(_tokens(1), 10)
    f = Finish.of([req, other])
    assert f.verifies == (RECENT, 0) and f.spec_tokens == (RECENT - 8 + 3 * 8, 0)


def test_a_request_running_alone_is_priced_at_its_last_few_shadow_verifies():
    """One request has no straggler to guard against: its choice follows its acceptance's
    turns over its last RECENT_ALONE shadow verifies. After 40 verifies of nothing and 8 of
    three tokens it reads 2.0 tokens a verify, where its last RECENT read 1.5."""
    from specpcg.speculative.shadow import RECENT_ALONE

    req = _request(_tokens(0), 10)
    for t in [1] * 40 + [3] * 8:
        _count(req, t)
    f = Finish.of([req])
    assert RECENT_ALONE == 16 < RECENT
    assert f.verifies == (RECENT_ALONE,) and f.spec_tokens == (8 + 3 * 8,)
    assert accept_length([req]) == pytest.approx(2.0)
    assert accept_length([req, _request(_tokens(1), 10)]) == pytest.approx(
        (RECENT - 8 + 3 * 8) / RECENT)


def _run(ctrl, steps: int, shadow_tokens=None, spec_s=0.0012, plain_s=0.001) -> int:
    """Batch-1 steps (speculation emits 1 token a step when measured); returns those that
    speculated after the warm-up."""
    spec_after = 0
    for i in range(steps):
        spec = ctrl.use_spec(1)
        ctrl.record(1, spec, 1, spec_s if spec else plain_s)
        if shadow_tokens is not None:
            ctrl.shadow(shadow_tokens)
        spec_after += spec and i >= 2 * WARMUP_STEPS + 2
    return spec_after


def test_shadow_verifies_choose_without_looking():
    # A draft that accepts nothing: without a shadow the controller keeps looking at it.
    assert _run(AdaptiveSpeculation(), 900) > 0
    ctrl = AdaptiveSpeculation()
    assert _run(ctrl, 900, shadow_tokens=1) == 0
    info = ctrl.info()["1"]
    assert info["shadow_tokens_per_verify"] == 1.0 and info["spec_steps"] == WARMUP_STEPS
    # One whose shadow verifies accept two drafts each: speculation wins (3 tokens a 1.2 ms
    # step), though its own measured steps emitted one token each.
    assert _run(AdaptiveSpeculation(), 300, shadow_tokens=3) >= 290 - 2 * WARMUP_STEPS


def test_shadow_verifies_replay_a_speculating_engines_verifies(monkeypatch):
    """The default model speculating with NGRAM (pinned, greedy): replayed over each output,
    the shadow's verifies accept exactly what the engine's did, verify for verify, up to the
    last few (whose judging tokens were never decoded)."""
    from specpcg import Engine
    from specpcg.gsm8k import build_prompts
    monkeypatch.setattr(shadow_mod, "MAX_LAG", 10_000)
    engine = Engine(device="cpu", max_total_tokens=8192, speculative_algorithm="NGRAM",
                    speculative_num_steps=7, disable_adaptive_speculation=True)
    seen: dict = {}
    record = engine.spec_decoder.record

    def logged(req, m, depth=None):
        seen.setdefault(req.rid, (req, []))[1].append(m)
        record(req, m, depth)

    engine.spec_decoder.record = logged
    prompts = build_prompts(3, num_shots=1)[0]
    engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 48, "temperature": 0})
    spec = engine.spec_decoder.spec
    width, compared = spec.num_draft_tokens - 1, 0
    assert len(seen) >= 2  # a request may end at its first token
    for done, real in seen.values():
        req = _request(done.prompt_ids + done.output_ids, len(done.prompt_ids))
        got = ShadowVerify(NgramDraft(), spec, 10_000).observe([req])
        assert got == real[:len(got)] and len(real) - len(got) <= width, (got, real)
        compared += len(got)
    assert compared > 30 and any(m > 0 for _, ms in seen.values() for m in ms)


def test_an_adaptive_ngram_engine_runs_shadow_verifies_and_keeps_its_tokens():
    from specpcg import Engine

    prompts = ["The cat sat on the mat. The cat sat on the", "1, 2, 3, 4, 5, 6, 7, 8,"]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = Engine(device="cpu", max_total_tokens=4096).generate(prompt=prompts,
                                                                 sampling_params=params)
    engine = Engine(device="cpu", max_total_tokens=4096, speculative_algorithm="NGRAM")
    outs = engine.generate(prompt=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert engine.scheduler.shadow is not None
    buckets = engine.get_server_info()["speculative"]["adaptive"]
    assert any(b["shadow_tokens_per_verify"] for b in buckets.values()), buckets
    # Sampled requests are judged too (chains), beside greedy ones in one batch.
    sampled = {"max_new_tokens": 40, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    seen, observe = {}, engine.scheduler.shadow.observe

    def watched(reqs, depth=None):
        out = observe(reqs, depth)
        seen.update({r.params.is_greedy: r.shadow_verifies for r in reqs})
        return out

    engine.scheduler.shadow.observe = watched
    outs = engine.generate(prompt=prompts, sampling_params=[sampled, params])
    assert outs[1]["output_ids"] == plain[1]["output_ids"] and len(outs[0]["output_ids"]) == 40
    assert seen[False] > 0 and seen[True] > 0, seen


def _picks(ctrl, finish, spec_s: float = 0.0012, shadow: float = 2.0, steps: int = 60) -> list:
    """The controller's sides over `steps` steps of a batch of 4: speculative steps take
    spec_s, plain ones 1 ms, and shadow verifies measure `shadow` tokens a verify."""
    picks = []
    for _ in range(steps):
        spec = ctrl.use_spec(4, finish)
        ctrl.record(4, spec, 4, spec_s if spec else 0.001)
        ctrl.shadow(shadow)
        picks.append(spec)
    return picks


def test_shadow_verifies_on_rates_alone_never_ask_the_finish_estimate():
    """shadow_rates_only (bench_adaptive's adaptive-shadow-rates): with nothing waiting, the
    faster side per request runs."""
    def never():
        raise AssertionError("the finish estimate was asked")

    ctrl = AdaptiveSpeculation()
    ctrl.shadow_rates_only = True
    assert all(_picks(ctrl, never)[-40:])  # 2 tokens a 1.2 ms step against 1 a 1 ms step


def test_with_nothing_waiting_shadow_verifies_are_priced_by_the_finish_estimate():
    """By default a straggler decides where nothing waits: speculation 1.33x faster per request
    on the pooled shadow verifies (2 tokens a 1.5 ms step), yet the request accepting 1.0 a
    verify would end the batch later speculating, so plain steps run; with requests waiting,
    the rates."""
    straggler = Finish(remaining=(50,) * 4, spec_tokens=(48, 48, 48, 16), verifies=(16,) * 4)
    asked = []

    def finish():
        asked.append(1)
        return straggler

    ctrl = AdaptiveSpeculation()
    assert not any(_picks(ctrl, finish, spec_s=0.0015)[-40:]) and asked
    assert all(_picks(AdaptiveSpeculation(), None, spec_s=0.0015)[-40:])


@pytest.mark.parametrize("below", [0, 8])
def test_a_side_known_by_its_warm_up_alone_is_looked_at_again_sooner_when_asked(below):
    """relook_below (bench_adaptive's adaptive-shadow-relook): with shadow verifies a bucket
    looks every EXPLORE_MAX_EVERY steps, so the plain side keeps its warm-up's steps; asked,
    it looks as other buckets do until the side holds `below` recorded steps, then no more."""
    ctrl = AdaptiveSpeculation()
    ctrl.relook_below = below
    picks = _picks(ctrl, None, shadow=1.5, steps=900)  # speculation 1.25x faster
    plain_after_warm_up = picks[2 * WARMUP_STEPS + 1:].count(False)  # (+1: the switch back)
    if below:
        assert plain_after_warm_up >= 6, picks  # looks of 3 steps, the first a switch
        assert len(ctrl._bucket(4).decode.recent) >= below
        assert picks[300:].count(False) == 0, picks  # then every EXPLORE_MAX_EVERY steps
    else:
        assert plain_after_warm_up == 0, picks


def test_the_relook_hold_sets_every_new_bucket():
    """bench_adaptive's adaptive-shadow-relook is a system it runs, and it makes every bucket
    made from then on look at a side known by fewer than 8 steps."""
    from types import SimpleNamespace

    _sim()  # benchmarks/ on the path
    from bench_adaptive import EXTRA_SYSTEMS
    from holds import HOLDS

    ctrl = AdaptiveSpeculation()
    HOLDS["adaptive-shadow-relook"](SimpleNamespace(scheduler=SimpleNamespace(adaptive=ctrl)))
    ctrl.use_spec(4)
    ctrl.use_spec(64)
    assert "adaptive-shadow-relook" in EXTRA_SYSTEMS
    assert ctrl._bucket(4).relook_below == ctrl._bucket(64).relook_below == 8


def _sim():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from sim_adaptive import simulate
    return simulate


@pytest.mark.parametrize("batch", [16, 64])
def test_simulated_shadow_verifies_keep_a_draft_that_never_pays_nearly_free(batch):
    """benchmarks/sim_adaptive.py --shadow: an untrained draft (accept chance 0.05) costs its
    warm-up and nothing else: no looks, so within 1% of plain decoding."""
    t = _sim()(batch, 0.0, seeds=2, mean_alpha=0.05, shadow=True)
    assert t["plain"] < t["spec"] and t["plain"] / t["adaptive"] > 0.99, t


@pytest.mark.parametrize("batch", [4, 16, 64])
def test_simulated_shadow_verifies_follow_acceptance_along_an_answer(batch):
    """--growth: acceptance rises from nothing at an answer's start to twice its mean at its
    end. Following it, adaptive beats both pinned sides (plain early, speculation late)."""
    t = _sim()(batch, 0.0, seeds=2, mean_alpha=0.7, growth=True, shadow=True)
    assert t["adaptive"] < min(t["spec"], t["plain"]), t


def test_shadow_verifies_can_be_priced_by_the_finish_estimate_over_a_shorter_window():
    """bench_adaptive's adaptive-finish8: the controller asks the finish estimate with nothing
    waiting, and each request keeps its last 8 shadow verifies."""
    asked = []

    def finish():
        asked.append(1)
        return Finish(remaining=(50,), spec_tokens=(16,), verifies=(8,))

    ctrl = AdaptiveSpeculation()
    ctrl.shadow_rates_only = False
    for _ in range(40):
        spec = ctrl.use_spec(4, finish)
        ctrl.record(4, spec, 4, 0.0012 if spec else 0.001)
        ctrl.shadow(2.0)
    assert asked
    req = _request(_tokens(1, 200), 10)
    ShadowVerify(NgramDraft(), CHAIN, 10_000, recent=8).observe([req])
    assert req.shadow_recent.maxlen == 8 and len(req.shadow_recent) == 8
    assert req.shadow_tokens == sum(req.shadow_recent)
