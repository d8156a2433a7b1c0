"""Adaptive speculation inside the engine: a scheduler that mixes plain decode steps into
speculative ones keeps every greedy token, hands its draft what it needs, and times only the
steps that resolved tokens."""

import statistics

import pytest

from specpcg.speculative.adaptive import AdaptiveSpeculation
from specpcg.speculative.bucket import SPEC_HOME, SWITCH_MARGIN
from specpcg.speculative.finish import MIN_ACCEPTS
from tests.eagle_world import (ALGOS, SETTINGS, _check_no_leak, _engine,  # noqa: F401
                               _exact_outputs_all_accepted, plain, world)


class _Recorder:
    """An adaptive controller that always speculates (or never) and keeps what it is told."""

    def __init__(self, spec: bool):
        self.spec, self.records, self.interrupts, self.seconds = spec, [], 0, []
        self.ended, self.flushes = [], []

    def use_spec(self, batch_size, finish=None, behind=None, position=None):
        return self.spec

    def record(self, batch_size, spec, tokens, seconds):
        self.records.append((batch_size, spec, tokens))
        self.seconds.append(seconds)

    def interrupt(self):
        self.interrupts += 1
        self.records.append("prefill")

    def flushed(self, batch_size, spec, tokens, seconds):
        self.flushes.append((batch_size, spec, tokens, seconds))

    def finished(self, req):
        self.ended.append((req.rid, req.spec_verify_ct, req.spec_accepted_drafts))


def steps_of(rec: _Recorder) -> list:
    return [r for r in rec.records if r != "prefill"]


@pytest.mark.parametrize("spec", [False, True])
def test_the_scheduler_times_only_steps_that_resolved_tokens(world, spec):
    """An overlapped plain call that only launched its step emitted nothing yet: it must not be
    recorded as a step of bs tokens in a launch's time. Every prefill interrupts."""
    engine = _engine(world.noisy, "EAGLE3", world.heads["EAGLE3"])
    rec = engine.scheduler.adaptive = _Recorder(spec)
    ov, resolving = engine.scheduler.overlap, []
    step = ov.step
    ov.step = lambda: resolving.append(ov.inflight is not None) or step()
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    if not spec:  # one record per overlapped call that resolved a step, none for a launch
        assert False in resolving and len(steps_of(rec)) == resolving.count(True)
    emitted = sum(len(o["output_ids"]) - 1 for o in outs)  # the first token is the prefill's
    steps = steps_of(rec)
    assert rec.interrupts >= 1 and rec.records[0] == "prefill"
    assert all(side == spec for _, side, _ in steps)
    # Each resolved token is recorded once at most; a request's last step may run past its end
    # (a plain step one token, a verify its accepted path), and those tokens are dropped.
    overshoot = len(world.prompts) * (engine.scheduler.spec.tokens_per_request if spec else 1)
    assert 0 < sum(t for _, _, t in steps) <= emitted + overshoot


def test_every_finished_request_hands_its_verifies_to_the_controller(world):
    """The finish estimate's priors are the accept lengths of requests that ended: each request
    is handed over once, when it finishes, with the verifies its meta_info reports."""
    engine = _engine(world.noisy, "EAGLE3", world.heads["EAGLE3"])
    rec = engine.scheduler.adaptive = _Recorder(True)
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert sorted(rid for rid, _, _ in rec.ended) == sorted(o["meta_info"]["id"] for o in outs)
    by_rid = {rid: (n, acc) for rid, n, acc in rec.ended}
    for o in outs:
        meta = o["meta_info"]
        assert by_rid[meta["id"]] == (meta["spec_verify_ct"], meta["spec_accepted_drafts"])


@pytest.mark.parametrize("spec", [False, True])
def test_a_step_is_timed_with_the_host_work_after_the_step_before(world, spec):
    """The host's work between two decode steps (here a 30 ms pause of the caller) counts in
    the step's time: with overlap a call alone would leave it out, and a side whose steps hand
    back more tokens (speculation) would measure faster than it runs."""
    import time

    engine = _engine(world.noisy, "EAGLE3", world.heads["EAGLE3"])
    rec = engine.scheduler.adaptive = _Recorder(spec)
    for prompt, params in zip(world.prompts[:2], world.params[:2]):
        engine.submit(input_ids=prompt, sampling_params=params)
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.03)
    # The first step after the prefill is timed from its own start (the controller skips it).
    assert len(rec.seconds) >= 3 and all(s >= 0.03 for s in rec.seconds[1:]), rec.seconds


