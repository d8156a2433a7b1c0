"""StopChecker.append: a whole accepted run at once ends a request exactly where appending its
tokens one by one (every check after each) would."""

import random

import pytest

from specpcg.core import Request, SamplingParams
from specpcg.stopping import StopChecker

EOS = 0


class CharTokenizer:
    """Token t decodes to chr(ord('a') + t % 26); counts its decodes."""

    def __init__(self):
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=False):
        self.decodes += 1
        return "".join(chr(ord("a") + t % 26) for t in ids)


def _one_by_one(checker, req, tokens):
    for token in tokens:
        if req.params.max_new_tokens > 0:
            req.output_ids.append(token)
        checker.check(req)
        if req.finished:
            return


def _request(params: dict) -> Request:
    return Request(prompt_ids=[5, 6, 7], params=SamplingParams.from_dict(params))


def _both(checker, params: dict, runs: list) -> tuple:
    """(a request fed the runs token by token, one fed them as runs), each until it ends."""
    want, got = _request(params), _request(params)
    for run in runs:
        if not want.finished:
            _one_by_one(checker, want, run)
        if not got.finished:
            checker.append(got, run)
    return want, got


@pytest.mark.parametrize("seed", range(40))
def test_a_run_ends_where_token_by_token_checks_end_it(seed):
    rng = random.Random(seed)
    params = {"max_new_tokens": rng.randint(0, 12), "stop": rng.choice([(), ("cd",), ("xyz", "b")]),
              "stop_token_ids": rng.choice([(), (3,)]), "ignore_eos": rng.random() < 0.3}
    runs = [[rng.choice([EOS, 1, 2, 3, 4, 23, 24, 25]) for _ in range(rng.randint(1, 5))]
            for _ in range(4)]
    want, got = _both(StopChecker(CharTokenizer(), (EOS,), context_len=20), params, runs)
    assert (got.output_ids, got.finish_reason, got.matched_stop) == (
        want.output_ids, want.finish_reason, want.matched_stop)


@pytest.mark.parametrize("seed", range(200))
def test_a_long_run_at_the_context_ends_where_token_by_token_checks_end_it(seed):
    """Runs as long as a speculative step's (up to 9 tokens), a context that may end them first,
    and no stop strings: the runs' leading tokens are appended at once (`_clear_run`)."""
    rng = random.Random(seed)
    params = {"max_new_tokens": rng.randint(1, 30), "stop_token_ids": rng.choice([(), (3,)]),
              "ignore_eos": rng.random() < 0.5}
    runs = [[rng.choice([EOS, 1, 2, 3, 4, 5, 6, 7, 8]) for _ in range(rng.randint(1, 9))]
            for _ in range(6)]
    want, got = _both(StopChecker(None, (EOS,), context_len=rng.randint(4, 30)), params, runs)
    assert (got.output_ids, got.finish_reason) == (want.output_ids, want.finish_reason)


def test_a_run_without_a_stop_string_decodes_once():
    tok = CharTokenizer()
    checker = StopChecker(tok, (EOS,), context_len=100)
    req = _request({"max_new_tokens": 50, "stop": ("zz",)})
    checker.append(req, [1, 2, 3, 4, 5])
    assert tok.decodes == 1 and not req.finished and req.output_ids == [1, 2, 3, 4, 5]
    checker.append(req, [2, 25, 25, 4])  # "czzd": ends at the second z
    assert req.output_ids == [1, 2, 3, 4, 5, 2, 25, 25] and req.matched_stop == "zz"
    assert req.finish_reason == {"type": "stop", "matched": "zz"}
