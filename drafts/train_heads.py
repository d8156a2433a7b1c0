"""Training an EAGLE / EAGLE3 / NEXTN head on the target's features, with training-time test.

Position p of a sequence pairs the target's hidden state at p with token p + 1 and predicts the
target's greedy token after p + 1 (its label at p + 1). Step 1 of the unrolled chain reads the
target's hidden states; step k > 1 at position p reads the head's own output at p - 1 from step
k - 1 and attends as the draft KV cache lets it at inference (`specpcg.attention.dense`), so
steps 2..S learn from the inputs they will really get. Loss: cross-entropy on the target's labels
summed over steps with weights STEP_DECAY ** (k - 1), on the rows whose label lies in an answer
(what the engine drafts). With soft labels (the features carry the target's top-k next tokens)
the cross-entropy is against the target's own distribution over those k tokens, renormalised
within the draft vocabulary, rather than its argmax alone: the same optimum for greedy
acceptance, with the runner-up tokens' odds as extra signal per row. EAGLE adds the EAGLE-1 smooth-L1 pull of
its output toward the target's hidden state at p + 1 (what the next step would ideally read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from drafts.head_checkpoint import random_head, save_head
from drafts.soft_ce import soft_cross_entropy
from drafts.train_data import Features, choose_draft_vocab, length_batches
from drafts.train_loop import LoopOptions, evaluate, fit, heldout_curve
from specpcg.attention.dense import DenseAttnBackend, TTTWindow, dense_batch, dense_forward
from specpcg.core import ForwardBatch
from specpcg.transfer import to_device

STEP_DECAY = 0.8  # weight of step k: STEP_DECAY ** (k - 1)
HIDDEN_LOSS_WEIGHT = {"EAGLE": 1.0}  # EAGLE-1's regression of next_hidden (others: CE only)
# Heads whose output passes a final norm into an LM head start that norm from the target's own
# final norm: the LM head (shared, or EAGLE3's rows copied from it) was fit to that scale.
OUTPUT_NORM = {"EAGLE3": "norm", "NEXTN": "shared_head.norm"}


@dataclass
class HeadRows:
    """One batch's head rows, packed per sequence (p = 0 .. len - 2 of each)."""

    batch: ForwardBatch  # input_ids: token p + 1; positions: p
    hidden: torch.Tensor  # [R, F] the target's features at p
    labels: torch.Tensor  # [R] draft-vocabulary id of the label at p + 1; -1 outside it
    host_pos: torch.Tensor  # [R] positions p, on the host
    host_acc: torch.Tensor  # [R] on the host: the predicted token lies in the answer (drafted)
    target_next: Optional[torch.Tensor]  # [R, H] the target's hidden at p + 1 (EAGLE)
    soft_ids: Optional[torch.Tensor] = None  # [R, k] draft-vocabulary ids (-1 outside it)
    soft_probs: Optional[torch.Tensor] = None  # [R, k] their target probabilities, summing to 1
    window: Optional["WindowRows"] = None  # steps k > 1 on these rows only

    def step_rows(self, k: int, window: Optional["WindowRows"] = None) -> tuple:
        """(rows of step k's output, the same rows among all rows) that step k trains on: valid
        at step k, label in an answer. Device indices built on the host: a boolean mask's
        indexing would wait for the device at every step."""
        pos, acc = (self.host_pos, self.host_acc) if window is None else \
            (window.host_pos, window.host_acc)
        local = ((pos >= k - 1) & acc).nonzero().squeeze(1)
        full = local if window is None else window.host_idx[local]
        device = self.labels.device
        return to_device(local, device), to_device(full, device)


@dataclass
class WindowRows:
    """The rows TTT steps k > 1 run on: each sequence from max(0, prompt_len - steps) on, where
    every row a label of the answer needs is exact (specpcg.attention.dense.TTTWindow). Prompt
    rows before it feed step 1 (and the attention of every step) only."""

    attn: TTTWindow
    host_idx: torch.Tensor  # [W] each window row's index among all rows
    prev: torch.Tensor  # [W] (device) the row before it (p - 1) among all rows; -1 at p = 0
    first: torch.Tensor  # [W] (device) the window's first row of its sequence
    host_pos: torch.Tensor  # [W]
    host_acc: torch.Tensor  # [W]