class _SpecThenPlain(_Recorder):
    """Two speculative steps, then plain ones."""

    def __init__(self):
        super().__init__(True)
        self.asked = 0

    def use_spec(self, batch_size, finish=None, behind=None, position=None):
        self.asked += 1
        return self.asked <= 2


def test_a_switch_step_is_timed_from_the_step_before_the_launch(world):
    """After a switch to plain steps the first overlapped call only launches its step: the step
    that resolves it is timed from the speculative step before the launch, so the switch's cost
    lands on the switch step (the controller measures it) instead of vanishing."""
    import time

    engine = _engine(world.noisy, "EAGLE3", world.heads["EAGLE3"])
    rec = engine.scheduler.adaptive = _SpecThenPlain()
    engine.submit(input_ids=world.prompts[0], sampling_params={**world.params[0],
                                                               "max_new_tokens": 24})
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.03)
    sides = [side for _, side, _ in steps_of(rec)]
    first_plain = sides.index(False)
    assert sides[:first_plain] == [True, True], sides
    # Two pauses (before the launch, before the resolving call) in the switch step; one after
    # (a later step's own hiccup on a busy host may double one: the median is compared).
    later = rec.seconds[first_plain + 1:]
    shown = f"{[round(s, 4) for s in rec.seconds]}"
    assert rec.seconds[first_plain] >= 0.06, shown
    assert min(later) >= 0.03 and statistics.median(later) < rec.seconds[first_plain], shown


class Alternating(AdaptiveSpeculation):
    """Speculative and plain steps by turns, whatever they measure."""

    def __init__(self):
        super().__init__()
        self.turn = 0

    def use_spec(self, batch_size: int, finish=None, behind=None, position=None) -> bool:
        self.turn += 1
        return self.turn % 2 == 1


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("algo", ALGOS)
def test_plain_steps_between_speculative_ones_hand_the_head_every_state(world, algo, setting):
    """On the exact target a synthetic head is right only when handed the target state of the
    right position: after each plain step it must still accept every draft."""
    engine = _engine(world.exact, algo, world.heads[algo], **SETTINGS[setting])
    engine.scheduler.adaptive = Alternating()
    for out in _exact_outputs_all_accepted(world, engine):
        meta = out["meta_info"]
        assert meta["plain_decode_tokens"] > 0
        spec_tokens = meta["completion_tokens"] - meta["plain_decode_tokens"]
        assert meta["spec_accept_length"] == pytest.approx(spec_tokens / meta["spec_verify_ct"])
    _check_no_leak(engine)


class Stretches(AdaptiveSpeculation):
    """One speculative step, then `plain` plain ones, by turns."""

    def __init__(self, plain: int):
        super().__init__()
        self.plain, self.turn = plain, -1

    def use_spec(self, batch_size: int, finish=None, behind=None, position=None) -> bool:
        self.turn += 1
        return self.turn % (self.plain + 1) == 0


@pytest.mark.parametrize("algo", ALGOS)
def test_stretches_of_plain_steps_hand_the_head_every_state(world, algo):
    """Plain steps over an unchanged batch are logged whole and handed to the requests when the
    batch changes (requests finish mid-stretch here: lengths 10, 12, ...) or speculation
    resumes: every draft is still accepted, and some stretches spanned several steps."""
    engine = _engine(world.exact, algo, world.heads[algo], **SETTINGS["chain"])
    engine.scheduler.adaptive = Stretches(4)
    draft, logged = engine.draft, []
    hand_over = draft._hand_over
    draft._hand_over = lambda: logged.append(len(draft._plain) if draft._plain else 0) \
        or hand_over()
    for out in _exact_outputs_all_accepted(world, engine):
        assert out["meta_info"]["plain_decode_tokens"] >= 4
    assert max(logged) >= 3, logged
    _check_no_leak(engine)


@pytest.mark.parametrize("algo", ALGOS + ("NGRAM",))
def test_alternating_steps_keep_the_greedy_tokens(world, plain, algo):  # noqa: F811
    head = world.heads.get(algo)
    engine = _engine(world.noisy, algo, head)
    engine.scheduler.adaptive = Alternating()
    ov, launched = engine.scheduler.overlap, []
    step = ov.step
    ov.step = lambda: launched.append(1) or step()  # plain steps run ahead of their results
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    assert all(o["meta_info"]["plain_decode_tokens"] > 0 for o in outs)
    assert launched, "no plain step was overlapped"
    # Plain tokens resolved a step late are still counted as plain: what is left of each output
    # is its prefill's first token and what verifies emitted.
    metas = [o["meta_info"] for o in outs]
    state = engine.get_server_info()["internal_states"][0]
    emitted = state["avg_spec_accept_length"] * state["spec_verify_ct"]
    spec_tokens = sum(m["completion_tokens"] - m["plain_decode_tokens"] - 1 for m in metas)
    assert spec_tokens <= emitted + 1e-6, (spec_tokens, emitted)
    if head:
        _check_no_leak(engine)


