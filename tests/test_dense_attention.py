"""The draft trainer's dense attention (no KV cache, autograd through it) on CPU: against the
paged torch backend, the TTT key sets against explicit key lists, "diag" against "mask", bf16
and half inputs, and the model's forward with autograd on."""

from collections import namedtuple

import pytest
import torch

from drafts.train_loop import autograd_ops
from specpcg.attention.dense import DenseAttnBackend, dense_batch, dense_forward, ttt_mask
from specpcg.attention.torch_backend import TorchAttnBackend
from specpcg.core import ForwardMode
from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool
from specpcg.models.build import build_model
from specpcg.models.config import ModelConfig
from specpcg.batch import make_batch

H, HKV, D = 4, 2, 8  # attention heads, kv heads, head dim
CPU = torch.device("cpu")
Row = namedtuple("Row", "req_pool_idx num_cached")


def test_dense_backend_matches_the_paged_torch_backend():
    lens = [5, 1, 9]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), n * D, generator=gen) for n in (H, HKV, HKV))
    kv_cache = KVCache(KVPool(64, 1, HKV, D, torch.float32, "cpu"), ReqToTokenPool(4, 32, "cpu"))
    rows = [Row(kv_cache.new_request(), 0) for _ in lens]
    kv_cache.extend_many([r.req_pool_idx for r in rows], lens)
    new_ids = [[1] * n for n in lens]
    paged = TorchAttnBackend(kv_cache, H, HKV, D, D ** -0.5)
    want = paged.forward(q, k, v, 0, make_batch(kv_cache, ForwardMode.EXTEND, rows, new_ids, CPU))
    dense = DenseAttnBackend(H, HKV, D, D ** -0.5)
    batch = dense_batch(torch.ones(sum(lens), dtype=torch.long), lens)
    dense.init_forward_metadata(batch)
    q.requires_grad_(True)
    got = dense.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()  # autograd runs through it
    assert q.grad is not None and q.grad.abs().sum() > 0


def _reference_step(qs, ks, vs, lens, step):
    """Step `step`'s attention by explicit key lists (module docstring of attention.dense)."""
    out, start, group = [], 0, H // HKV
    for n in lens:
        for p in range(n):
            keys = [(0, j) for j in range(max(p - step + 2, 0))]  # step-1 keys j <= p - k + 1
            keys += [(i - 1, p - (step - i)) for i in range(2, step + 1) if p - (step - i) >= 0]
            k = torch.stack([ks[s][start + j].view(HKV, D) for s, j in keys])  # [K, Hkv, D]
            v = torch.stack([vs[s][start + j].view(HKV, D) for s, j in keys])
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            q = qs[step - 1][start + p].view(H, D)
            w = torch.softmax(torch.einsum("hd,khd->hk", q, k) * D ** -0.5, dim=-1)
            out.append(torch.einsum("hk,khd->hd", w, v).reshape(-1))
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("ttt", ["diag", "mask"])
def test_ttt_steps_see_the_draft_cache_keys(ttt):
    assert ttt_mask(4, 2, CPU).int().tolist() == [
        [0, 0, 0, 0, 1, 0, 0, 0],  # p=0: no step-1 key (p - 1 < 0), its own step-2 key
        [1, 0, 0, 0, 0, 1, 0, 0],  # p=1: step-1 key 0, own key 1
        [1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1]]
    lens, steps = [6, 3, 7], 4
    gen = torch.Generator().manual_seed(1)
    qs, ks, vs = ([torch.randn(sum(lens), n * D, generator=gen) for _ in range(steps)]
                  for n in (H, HKV, HKV))
    dense = DenseAttnBackend(H, HKV, D, D ** -0.5, ttt=ttt)
    batch = dense_batch(torch.ones(sum(lens), dtype=torch.long), lens)
    dense.init_forward_metadata(batch)
    with dense.unrolled():
        for step in range(1, steps + 1):
            got = dense.forward(qs[step - 1], ks[step - 1], vs[step - 1], 0, batch)
            torch.testing.assert_close(got, _reference_step(qs, ks, vs, lens, step),
                                       atol=1e-5, rtol=1e-5)


def test_ttt_diag_and_mask_give_the_same_gradients():
    lens, steps = [5, 9, 2], 5
    gen = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(sum(lens), n * D, generator=gen) for _ in range(steps)]
              for n in (H, HKV, HKV)]
    batch = dense_batch(torch.ones(sum(lens), dtype=torch.long), lens)
    grads = []
    for ttt in ("diag", "mask"):
        leaves = [[t.clone().requires_grad_(True) for t in ts] for ts in inputs]
        dense = DenseAttnBackend(H, HKV, D, D ** -0.5, ttt=ttt)
        dense.init_forward_metadata(batch)
        with dense.unrolled():
            total = sum((dense.forward(q, k, v, 0, batch) * (i + 1)).square().sum()
                        for i, (q, k, v) in enumerate(zip(*leaves)))
        total.backward()
        grads.append([t.grad for ts in leaves for t in ts])
    for got, want in zip(*grads):  # gradients reach 1e2: fp32 sums in two orders
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="ttt"):
        DenseAttnBackend(H, HKV, D, D ** -0.5, ttt="flex")


def test_autograd_attention_matches_the_model_forward():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=H, num_kv_heads=HKV, head_dim=D, max_position_embeddings=64)
    model = build_model(cfg, None, CPU, torch.float32, seed=3)
    for p in model.parameters():  # random_init_ gives unit norms: perturb them too
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
    backend = DenseAttnBackend(H, HKV, D, D ** -0.5)
    batch = dense_batch(torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(5)),
                        [4, 7])
    with torch.no_grad():
        want, _ = dense_forward(model, backend, batch)
    model.requires_grad_(True)
    with autograd_ops(model):
        got, _ = dense_forward(model, backend, batch)
        got.square().sum().backward()
    torch.testing.assert_close(got.detach(), want)
    assert all(p.grad is not None for p in model.model.parameters())  # the LM head is unused
    assert "forward" not in vars(model.model.layers[0].self_attn)  # patch undone


@pytest.mark.parametrize("steps", [1, 3])
def test_dense_attention_in_bf16_stays_close_and_keeps_the_callers_dtype(steps):
    lens = [5, 8, 2]
    gen = torch.Generator().manual_seed(2)
    qs, ks, vs = ([torch.randn(sum(lens), n * D, generator=gen) for _ in range(steps)]
                  for n in (H, HKV, HKV))
    batch = dense_batch(torch.ones(sum(lens), dtype=torch.long), lens)
    outs = []
    for dtype in (None, torch.bfloat16):
        dense = DenseAttnBackend(H, HKV, D, D ** -0.5, compute_dtype=dtype)
        dense.init_forward_metadata(batch)
        with dense.unrolled():
            outs.append([dense.forward(qs[i], ks[i], vs[i], 0, batch) for i in range(steps)])
    for want, got in zip(*outs):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_dense_attention_on_half_inputs_groups_kv_heads_like_the_fp32_path():
    lens = [4, 7]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), n * D, generator=gen) for n in (H, HKV, HKV))
    batch = dense_batch(torch.ones(sum(lens), dtype=torch.long), lens)
    dense = DenseAttnBackend(H, HKV, D, D ** -0.5)
    dense.init_forward_metadata(batch)
    want = dense.forward(q, k, v, 0, batch)
    got = dense.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0, batch)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