def window_rows(batch: ForwardBatch, lens: list, prompt_lens: list, steps: int,
                host_pos: torch.Tensor, host_acc: torch.Tensor) -> WindowRows:
    starts = [max(0, p - steps) for p in prompt_lens]
    offsets = torch.tensor([0] + lens[:-1]).cumsum(0).tolist()
    idx = torch.cat([torch.arange(o + s, o + n) for o, s, n in zip(offsets, starts, lens)])
    widths = [n - s for s, n in zip(starts, lens)]
    first = torch.zeros(len(idx), dtype=torch.bool)
    first[torch.tensor([0] + widths[:-1]).cumsum(0)] = True
    pos = host_pos[idx]
    device = batch.input_ids.device
    wbatch = dense_batch(batch.input_ids[to_device(idx, device)], widths)
    wbatch.positions = to_device(pos, device)
    return WindowRows(TTTWindow(wbatch, starts, lens), idx,
                      to_device(torch.where(pos > 0, idx - 1, -1), device),
                      to_device(first, device), pos, host_acc[idx])


def head_rows(feats: Features, seq_ids: list, t2d: torch.Tensor, device,
              with_next: bool, window_steps: Optional[int] = None) -> HeadRows:
    """Every position of each whole sequence (no prefix is assumed shared or skipped); with
    window_steps, the window of rows TTT steps k > 1 need for that many steps."""
    store = feats.labels.device
    lens = [feats.seq_len(i) - 1 for i in seq_ids]
    at = to_device(torch.cat([torch.arange(feats.offsets[i], feats.offsets[i] + n)
                              for i, n in zip(seq_ids, lens)]), store)  # each row's feature row
    pos = torch.cat([torch.arange(n) for n in lens])  # in the sequence
    prompt_lens = torch.tensor([feats.prompt_lens[i] for i in seq_ids]).repeat_interleave(
        torch.tensor(lens))
    batch = dense_batch(to_device(feats.token_ids[at + 1], device), lens)
    acc = pos + 2 >= prompt_lens
    window = None if window_steps is None else window_rows(
        batch, lens, [feats.prompt_lens[i] for i in seq_ids], window_steps, pos, acc)
    return HeadRows(
        batch=batch, hidden=to_device(feats.hidden[at], device),
        labels=t2d[to_device(feats.labels[at + 1], device)], host_pos=pos, host_acc=acc,
        target_next=to_device(feats.hidden[at + 1], device) if with_next else None,
        window=window, **_soft_labels(feats, at + 1, t2d, device))


def _soft_labels(feats: Features, at: torch.Tensor, t2d: torch.Tensor, device) -> dict:
    """The target's top-k distribution at feature rows `at`, kept to the draft vocabulary and
    renormalised there (a row with none of its k tokens inside has no valid label anyway)."""
    if feats.soft_ids is None:
        return {}
    ids = t2d[to_device(feats.soft_ids[at], device)]
    logp = to_device(feats.soft_logp[at], device).float().masked_fill(ids < 0, float("-inf"))
    probs = torch.softmax(logp, dim=-1).nan_to_num(0.0)
    return {"soft_ids": ids, "soft_probs": probs}


def draft_vocab(head) -> torch.Tensor:
    """The target id of each row of the head's LM head (EAGLE and EAGLE3 may keep a smaller
    vocabulary)."""
    ids = head.draft_to_target
    return ids if ids is not None else torch.arange(head.head_weight.shape[0],
                                                    device=head.head_weight.device)


