"""The step a switch of side reads first (the other side's step in flight, with overlap
scheduling) goes to adaptive speculation: out of speculation as a steady speculative step, into
it as the switch's cost beyond a plain step (the draft's catch-up ran before that read)."""

import importlib.util
import os
import time

import pytest

from specpcg.speculative.adaptive import AdaptiveSpeculation
from tests.eagle_world import _engine, world  # noqa: F401
from tests.test_adaptive_engine import _Recorder


def _plain_then_switch(ctrl, catch_up_s: float) -> None:
    """Plain steps of 1 ms at batch 4, a switch into speculation whose flushed plain step
    carried a catch-up of `catch_up_s`, then two speculative steps of 2 ms."""
    for _ in range(5):
        ctrl.record(4, False, 4, 0.001)
    ctrl.flushed(4, False, 4, 0.001 + catch_up_s)
    ctrl.record(4, True, 8, 0.002)  # the switch step
    ctrl.record(4, True, 8, 0.002)  # the steady step it is measured against


@pytest.mark.parametrize("counted", [True, False])
def test_a_catch_up_before_the_flush_is_the_switch_into_speculations_cost(counted):
    ctrl = AdaptiveSpeculation()
    ctrl.count_flushed = counted
    _plain_then_switch(ctrl, catch_up_s=0.010)
    cost = ctrl._buckets[4].switches.cost(True)
    assert cost == pytest.approx(0.010 if counted else 0.0)
    # Neither side's rate takes the flushed step in: it is no steady step of either.
    assert ctrl._buckets[4].decode.steps == 5 and ctrl._buckets[4].spec.steps == 1


def test_a_speculative_step_flushed_at_a_switch_out_is_a_steady_one():
    ctrl = AdaptiveSpeculation()
    _plain_then_switch(ctrl, catch_up_s=0.0)
    ctrl.flushed(4, True, 12, 0.002)  # a look's last step: 3 tokens a request
    spec = ctrl._buckets[4].spec
    assert spec.steps == 2 and list(spec.recent)[-1] == (3.0, 0.002)
    ctrl.record(4, False, 4, 0.005)  # the switch step out: not a steady plain step
    assert ctrl._buckets[4].decode.steps == 5


class _Look(_Recorder):
    """`plain` plain steps, then `spec` speculative ones, by turns."""

    def __init__(self, plain: int, spec: int):
        super().__init__(False)
        self.plain, self.spec_steps, self.turn = plain, spec, -1

    def use_spec(self, batch_size, finish=None, behind=None, position=None):
        self.turn += 1
        return self.turn % (self.plain + self.spec_steps) >= self.plain


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and the interpreter (TRITON_INTERPRET=1)")
def test_the_scheduler_hands_over_each_step_a_switch_flushed(world):
    """A switch into speculation reads the plain step in flight after the draft's catch-up
    (here slowed by 50 ms): that step comes with its batch's one token a request and the
    catch-up's time. A switch out of it reads a speculative step: its verify's tokens."""
    # Speculative steps overlap with a backend that plans on the device (Triton's).
    engine = _engine(world.noisy, "EAGLE3", world.heads["EAGLE3"], attention_backend="triton")
    rec = engine.scheduler.adaptive = _Look(plain=5, spec=3)
    overlap = engine.scheduler.spec_overlap
    catch_up = overlap.catch_up
    overlap.catch_up = lambda reqs: time.sleep(0.05) or catch_up(reqs)
    engine.generate(input_ids=world.prompts[:2],
                    sampling_params=[{**p, "max_new_tokens": 20, "ignore_eos": True}
                                     for p in world.params[:2]])
    into = [f for f in rec.flushes if not f[1]]
    out_of = [f for f in rec.flushes if f[1]]
    assert len(into) >= 2 and len(out_of) >= 2, rec.flushes
    assert all(tokens == bs and s >= 0.05 for bs, _, tokens, s in into), into
    assert all(tokens >= bs and s < 0.05 for bs, _, tokens, s in out_of), out_of


@pytest.mark.parametrize("min_accepts", [4, 16])
def test_a_young_batch_takes_its_priors_from_a_few_finished_requests(min_accepts):
    """Speculation is 11% faster a request at the bucket's mean accept length (2.0 tokens in
    1.8 plain steps' time), but 4 finished requests accepted 1.2, 1.5, 2.4 and 2.6: a young
    batch of 4 whose slowest is priced at 1.2 finishes sooner on plain steps. From 4 finished
    requests on (MIN_ACCEPTS) the estimate sees that; counted from 16 it priced every young
    request at the mean and speculated."""
    from types import SimpleNamespace

    from specpcg.speculative.finish import Finish
    from tests.test_adaptive import _warm

    ctrl = AdaptiveSpeculation()
    ctrl.min_accepts = min_accepts
    for accepted in (2, 5, 14, 16):  # over 10 verifies each
        ctrl.finished(SimpleNamespace(spec_verify_ct=10, spec_accepted_drafts=accepted,
                                     shadow_verifies=0))
    _warm(ctrl, 4, spec_step_s=1.8, accept=2.0, plain_step_s=1.0)
    young = Finish(remaining=(128,) * 4, spec_tokens=(0,) * 4, verifies=(0,) * 4)
    assert ctrl.use_spec(4, young) is (min_accepts == 16)


def test_a_request_shadow_verifies_priced_teaches_the_priors_only_from_many_real_verifies():
    """A request that decoded plain verified only in a warm-up's 3 steps (NGRAM's, at its
    answer's start, where it accepts least): with shadow verifies pricing it, it joins the
    priors only with SHADOWED_MIN_VERIFIES real verifies; without, with 3 as before."""
    from types import SimpleNamespace

    from specpcg.speculative.finish import MIN_VERIFIES, SHADOWED_MIN_VERIFIES

    ctrl = AdaptiveSpeculation()
    ctrl.finished(SimpleNamespace(spec_verify_ct=3, spec_accepted_drafts=0, shadow_verifies=20))
    ctrl.finished(SimpleNamespace(spec_verify_ct=SHADOWED_MIN_VERIFIES - 1,
                                  spec_accepted_drafts=30, shadow_verifies=20))
    assert list(ctrl.accepts) == [] and MIN_VERIFIES < SHADOWED_MIN_VERIFIES
    ctrl.finished(SimpleNamespace(spec_verify_ct=SHADOWED_MIN_VERIFIES,
                                  spec_accepted_drafts=SHADOWED_MIN_VERIFIES, shadow_verifies=20))
    ctrl.finished(SimpleNamespace(spec_verify_ct=3, spec_accepted_drafts=3, shadow_verifies=0))
    assert list(ctrl.accepts) == [2.0, 2.0]
