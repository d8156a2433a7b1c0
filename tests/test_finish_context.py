"""A running batch's finish counts the context's room: a request at the context length ends
there, whatever its max_new_tokens left."""

from types import SimpleNamespace

from specpcg.scheduler import Scheduler
from specpcg.speculative.finish import Finish, ends_within
from specpcg.stopping import StopChecker


def _req(prompt: int, out: int, max_new: int):
    return SimpleNamespace(params=SimpleNamespace(max_new_tokens=max_new),
                           output_ids=[0] * out, seq_len=prompt + out, spec_verify_ct=0,
                           spec_accepted_drafts=0, shadow_recent=None)


def test_the_context_caps_what_a_request_may_still_emit():
    reqs = [_req(16, 230, 256), _req(100, 10, 20), _req(250, 6, 256)]
    assert Finish.of(reqs).remaining == (26, 10, 250)
    # 256 positions: 10 more for the first, its max_new_tokens for the second, 1 at the end.
    sched = SimpleNamespace(running=reqs, stop_checker=StopChecker(None, (), 256), shadow=None)
    assert Scheduler._finish_estimate(sched).remaining == (10, 10, 1)


def test_the_schedulers_estimate_reads_the_stop_checkers_context():
    reqs = [_req(16, 236, 256)] * 4
    sched = SimpleNamespace(running=reqs, stop_checker=StopChecker(None, (), 256), shadow=None)
    finish = Scheduler._finish_estimate(sched)
    # Four tokens from the context's end: the batch's tail, where no bucket warms up.
    assert finish.remaining == (4,) * 4 and ends_within(finish, 16)
    sched.stop_checker = None
    assert Scheduler._finish_estimate(sched).remaining == (20,) * 4


def test_with_shadow_verifies_a_request_they_have_not_reached_takes_its_prior_alone():
    """In an engine with shadow verifies, a request with none yet is priced at its prior, not at
    its few real verifies (a warm-up's at its answer's start); one they reached at its recent
    ones; without them, at its real verifies."""
    from collections import deque

    unreached = _req(16, 4, 256)
    unreached.spec_verify_ct, unreached.spec_accepted_drafts = 4, 0  # a warm-up: 1.0 a verify
    reached = _req(16, 40, 256)
    reached.spec_verify_ct = 4
    reached.shadow_recent, reached.shadow_tokens = deque([3, 1, 2]), 6
    shadowed = Finish.of([unreached, reached], shadowed=True)
    assert shadowed.verifies == (0, 3) and shadowed.spec_tokens == (0, 6)
    plain = Finish.of([unreached, reached])
    assert plain.verifies == (4, 3) and plain.spec_tokens == (4, 6)
    # Priced at a prior of 2.0 a verify, the unreached request needs half its tokens in steps.
    assert shadowed.spec_steps_each(2.0)[0] == 252 / 2.0
    assert plain.spec_steps_each(2.0)[0] == 252 / 1.5
    sched = SimpleNamespace(running=[unreached], stop_checker=None, shadow=object())
    assert Scheduler._finish_estimate(sched).verifies == (0,)
