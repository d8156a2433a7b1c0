"""benchmarks/sim_adaptive.py's cold first look and its calibration from a probe's log."""

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sim_adaptive as sim  # noqa: E402


def test_an_engines_first_look_into_speculation_costs_cold_once(monkeypatch):
    """--catch-up A B C: the first switch from plain steps into speculation of each simulated
    engine costs C more, once; a batch's first step (its prompts' catch-up) is not a look."""
    monkeypatch.setattr(sim, "CATCH_UP", (0.004, 1e-6, 0.009))
    running = [sim.SimRequest(0.7, behind=10), sim.SimRequest(0.7, behind=30)]
    one, other = sim.AdaptiveSpeculation(), sim.AdaptiveSpeculation()
    warm = 0.004 + 40e-6
    assert sim.switch_seconds(True, None, running, one) == pytest.approx(warm)
    assert sim.switch_seconds(True, False, running, one) == pytest.approx(warm + 0.009)
    assert sim.switch_seconds(True, False, running, one) == pytest.approx(warm)
    assert sim.switch_seconds(True, False, running, other) == pytest.approx(warm + 0.009)
    assert sim.switch_seconds(True, False, running) == pytest.approx(warm)  # no engine named


def _call(system, kind, bs, seconds, tokens=1):
    return {"system": system, "kind": kind, "bs": bs, "s": seconds, "tokens": tokens}


def test_catch_up_takes_two_or_three_values():
    with pytest.raises(SystemExit, match="A_MS B_US"):
        sim.main(["--catch-up", "1.0"])


def test_calibrate_takes_each_sides_median_call_and_the_pinned_accept_lengths(tmp_path):
    rows = [_call("pinned", "spec", 1, s) for s in (1e-3, 2e-3, 9e-3)]
    rows += [_call("no-spec", "plain", 1, s) for s in (5e-4, 6e-4, 7e-4)]
    rows += [_call("no-spec", "plain", 1, 1.0, tokens=0),  # a launch: left out
             {"probe": "adaptive_steps", "system": "pinned", "batch": 1,
              "accept_lengths": [2.0, 3.0]}]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    step_s, alphas = sim.calibrate(str(path))
    assert step_s == {(True, 1): pytest.approx(2e-3), (False, 1): pytest.approx(6e-4)}
    chain = [sum(a ** k for k in range(sim.DRAFT_TOKENS)) for a in alphas]
    assert chain == [pytest.approx(2.0, abs=1e-6), pytest.approx(3.0, abs=1e-6)]
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="no-spec"):
        sim.calibrate(str(path))


def test_a_sequence_runs_the_acceptance_and_shadow_verifies_it_is_given(monkeypatch):
    """--sequence --growth --shadow: the batches take acceptance rising along each answer, and
    the controller gets shadow verifies (each request keeps them), as without --sequence."""
    kept = []
    real = sim.run_batch

    def run_batch(*args, **kwargs):
        kept.append((kwargs.get("growth"), kwargs.get("shadow")))
        return real(*args, **kwargs)

    monkeypatch.setattr(sim, "run_batch", run_batch)
    steady = sim.simulate_sequence([4], 0.0, seeds=1)
    assert set(kept) == {(False, 0)}
    kept.clear()
    rising = sim.simulate_sequence([4], 0.0, seeds=1, growth=True, shadow=True, shadow_finish=32)
    assert set(kept) == {(True, 32)}
    assert rising[4]["spec"] != steady[4]["spec"]


def test_the_ngram_rates_take_their_own_chain(monkeypatch, tmp_path):
    """--rates h100-ngram-chat: NGRAM's (7, 1, 8) chain, up to 8 tokens a verify, and steps
    priced at its measured milliseconds (a plain step 1 / 1.22 of a speculative one)."""
    monkeypatch.setattr(sim, "DRAFT_TOKENS", sim.DRAFT_TOKENS)
    for name in ("MEAN_ACCEPT", "SPEC_RATE", "PLAIN_RATE", "STEP_S"):
        monkeypatch.setattr(sim, name, getattr(sim, name))
    sim.main(["--rates", "h100-ngram-chat", "--batches", "1", "--alphas", "0.9", "--spreads", "0",
              "--seeds", "1", "--rounds", "1", "--out", str(tmp_path / "sim.jsonl")])
    assert sim.DRAFT_TOKENS == 8
    assert sim.step_seconds(True, 64) == pytest.approx(1.65e-3, rel=0.01)
    ratio = sim.step_seconds(True, 64) / sim.step_seconds(False, 64)
    assert ratio == pytest.approx(1.22, rel=0.01)
    rng = random.Random(0)
    assert max(sim._accepted(rng, 0.97) for _ in range(50)) == 8


def test_a_shadow_budget_spends_n_verifies_a_step_where_the_last_step_left_off(monkeypatch):
    """--shadow-budget N: as the engine's ShadowVerify, N verifies a step over the running
    requests' unjudged tokens, a request kept first while it has tokens left to judge, and one
    fallen more than MAX_LAG behind skipping ahead."""
    monkeypatch.setattr(sim, "SHADOW_BUDGET", 4)
    reqs = [sim.SimRequest(0.0, out=100, unjudged=100) for _ in range(3)]
    reqs[2].unjudged = 3  # too few tokens after it for a verify to be judged
    nxt = sim._shadow_budgeted(random.Random(0), reqs, 128, False, 32, start=1)
    assert [r.shadow_verifies for r in reqs] == [0, 4, 0]  # accept chance 0: a token each
    assert nxt == 1 and reqs[1].unjudged == sim.MAX_LAG - 4
    nxt = sim._shadow_budgeted(random.Random(0), reqs, 128, False, 32, start=nxt)
    assert [r.shadow_verifies for r in reqs] == [0, 8, 0]


def test_every_policy_meets_the_same_requests_whatever_its_steps_draw(monkeypatch):
    """A seed's requests (their accept chances) come from a stream of their own: pinned
    speculation draws every request's acceptance each step and plain decoding draws none, yet
    both meet the same requests batch after batch."""
    met = []

    class Recorded(sim.SimRequest):
        def __init__(self, alpha, **kw):
            super().__init__(alpha, **kw)
            met[-1].append(alpha)

    monkeypatch.setattr(sim, "SimRequest", Recorded)
    for policy in ("spec", "plain"):
        rng, requests = sim._rngs(3)
        for _ in range(3):
            met.append([])
            sim.run_batch(policy, None, rng, 4, 0.25, new_tokens=16, requests=requests)
    assert met[:3] == met[3:] and len(set(met[0] + met[1])) == 8
