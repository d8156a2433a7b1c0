"""A round's integer inputs from device tensors: the Triton kernel against its torch twin (the
interpreter on CPU), for chains (step slots after the path) and trees (no chain steps)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.round_load import SEGMENTS, load_round, round_inputs  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("n,w,steps", [(3, 8, 6), (2, 12, 0), (1, 4, 1), (5, 33, 2)])
def test_triton_matches_the_twin(n, w, steps):
    gen = torch.Generator().manual_seed(n * 100 + w)
    r2t = torch.randperm(8 * 128, generator=gen).view(8, 128).int()
    rows = torch.randperm(8, generator=gen)[:n]
    first_pos = torch.randint(0, 60, (n,), generator=gen)
    lens = torch.randint(1, w + 1, (n,), generator=gen)
    roots = torch.randint(0, 1000, (n,), generator=gen)
    ids = torch.randint(1, 1000, (n, w), generator=gen)
    size = n * (3 * w + len(SEGMENTS) + steps)
    got, want = torch.full((size,), -5), torch.full((size,), -5)
    load_round(rows, first_pos, lens, roots, ids, r2t, steps, 0, got, use_triton=True)
    load_round(rows, first_pos, lens, roots, ids, r2t, steps, 0, want, use_triton=False)
    assert torch.equal(got, want)
    values = round_inputs(rows, first_pos, lens, roots, ids, r2t, steps, 0)
    slots = got[2 * n * w:3 * n * w].view(n, w)
    for i in range(n):  # the path's slots, the sink after it; the chain's after the path
        k, p = int(lens[i]), int(first_pos[i])
        assert slots[i, :k].tolist() == r2t[rows[i], p:p + k].tolist()
        assert (slots[i, k:] == 0).all()
        if steps:
            assert values["chain"][:, i].tolist() == r2t[rows[i], p + k:p + k + steps].tolist()
    with pytest.raises(ValueError, match="out must hold"):
        load_round(rows, first_pos, lens, roots, ids, r2t, steps, 0, got[:-1])


@pytest.mark.cuda
def test_one_compiled_variant_serves_every_batch_size():
    """The kernel loads an overlapped step's round outside any graph, at each batch size the
    running batch passes through: a variant compiled per size class (Triton specializes
    integers on == 1 and on divisibility by 16) stalled a serving step for the compile."""
    from triton import knobs

    keys = []

    def seen(**kw):
        if getattr(kw.get("fn"), "name", "") == "_load_round_kernel":
            keys.append(str(kw.get("key")))
        return False  # compile (or load) as usual

    before, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, seen
    try:
        gen = torch.Generator().manual_seed(0)
        r2t = torch.randperm(64 * 256, generator=gen).view(64, 256).int().cuda()
        for n in (1, 2, 3, 4, 16, 17, 32, 64):
            w, steps = 8, 3
            rows = torch.randperm(64, generator=gen)[:n].cuda()
            first_pos = torch.randint(0, 200, (n,), generator=gen).cuda()
            lens = torch.randint(1, w + 1, (n,), generator=gen).cuda()
            roots = torch.randint(0, 1000, (n,), generator=gen).cuda()
            ids = torch.randint(1, 1000, (n, w), generator=gen).cuda()
            size = n * (3 * w + len(SEGMENTS) + steps)
            got, want = torch.full((size,), -5).cuda(), torch.full((size,), -5).cuda()
            load_round(rows, first_pos, lens, roots, ids, r2t, steps, 0, got, use_triton=True)
            load_round(rows, first_pos, lens, roots, ids, r2t, steps, 0, want, use_triton=False)
            assert torch.equal(got, want), n
    finally:
        knobs.runtime.jit_cache_hook = before
    assert len(set(keys)) == 1, keys