def unrolled_steps(head, backend: DenseAttnBackend, rows: HeadRows, num_steps: int):
    """Yields (k, window, head_hidden, next_hidden) for steps k = 1..num_steps: over all rows
    (window None), or, for k > 1 with rows.window, over the window's rows (that WindowRows).
    Rows at p < k - 1 have no step-k counterpart at inference (HeadRows.step_rows skips them)."""
    win, batch = rows.window, rows.batch
    first = batch.positions == 0
    x = head.project_target_hidden(rows.hidden)
    with backend.unrolled(win.attn if win is not None else None):
        for k in range(1, num_steps + 1):
            out, (nxt,) = dense_forward(head, backend, batch, (), input_hidden=x)
            yield k, win if batch is not rows.batch else None, out, nxt
            # Step k + 1 at p reads this step's output at p - 1 of the same sequence.
            if k == 1 and win is not None:
                batch, first = win.attn.batch, win.first
                x = nxt[win.prev.clamp(min=0)].masked_fill((win.prev < 0)[:, None], 0.0)
            else:
                x = torch.cat([nxt[:1], nxt[:-1]]).masked_fill(first[:, None], 0.0)


def _logits(head, hidden: torch.Tensor) -> torch.Tensor:
    # The target's (frozen) LM head may be bf16 while the head trains in fp32.
    return F.linear(hidden, head.head_weight.to(hidden.dtype)).float()  # [R, draft vocab]


def head_loss(head, backend, rows: HeadRows, num_steps: int, hidden_weight: float):
    total = 0.0
    for k, win, out, nxt in unrolled_steps(head, backend, rows, num_steps):
        # Only rows whose predicted token lies in an answer count: those are what the engine
        # drafts. Prompt rows (often human text the target would not have written) still feed
        # the head's attention context, but their labels would spend most of the gradient on
        # text never drafted (prompts hold about 60% of the tokens of chat data).
        m, at = rows.step_rows(k, win)
        labels = rows.labels[at]
        # Its gradient taken with the loss, in row chunks (drafts.soft_ce): each step's
        # [rows, vocab] logits would otherwise stay alive until the chain's backward (7 steps x
        # a 49k vocabulary ran a side-by-side H100 out of memory).
        soft = (rows.soft_ids[at], rows.soft_probs[at]) if rows.soft_ids is not None else ()
        ce = soft_cross_entropy(out[m], head.head_weight, labels, *soft)
        step_loss = ce / (labels >= 0).sum().clamp(min=1)
        if hidden_weight:
            diff = F.smooth_l1_loss(nxt[m].float(), rows.target_next[at].float(),
                                    reduction="none")
            step_loss = step_loss + hidden_weight * diff.mean(-1).sum() / max(m.numel(), 1)
        total = total + STEP_DECAY ** (k - 1) * step_loss
    return total


def head_accuracy(head, backend, rows: HeadRows, num_steps: int):
    """(correct [S], counted [S]) on answer rows; a label outside the draft vocabulary is a miss."""
    correct, counted = [], []
    for k, win, out, _ in unrolled_steps(head, backend, rows, num_steps):
        m, at = rows.step_rows(k, win)
        correct.append((_logits(head, out[m]).argmax(-1) == rows.labels[at]).sum())
        counted.append(torch.tensor(m.numel(), device=out.device))
    return torch.stack(correct), torch.stack(counted)


def vocab_coverage(feats: Features, seq_ids: list, t2d: torch.Tensor) -> float:
    """The share of answer labels (what the engine drafts) in `seq_ids` that the draft vocabulary
    holds: a ceiling on every step's top-1. (The vocabulary is chosen from every sequence's
    labels, held-out ones included, so on held-out data this reads slightly high.)"""
    inside = counted = 0
    for i in seq_ids:
        start, end = feats.offsets[i] + feats.prompt_lens[i] - 1, feats.offsets[i + 1]
        labels = t2d[feats.labels[start:end].to(t2d.device)]
        inside, counted = inside + int((labels >= 0).sum()), counted + labels.numel()
    return inside / max(counted, 1)


