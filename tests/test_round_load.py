"""A draft round's inputs loaded from device tensors (overlap scheduling) equal those the host
packs for the same requests, with and without padding rows past them."""

from types import SimpleNamespace

import pytest
import torch

from specpcg.graphs.draft_runner import DraftGraphRunner, RoundRow
from specpcg.speculative.overlap import DevicePath

WIDTH, STEPS, HIDDEN, PAD_ROW = 4, 3, 8, 9


def _runner(max_bs: int) -> DraftGraphRunner:
    req_to_token = torch.arange(10 * 64, dtype=torch.int32).view(10, 64) * 7 + 3  # distinct
    model = SimpleNamespace(hidden_in_size=HIDDEN,
                            head_weight=torch.zeros(1, dtype=torch.float32))
    kv = SimpleNamespace(req_pool=SimpleNamespace(req_to_token=req_to_token, pad_row=PAD_ROW))
    mr = SimpleNamespace(model=model, device=torch.device("cpu"), kv_cache=kv)
    return DraftGraphRunner(mr, [max_bs], STEPS + 1, 2 * HIDDEN, width=WIDTH,
                            eager_reason="test")


@pytest.mark.parametrize("n,bs", [(3, 3), (2, 4)])
def test_device_load_fills_what_the_host_packs(n, bs):
    gen = torch.Generator().manual_seed(n * 10 + bs)
    rows = torch.tensor([5, 1, 7][:n])
    first_pos = torch.tensor([10, 3, 20][:n])
    lens = torch.tensor([2, 4, 1][:n])
    ids = torch.randint(1, 1000, (n, WIDTH), generator=gen)
    roots = torch.randint(1, 1000, (n,), generator=gen)
    hidden = torch.randn(n, WIDTH, 2 * HIDDEN, generator=gen)

    host = _runner(bs)
    r2t = host.model_runner.kv_cache.req_pool.req_to_token
    reqs, chain = [], []
    for i in range(n):
        k, p, row = int(lens[i]), int(first_pos[i]), int(rows[i])
        reqs.append(RoundRow(ids[i, :k].tolist(), p, r2t[row, p:p + k].tolist(), row, i,
                             int(roots[i])))
        chain.append(r2t[row, p + k:p + k + STEPS].tolist())
    host.load(bs, reqs, chain, hidden)

    device = _runner(bs)
    device.load_on_device(bs, rows, DevicePath(first_pos, lens, roots, ids, hidden))
    assert torch.equal(device.buf.ints, host.buf.ints)
    n_rows = n * WIDTH
    assert torch.equal(device.buf.target_hidden[:n_rows], host.buf.target_hidden[:n_rows])