def test_adaptive_is_on_by_default_reported_and_can_be_pinned(world):
    engine = _engine(world.noisy, "NGRAM", disable_adaptive_speculation=False)
    engine.generate(input_ids=world.prompts, sampling_params=world.params)
    adaptive = engine.get_server_info()["speculative"]["adaptive"]
    assert adaptive and all(b["spec_steps"] + b["decode_steps"] > 0 for b in adaptive.values())
    pinned = _engine(world.noisy, "NGRAM", disable_adaptive_speculation=True)
    assert pinned.scheduler.adaptive is None
    assert pinned.get_server_info()["speculative"]["adaptive"] is None
    simulated = _engine(world.noisy, "NGRAM", disable_adaptive_speculation=False,
                        speculative_simulate_accept_prob=0.5)
    assert simulated.scheduler.adaptive is None  # a benchmark of the speculative path itself


def _decisions(engine) -> list:
    """(running batch size, speculates) of every decode step the scheduler asks about."""
    s, seen = engine.scheduler, []
    ask = s._next_speculates

    def spy():
        choice = ask()
        if s.running:
            seen.append((len(s.running), choice))
        return choice
    s._next_speculates = spy
    return seen


CAP = 4
# 8 requests ending 8 tokens apart: the batch shrinks through the cap with more than
# adaptive.TAIL_TOKENS left to its longest (a batch's tail is not warmed up).
LONG = [{"max_new_tokens": 24 + 8 * i, "temperature": 0, "ignore_eos": True} for i in range(8)]


@pytest.fixture(scope="module")
def plain_long(world):
    outs = _engine(world.noisy).generate(input_ids=world.prompts, sampling_params=LONG)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("algo", ("EAGLE3", "NGRAM"))
def test_a_batch_above_the_cap_decodes_plain_and_speculates_once_below(world, plain_long, algo,
                                                                      adaptive):
    """speculative_disable_by_batch_size: more running requests than the cap take plain steps
    (adaptive speculation is not asked, so it warms up and looks only below the cap); once
    the batch has shrunk to the cap, speculation resumes; every greedy token is kept."""
    engine = _engine(world.noisy, algo, world.heads.get(algo),
                     disable_adaptive_speculation=not adaptive,
                     speculative_disable_by_batch_size=CAP)
    seen = _decisions(engine)
    outs = engine.generate(input_ids=world.prompts, sampling_params=LONG)
    assert [o["output_ids"] for o in outs] == plain_long
    assert not any(spec for bs, spec in seen if bs > CAP), seen
    assert any(bs > CAP for bs, _ in seen) and any(spec for bs, spec in seen if bs <= CAP)
    if adaptive:  # bucket 8 (5-8 requests) never speculated, nor warmed up
        info = engine.get_server_info()["speculative"]
        assert info["disable_by_batch_size"] == CAP
        assert info["adaptive"]["8"]["spec_steps"] == 0 < info["adaptive"]["8"]["decode_steps"]
    if algo != "NGRAM":
        _check_no_leak(engine)


def test_a_head_resumes_below_the_cap_with_every_state(world):
    """On the exact target a synthetic head accepts every draft only if it was handed the
    target state of every position, the plain steps above the cap included."""
    engine = _engine(world.exact, "EAGLE3", world.heads["EAGLE3"],
                     speculative_disable_by_batch_size=CAP)
    outs = _exact_outputs_all_accepted(world, engine)
    longest = outs[-1]["meta_info"]
    assert longest["plain_decode_tokens"] > 0 and longest["spec_verify_ct"] > 0
    _check_no_leak(engine)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_a_bad_cap_is_refused_by_name(world, bad):
    with pytest.raises(ValueError, match=f"speculative_disable_by_batch_size must be a "
                                         f"positive integer, got {bad!r}"):
        _engine(world.noisy, "NGRAM", speculative_disable_by_batch_size=bad)


