"""TTT steps after the first run on a window of each sequence (the rows an answer's labels need):
the loss, its gradient and the held-out accuracy must be those of running every row (CPU, fp32).
On CUDA, a training step must never wait for the device."""

import pytest
import torch

from drafts.train_data import Sequences, extract_features
from drafts.train_heads import head_accuracy, head_loss, head_rows, new_head
from drafts.train_loop import autograd_ops, tf32_matmuls
from specpcg.attention.dense import DenseAttnBackend
from specpcg.models.build import build_model
from specpcg.models.config import ModelConfig

CPU = torch.device("cpu")
STEPS = 4


def _world(algorithm: str, device=CPU):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    target = build_model(cfg, None, device, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(0)
    # Prompts shorter than, equal to and longer than the steps; answers of 1 to 9 tokens.
    shapes = [(2, 5), (4, 1), (9, 6), (13, 9), (1, 3), (20, 4)]
    ids = [torch.randint(0, 64, (p + a,), generator=gen).tolist() for p, a in shapes]
    seqs = Sequences(token_ids=ids, prompt_lens=[p for p, _ in shapes])
    aux = (4, 2, 1) if algorithm == "EAGLE3" else ()
    feats = extract_features(target, seqs, aux, True, device, show_progress=False, soft_k=4)
    head, spec = new_head(algorithm, target, cfg, feats, 48, device, seed=1,
                          aux_layer_ids=(0, 1, 3) if algorithm == "EAGLE3" else ())
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=device)
    vocab = getattr(head, "draft_to_target", None)
    vocab = torch.arange(cfg.vocab_size, device=device) if vocab is None else vocab
    t2d[vocab] = torch.arange(vocab.shape[0], device=device)
    lc = spec.layer_cfg
    backend = DenseAttnBackend(lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.head_dim ** -0.5)
    return head, backend, feats, t2d


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_the_window_gives_every_rows_loss_gradient_and_accuracy(algorithm):
    head, backend, feats, t2d = _world(algorithm)
    seq_ids = list(range(feats.num_seqs))
    params = [p for p in head.parameters() if p.requires_grad]
    weight = 1.0 if algorithm == "EAGLE" else 0.0
    results = []
    for window in (None, STEPS):
        rows = head_rows(feats, seq_ids, t2d, CPU, weight > 0, window)
        if window is not None:  # the window leaves prompt rows out of steps after the first
            assert len(rows.window.host_idx) < rows.batch.num_tokens
        with autograd_ops(head):
            loss = head_loss(head, backend, rows, STEPS, weight)
            grads = torch.autograd.grad(loss, params)
            results.append((loss, grads, head_accuracy(head, backend, rows, STEPS)))
    (loss_all, grads_all, acc_all), (loss_win, grads_win, acc_win) = results
    torch.testing.assert_close(loss_win, loss_all)
    for a, b in zip(grads_win, grads_all):
        torch.testing.assert_close(a, b)
    for a, b in zip(acc_win, acc_all):
        assert torch.equal(a, b)


def test_a_window_one_row_too_late_changes_the_loss(monkeypatch):
    """The window starts exactly where the answer's first labels stop depending on rows before
    it: starting one row later must change the loss (so the test above can fail)."""
    import drafts.train_heads as th

    head, backend, feats, t2d = _world("EAGLE3")
    seq_ids = list(range(feats.num_seqs))
    late = th.window_rows
    with torch.no_grad(), autograd_ops(head):
        full = head_loss(head, backend, head_rows(feats, seq_ids, t2d, CPU, False, None), STEPS,
                         0.0)
        monkeypatch.setattr(th, "window_rows", lambda b, lens, prompts, steps, pos, acc: late(
            b, lens, prompts, steps - 1, pos, acc))
        shifted = head_loss(head, backend, head_rows(feats, seq_ids, t2d, CPU, False, STEPS),
                            STEPS, 0.0)
    assert not torch.allclose(shifted, full)


def test_a_window_needs_the_masked_ttt():
    backend = DenseAttnBackend(4, 2, 8, 8 ** -0.5, ttt="diag")
    with pytest.raises(ValueError, match="ttt='mask'"):
        with backend.unrolled(window=object()):
            pass


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_a_training_step_never_waits_for_the_device(algorithm):
    """Batch rows, the unrolled loss, backward, clipping and AdamW, with CUDA's sync check set to
    raise: a step that waited (a pageable copy, a read of a device value) would leave the GPU idle
    while the host builds the next batch. The loop reads its losses in bulk (drafts.train_loop)."""
    device = torch.device("cuda")
    head, backend, feats, t2d = _world(algorithm, device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    weight = 1.0 if algorithm == "EAGLE" else 0.0

    def step():
        rows = head_rows(feats, list(range(feats.num_seqs)), t2d, device, weight > 0, STEPS)
        with autograd_ops(head), tf32_matmuls():
            loss = head_loss(head, backend, rows, STEPS, weight)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    first = step()  # the optimizer's state and the pinned blocks come from the first step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(second) and second != first
