"""make_batch: one packed copy. A batch of more tokens than requests starts every part 16 bytes
in (Triton specializes pointer arguments on that alignment, so a part at an odd offset compiled
a second variant of each kernel reading it in the middle of serving); a decode-shaped batch
keeps its rows back to back, one [4, bs] view the graph runner loads with one copy."""

from types import SimpleNamespace

import pytest
import torch

from specpcg.batch import make_batch
from specpcg.core import ForwardMode


class _Slots:
    def slots_of(self, row: int) -> list:
        return [1000 * row + i for i in range(64)]


def _reqs(cached: list) -> list:
    return [SimpleNamespace(req_pool_idx=i + 1, num_cached=n) for i, n in enumerate(cached)]


@pytest.mark.parametrize("lens", [[3], [2, 3], [5, 1, 7], [4, 4], [1, 2], [2, 1, 2], [1]])
def test_every_part_is_aligned_and_holds_its_values(lens):
    reqs = _reqs([10 * (i + 1) for i in range(len(lens))])
    ids = [[100 + i] * n for i, n in enumerate(lens)]
    batch = make_batch(_Slots(), ForwardMode.EXTEND, reqs, ids, "cpu")
    parts = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
             batch.seq_lens, batch.extend_seq_lens)
    assert sum(lens) == len(lens) or all(p.data_ptr() % 16 == 0 for p in parts)
    assert batch.input_ids.tolist() == sum(ids, [])
    starts = [r.num_cached for r in reqs]
    assert batch.positions.tolist() == [s + j for s, n in zip(starts, lens) for j in range(n)]
    assert batch.out_cache_loc.tolist() == [1000 * r.req_pool_idx + p for r, n in zip(reqs, lens)
                                            for p in range(r.num_cached, r.num_cached + n)]
    assert batch.req_pool_indices.tolist() == [r.req_pool_idx for r in reqs]
    assert batch.seq_lens.tolist() == [s + n for s, n in zip(starts, lens)]
    assert batch.extend_seq_lens.tolist() == lens
    assert (batch.index_rows is None) == (sum(lens) != len(lens))  # one token each: a decode's


@pytest.mark.parametrize("bs", [1, 2, 3, 8])
def test_a_decode_keeps_its_rows_in_one_view(bs):
    reqs = _reqs(list(range(5, 5 + bs)))
    batch = make_batch(_Slots(), ForwardMode.DECODE, reqs, [[7 + i] for i in range(bs)], "cpu")
    rows = batch.index_rows
    assert rows.shape == (5, bs)
    for row, part in zip(rows, (batch.input_ids, batch.positions, batch.out_cache_loc,
                                batch.req_pool_indices, batch.seq_lens)):
        assert row.data_ptr() == part.data_ptr() and torch.equal(row, part)
        assert part.data_ptr() % 16 == 0 or bs % 2  # odd: back to back, not padded


@pytest.mark.parametrize("lens", [[3], [5, 1, 7], [1, 1], [94, 94, 94, 94]])
def test_a_batch_that_leaves_its_rows_to_the_forward_matches_one_written_on_the_host(lens):
    """alloc_batch (a draft's catch-up) allocates without writing req_to_token; the forward's
    write_rows then leaves the same rows, and the same batch, as extend_many's host write."""
    from specpcg.batch import alloc_batch
    from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool

    def cache():
        kv = KVCache(KVPool(2048, 1, 1, 4, torch.float32, "cpu"), ReqToTokenPool(8, 512, "cpu"))
        idx = [kv.new_request() for _ in lens]
        kv.extend_many(idx, [10 + i for i in range(len(lens))])  # prompts already held
        return kv, [SimpleNamespace(req_pool_idx=r, num_cached=10 + i) for i, r in enumerate(idx)]

    ids = [[100 + i + j for j in range(n)] for i, n in enumerate(lens)]
    host, reqs = cache()
    host.extend_many([r.req_pool_idx for r in reqs], lens)
    written = make_batch(host, ForwardMode.DRAFT_EXTEND, reqs, ids, "cpu")
    left, reqs = cache()
    before = left.req_pool.req_to_token.clone()
    batch = alloc_batch(left, ForwardMode.DRAFT_EXTEND, reqs, ids, "cpu")
    assert batch.rows_pending and torch.equal(left.req_pool.req_to_token, before)
    left.write_rows(batch)
    assert not batch.rows_pending
    assert torch.equal(left.req_pool.req_to_token, host.req_pool.req_to_token)
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                 "extend_seq_lens"):
        assert torch.equal(getattr(batch, name), getattr(written, name)), name


def test_the_batch_probe_times_this_tree_beside_another():
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import probe_make_batch

    lines = probe_make_batch.main(["--cells", "2x3", "3x1", "--tree", f"same={root}",
                                   "--repeats", "3", "--rounds", "1"])
    assert [(x["batch"], x["tokens_per_request"]) for x in lines] == [(2, 3), (3, 1)]
    assert all(x["us_this"] > 0 and x["us_same"] > 0 for x in lines)
