"""The extend (prefill) kernel under every block shape it may be given (through the Triton
interpreter on CPU): causal attention over a cached prefix as plain softmax gives it, with the
key blocks every query sees run unmasked and the diagonal ones masked, and a prompt's bits
unchanged by how it is cut into chunks."""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tensors through Triton need TRITON_INTERPRET=1"),
]

H, HKV, D = 4, 2, 16
# (BLOCK_M, BLOCK_N, num_warps, num_stages): square blocks, and key blocks narrower and wider
# than query blocks (the rows every query of a block sees then end inside a key block).
CONFIGS = [(16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)]
i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


def _pool(total: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(total + 1, HKV, D, generator=gen)
    v_buf = torch.randn(total + 1, HKV, D, generator=gen)
    return k_buf, v_buf, (torch.randperm(total, generator=gen) + 1).to(torch.int32)


def _run(q, k_buf, v_buf, r2t, cases: list, config):
    """extend_attention over requests (row, prefix, extend), their queries packed in order."""
    from specpcg.attention.triton_extend import extend_attention

    out = torch.zeros_like(q)
    extends = [e for _, _, e in cases]
    starts = [sum(extends[:i]) for i in range(len(cases) + 1)]
    extend_attention(q, k_buf, v_buf, out, r2t, i32([r for r, _, _ in cases]),
                     i32([p + e for _, p, e in cases]), i32(extends), i32(starts),
                     max(extends), len(cases), D ** -0.5, config=config)
    return out


def _reference(q, k_buf, v_buf, slots, prefix: int):
    """Causal softmax attention of an extend's queries [E, H, D] over its row's slots."""
    k = k_buf[slots.long()].repeat_interleave(H // HKV, dim=1)
    v = v_buf[slots.long()].repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("ehd,nhd->hen", q, k) * D ** -0.5
    pos = torch.arange(prefix, prefix + q.shape[0])
    scores = scores.masked_fill(torch.arange(len(slots))[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hen,nhd->ehd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("config", CONFIGS)
def test_extend_matches_causal_softmax_under_every_block_shape(config):
    cases = [(0, 0, 70), (1, 21, 30), (2, 40, 1), (3, 5, 52)]  # (row, prefix, extend)
    lengths = [p + e for _, p, e in cases]
    k_buf, v_buf, slots = _pool(sum(lengths))
    r2t = torch.zeros(len(cases), 128, dtype=torch.int32)
    at = 0
    for (row, _, _), n in zip(cases, lengths):
        r2t[row, :n] = slots[at:at + n]
        at += n
    q = torch.randn(sum(e for _, _, e in cases), H, D, generator=torch.Generator().manual_seed(3))
    got = _run(q, k_buf, v_buf, r2t, cases, config)
    row_start = 0
    for row, prefix, extend in cases:
        want = _reference(q[row_start:row_start + extend], k_buf, v_buf,
                          r2t[row, :prefix + extend], prefix)
        torch.testing.assert_close(got[row_start:row_start + extend], want, atol=1e-5, rtol=1e-5)
        row_start += extend


@pytest.mark.parametrize("config", CONFIGS)
def test_a_prompt_cut_into_chunks_keeps_its_bits_under_every_block_shape(config):
    n = 90
    k_buf, v_buf, slots = _pool(n)
    r2t = slots[None, :].clone()
    q = torch.randn(n, H, D, generator=torch.Generator().manual_seed(4))
    whole = _run(q, k_buf, v_buf, r2t, [(0, 0, n)], config)
    chunks = [(0, 13), (13, 40), (53, 37)]
    cut = torch.cat([_run(q[p:p + e], k_buf, v_buf, r2t, [(0, p, e)], config) for p, e in chunks])
    assert torch.equal(cut, whole)
