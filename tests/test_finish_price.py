"""The finish estimate's price of a step at a batch size whose bucket never measured that side:
the nearest bucket above it that did (a step of more requests costs no less), brought down
toward the nearest one below that did, linearly in the buckets' log."""

import pytest

from specpcg.speculative.bucket import Bucket, measured_step_s
from specpcg.speculative.finish import finish_seconds


def _bucket(spec_s=None, plain_s=None) -> Bucket:
    b = Bucket()
    for _ in range(4):
        if spec_s:
            b.spec.add(2.0, spec_s)
        if plain_s:
            b.decode.add(1.0, plain_s)
    return b


def _buckets() -> dict:
    # A batch of 64 that ran plain but for a warm-up at 64 and a look at 8: its small buckets
    # measured plain steps only, as NGRAM's straggler tail does.
    return {64: _bucket(1.7e-3, 1.3e-3), 32: _bucket(None, 1.0e-3), 8: _bucket(0.9e-3, 0.7e-3),
            4: _bucket(None, 0.6e-3), 1: _bucket(None, 0.5e-3)}


def test_an_unmeasured_side_takes_the_nearest_measure_above_its_bucket():
    buckets = _buckets()
    current = buckets[64]
    assert measured_step_s(buckets, True, 8, current) == pytest.approx(0.9e-3)  # its own
    assert measured_step_s(buckets, True, 3, current) == pytest.approx(0.9e-3)  # 4 -> 8
    assert measured_step_s(buckets, True, 1, current) == pytest.approx(0.9e-3)  # 1, 2, 4 -> 8
    assert measured_step_s(buckets, False, 20, current) == pytest.approx(1.0e-3)  # its own


def test_between_two_measures_the_price_is_on_the_line_through_them_in_log_batch():
    buckets = _buckets()
    current = buckets[64]
    # Speculative steps measured at 8 and 64: 32 is two doublings of three from 8.
    assert measured_step_s(buckets, True, 20, current) == pytest.approx(0.9e-3 + 0.8e-3 * 2 / 3)
    assert measured_step_s(buckets, True, 9, current) == pytest.approx(0.9e-3 + 0.8e-3 / 3)
    assert measured_step_s(buckets, False, 2, current) == pytest.approx(0.55e-3)  # 1 and 4
    # Measured at 1 and 64 only, as a batch of 64 after batches of one: the tail's buckets
    # cost less than the full batch's and more than one request's, rising with the batch.
    ends = {64: _bucket(1.69e-3, 1.39e-3), 1: _bucket(0.59e-3, 0.48e-3)}
    prices = [measured_step_s(ends, True, n, ends[64]) for n in (2, 4, 8, 16, 32)]
    assert all(0.59e-3 < p < 1.69e-3 for p in prices)
    assert prices == sorted(prices)


def test_with_no_measure_at_or_above_the_current_buckets_price_stands():
    current = _bucket(1.7e-3, 1.3e-3)
    assert measured_step_s({4: _bucket(None, 0.6e-3)}, True, 2, current) == pytest.approx(1.7e-3)
    assert measured_step_s({}, False, 2, current) == pytest.approx(1.3e-3)


def test_a_stragglers_tail_is_priced_at_small_batches_not_the_full_ones():
    # Three requests need 10 speculative steps, one needs 40: its last 30 run alone.
    buckets = _buckets()
    price = lambda size: measured_step_s(buckets, True, size, buckets[64])  # noqa: E731
    assert finish_seconds([10, 10, 10, 40], price) == pytest.approx(40 * 0.9e-3)
    # Priced at the current bucket's steps (the rule before), the same tail cost 68 ms.
    assert finish_seconds([10, 10, 10, 40], lambda size: 1.7e-3) == pytest.approx(68e-3)