def test_the_cli_hands_the_cap_to_the_engine():
    import argparse

    from specpcg.__main__ import _engine_args, _engine_kwargs

    parser = argparse.ArgumentParser()
    _engine_args(parser)
    given = _engine_kwargs(parser.parse_args(["--speculative-disable-by-batch-size", "32"]))
    assert given["speculative_disable_by_batch_size"] == 32
    assert _engine_kwargs(parser.parse_args([]))["speculative_disable_by_batch_size"] is None


def test_the_cli_refuses_a_bad_cap_by_name_without_a_traceback(capsys):
    from specpcg.__main__ import main

    with pytest.raises(SystemExit) as ended:
        main(["generate", "--prompt", "x", "--device", "cpu", "--speculative-algorithm", "NGRAM",
              "--speculative-disable-by-batch-size", "0"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "speculative_disable_by_batch_size must be a positive integer, got 0" in err
    assert "Traceback" not in err


class _LagRecorder(_Recorder):
    """Keeps, each step, the draft's lag it is told (use_spec's `behind`) beside the running
    requests' lengths."""

    def __init__(self, spec: bool, scheduler):
        super().__init__(spec)
        self.scheduler, self.lags = scheduler, []

    def use_spec(self, batch_size, finish=None, behind=None, position=None):
        self.lags.append((behind(), [r.seq_len for r in self.scheduler.running]))
        return self.spec

    def info(self) -> dict:  # what the engine reports of its controller
        return {}


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE3"])
def test_the_controller_is_told_the_drafts_whole_lag_prompts_included(world, algo):
    """A switch into speculation catches the draft up on every position it lacks: a request's
    whole prompt, then each plain step. Held to plain steps the draft never ran, so the lag is
    every running request's length; speculating, each step leaves it at most a verify's
    path and its root."""
    draft = world.exact if algo == "STANDALONE" else world.heads[algo]
    for spec in (False, True):
        engine = _engine(world.noisy, algo, draft)
        rec = engine.scheduler.adaptive = _LagRecorder(spec, engine.scheduler)
        engine.generate(input_ids=world.prompts, sampling_params=world.params)
        assert len(rec.lags) > 5
        if not spec:
            assert all(lag == sum(lens) for lag, lens in rec.lags)
            continue
        later = [(lag, lens) for (lag, lens), (_, before) in zip(rec.lags[1:], rec.lags)
                 if len(lens) == len(before)]  # the same batch a step on: no prompt in it
        path = engine.scheduler.spec.tokens_per_request + 1
        assert later and all(lag <= path * len(lens) for lag, lens in later), later
        _check_no_leak(engine)


@pytest.mark.parametrize("hold", ["adaptive-rate", "plain", "adaptive-untold",
                                  "adaptive-symmetric", "adaptive-unflushed",
                                  "adaptive-min16", "adaptive-unplaced"])
def test_bench_adaptives_holds_take_what_the_scheduler_passes(world, hold):
    """bench_adaptive's systems that wrap the controller's use_spec are called as the
    scheduler calls it; adaptive-untold alone keeps the draft's lag from the controller;
    adaptive-symmetric's buckets want speculation SWITCH_MARGIN faster to switch into it;
    adaptive-unflushed's controller leaves flushed steps uncounted; adaptive-min16's wants 16
    finished requests for its priors; adaptive-unplaced's measures a batch of one blind to
    where its request is."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_adaptive

    engine = _engine(world.noisy, "STANDALONE", world.exact, disable_adaptive_speculation=False)
    adaptive, told = engine.scheduler.adaptive, []
    choose = adaptive.use_spec
    adaptive.use_spec = lambda bs, finish=None, behind=None, position=None: told.append(
        behind) or choose(bs, finish, behind, position)
    bench_adaptive.HOLDS[hold](engine)
    outs = engine.generate(input_ids=world.prompts[:3], sampling_params=world.params[:3])
    assert all(len(o["output_ids"]) > 1 for o in outs)
    if hold == "plain":
        assert not told and outs[0]["meta_info"]["plain_decode_tokens"] > 0
    else:
        assert told and all((b is None) == (hold == "adaptive-untold") for b in told)
    margins = {b._into_spec_margin() for b in adaptive._buckets.values()}
    assert margins == ({SWITCH_MARGIN} if hold == "adaptive-symmetric" else {-SPEC_HOME})
    assert adaptive.count_flushed == (hold != "adaptive-unflushed")
    assert adaptive.min_accepts == (16 if hold == "adaptive-min16" else MIN_ACCEPTS)
    assert adaptive.place_batch_of_one == (hold != "adaptive-unplaced")
