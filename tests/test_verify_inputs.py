"""kernels/verify_inputs.py: the Triton kernel (interpreter) against its torch twin."""

import pytest
import torch

from kernels.verify_inputs import verify_inputs, verify_inputs_torch


def _state(bs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, 10_000, (6, 64), generator=g, dtype=torch.int32)
    first_pos = torch.randint(0, 40, (bs,), generator=g)
    lens = torch.randint(1, 9, (bs,), generator=g)
    live = torch.arange(bs) < bs - 1  # the last row pads the bucket
    rows = torch.randint(0, 6, (bs,), generator=g)
    return first_pos, lens, live, rows, req_to_token


@pytest.mark.parametrize("bs,n", [(1, 8), (3, 4), (5, 1), (4, 5)])
def test_the_kernel_writes_the_twins_starts_positions_slots_and_key_counts(bs, n):
    state = _state(bs, seed=bs * 10 + n)
    got = verify_inputs(*state, n, use_triton=True)
    want = verify_inputs_torch(*state, n)
    for g, w in zip(got, want):
        assert g.dtype == torch.long and torch.equal(g, w)


def test_a_padding_row_starts_at_zero_on_its_rows_first_slots():
    first_pos, lens, live, rows, req_to_token = _state(2)
    got = verify_inputs(first_pos, lens, live, rows, req_to_token, 3, use_triton=True)
    assert got.prefix[1] == 0 and got.seq_lens[1] == 3
    assert got.positions[3:].tolist() == [0, 1, 2]
    assert got.out_cache_loc[3:].tolist() == req_to_token[rows[1], :3].tolist()
    start = int(first_pos[0] + lens[0])
    assert got.out_cache_loc[:3].tolist() == req_to_token[rows[0], start:start + 3].tolist()