def new_head(algorithm: str, target, target_cfg, feats: Features, draft_vocab_size: int,
             device, seed: int, aux_layer_ids: tuple = (), intermediate_size=None):
    """random_head, attached to the target; a head with its own LM head over a draft vocabulary
    (EAGLE3; EAGLE when draft_vocab_size > 0) keeps the most used target ids as that vocabulary
    and starts its LM head from the target's rows for them."""
    size = min(draft_vocab_size, target_cfg.vocab_size)
    head, spec = random_head(algorithm, target_cfg, device, torch.float32, seed=seed,
                             draft_vocab_size=size, aux_layer_ids=aux_layer_ids,
                             intermediate_size=intermediate_size)
    head.attach_target(target)
    if head.draft_to_target is not None:
        ids = choose_draft_vocab(feats, head.head_weight.shape[0], target_cfg.vocab_size)
        head.set_d2t((ids - torch.arange(ids.shape[0])).to(device))
    with torch.no_grad():
        if spec.has_head:
            head.head_weight.copy_(target.head_weight[draft_vocab(head)])
        if algorithm in OUTPUT_NORM:
            head.get_submodule(OUTPUT_NORM[algorithm]).weight.copy_(target.model.norm.weight)
    return head, spec


def train_head(algorithm: str, target, target_cfg, feats: Features, split: dict,
               opts: LoopOptions, ttt_steps: int, draft_vocab_size: int, device,
               out_dir: str, aux_layer_ids: tuple = (), attention_dtype="auto",
               intermediate_size=None, ttt: str = "mask", ttt_window: bool = True) -> dict:
    """Trains a head on `split["train"]` sequences, measures `split["heldout"]`, saves it (bf16,
    the published layout) into out_dir; returns the loop's record plus accuracies.
    attention_dtype: what the dense attention computes in ("auto": bf16 on CUDA, else fp32);
    intermediate_size: the head's MLP width (None: the target's); ttt: how the dense backend
    computes steps after the first (`specpcg.attention.dense`); ttt_window: steps after the
    first run only on the rows an answer's labels need (WindowRows; the same loss)."""
    head, spec = new_head(algorithm, target, target_cfg, feats, draft_vocab_size, device,
                          opts.seed, aux_layer_ids, intermediate_size)
    t2d = torch.full((target_cfg.vocab_size,), -1, dtype=torch.long, device=device)
    ids = draft_vocab(head)
    t2d[ids] = torch.arange(ids.shape[0], device=device)
    weight = HIDDEN_LOSS_WEIGHT.get(algorithm, 0.0)
    lc = spec.layer_cfg
    if attention_dtype == "auto":
        attention_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
    backend = DenseAttnBackend(lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.head_dim ** -0.5,
                               attention_dtype, ttt)
    lens = [feats.seq_len(i) - 1 for i in range(feats.num_seqs)]
    window = ttt_steps if ttt == "mask" and ttt_window else None
    rows = lambda seq_ids: head_rows(feats, seq_ids, t2d, device, weight > 0,  # noqa: E731
                                     window)
    train_batches = length_batches(lens, split["train"], opts.token_budget)
    eval_batches = length_batches(lens, split["heldout"], opts.token_budget)
    accuracy = lambda b: head_accuracy(head, backend, rows(b), ttt_steps)  # noqa: E731
    initial = evaluate(head, eval_batches, accuracy)
    record = fit(head, [p for p in head.parameters() if p.requires_grad], train_batches,
                 lambda b: head_loss(head, backend, rows(b), ttt_steps, weight), opts,
                 probe=lambda: evaluate(head, eval_batches, accuracy))
    record.update(initial_heldout_top1=initial, heldout_top1_curve=heldout_curve(record),
                  heldout_top1=evaluate(head, eval_batches, accuracy),
                  draft_vocab_size=int(ids.shape[0]),
                  heldout_vocab_coverage=vocab_coverage(feats, split["heldout"], t2d))
    save_head(head.to(torch.bfloat16), spec, target_cfg, out_dir)
    return record
