"""Self-distillation data for draft training: the target's own greedy answers (drafts.distill)
and its features and greedy labels over each whole sequence.

Labels are the target's argmax at every position (its greedy next token), so a draft is trained
on exactly what verification accepts; on answer positions they are the generated tokens
themselves (up to bf16 near-ties between the engine and the dense forward).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from specpcg.attention.dense import DenseAttnBackend, dense_batch, dense_forward

LOGITS_CHUNK_ROWS = 8192  # rows per LM-head call when taking the target's argmax
FEATURE_MEMORY_SHARE = 0.5  # most of the free GPU memory the stored features may take


@dataclass
class Sequences:
    token_ids: list  # per sequence: its last prompt + the target's greedy answer to it
    prompt_lens: list
    sources: list = dataclasses.field(default_factory=list)  # per sequence: its source's name
    # Per sequence: its conversation's number, one per distinct opening prompt. A chat's turns
    # (turn 2 holds turn 1 and its answer) and repeated prompts share one, so a held-out split
    # by group never trains on what it measures.
    groups: list = dataclasses.field(default_factory=list)
    turns: list = dataclasses.field(default_factory=list)  # per sequence: 0 for a first turn

    @property
    def num_answer_tokens(self) -> int:
        return sum(len(t) - p for t, p in zip(self.token_ids, self.prompt_lens))


def heldout_split(num_seqs: int, heldout_frac: float, seed: int, groups=None) -> dict:
    """About heldout_frac of the sequences held out, whole groups at a time (a conversation's
    turns and repeated prompts stay on one side); every sequence its own group without
    `groups`. At least one sequence on each side."""
    groups = groups or list(range(num_seqs))
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    keys = list(members)
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(max(round(num_seqs * heldout_frac), 1 if heldout_frac else 0), num_seqs - 1)
    heldout = []
    for j in order:
        if len(heldout) >= k:
            break
        if len(heldout) + len(members[keys[j]]) < num_seqs:
            heldout += members[keys[j]]
    held = set(heldout)
    return {"heldout": sorted(held), "train": [i for i in range(num_seqs) if i not in held]}


def source_labels(seqs) -> list:
    """Per sequence, what the offline figures are reported by: its source, with a chat's later
    turns apart from its first (a later turn reads the target's earlier answer and often repeats
    it, so it accepts more than the first turns the benchmarks send)."""
    sources = seqs.sources or ["ids"] * len(seqs.token_ids)
    turns = seqs.turns or [0] * len(sources)
    return [s if t == 0 else f"{s} turn 2+" for s, t in zip(sources, turns)]


def shared_answers(path: str, make) -> Sequences:
    """The Sequences cached at `path`, or `make()`'s, saved there. Drafts trained side by side
    for one target share one generation: the first takes the lock and generates, the others
    wait and load it (so the GPU generates once, not once per draft)."""
    import fcntl

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.isfile(path):
            return Sequences(**torch.load(path))
        seqs = make()
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(dataclasses.asdict(seqs), tmp)
        os.replace(tmp, path)  # never a half-written cache
        return seqs


@dataclass
class Features:
    """Flat per-token arrays of every sequence; sequence i is rows offsets[i]:offsets[i + 1]."""

    token_ids: torch.Tensor  # [N] int64
    labels: torch.Tensor  # [N] int64: the target's argmax at each position (its next token)
    hidden: Optional[torch.Tensor]  # [N, F] bf16: final normed hidden, or the aux layers' [3H]
    offsets: list
    prompt_lens: list
    # The target's k most likely next tokens at each position and their log-probabilities over
    # the whole vocabulary (soft labels): [N, k] int64 and fp16, or None (hard labels only).
    soft_ids: Optional[torch.Tensor] = None
    soft_logp: Optional[torch.Tensor] = None

    @property
    def num_seqs(self) -> int:
        return len(self.prompt_lens)

    def seq_len(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]


def length_batches(lengths: list, ids: list, token_budget: int) -> list:
    """`ids` grouped by similar length, each group's tokens within `token_budget` (one sequence
    at least): padding to the group's longest wastes little."""
    order = sorted(ids, key=lambda i: lengths[i])
    batches, cur, longest = [], [], 0
    for i in order:
        longest = max(longest, lengths[i])
        if cur and longest * (len(cur) + 1) > token_budget:
            batches.append(cur)
            cur, longest = [], lengths[i]
        cur.append(i)
    return batches + ([cur] if cur else [])


def _store_device(device: torch.device, num_bytes: int) -> torch.device:
    if device.type == "cuda":
        # The generating engine's KV cache and graphs were just freed into torch's cache, which
        # mem_get_info counts as used: hand it back first. (Features on the CPU cost a host
        # gather and copy on every training step: several times slower.)
        torch.cuda.empty_cache()
        free_bytes, _ = torch.cuda.mem_get_info(device)
        if num_bytes < FEATURE_MEMORY_SHARE * free_bytes:
            return device
    return torch.device("cpu")


@torch.no_grad()
def extract_features(model, seqs: Sequences, aux_layers: tuple, keep_hidden: bool, device,
                     token_budget: int = 32768, show_progress: bool = True,
                     soft_k: int = 0) -> Features:
    """Runs the target over every whole sequence (dense attention, no KV cache): its greedy
    labels, its top `soft_k` next tokens with their log-probabilities (soft_k > 0) and, when
    `keep_hidden`, its final hidden states or (aux_layers) the residual streams entering those
    layers, concatenated. Stored in bf16 on the GPU when they fit, else CPU."""
    cfg = model.config
    lens = [len(t) for t in seqs.token_ids]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    width = cfg.hidden_size * max(len(aux_layers), 1)
    per_token = (width * 2 if keep_hidden else 0) + soft_k * 10  # bytes: bf16; int64 + fp16
    store = _store_device(device, offsets[-1] * per_token)
    token_ids = torch.tensor([t for s in seqs.token_ids for t in s], dtype=torch.long)
    labels = torch.empty(offsets[-1], dtype=torch.long, device=store)
    hidden = torch.empty(offsets[-1], width, dtype=torch.bfloat16, device=store) \
        if keep_hidden else None
    soft_ids = torch.empty(offsets[-1], soft_k, dtype=torch.long, device=store) if soft_k else None
    soft_logp = torch.empty(offsets[-1], soft_k, dtype=torch.float16, device=store) \
        if soft_k else None
    backend = DenseAttnBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)
    batches = length_batches(lens, list(range(len(lens))), token_budget)
    for ids in tqdm(batches, desc="features", unit="batch", disable=not show_progress):
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in ids])
        batch = dense_batch(token_ids[rows].to(device), [lens[i] for i in ids])
        final, aux = dense_forward(model, backend, batch, aux_layers)
        rows = rows.to(store)
        for start in range(0, final.shape[0], LOGITS_CHUNK_ROWS):
            part = slice(start, start + LOGITS_CHUNK_ROWS)
            logits = model.compute_logits(final[part])
            labels[rows[part]] = logits.argmax(-1).to(store)
            if soft_k:
                top = torch.log_softmax(logits.float(), dim=-1).topk(soft_k, dim=-1)
                soft_ids[rows[part]] = top.indices.to(store)
                soft_logp[rows[part]] = top.values.to(store, torch.float16)
        if keep_hidden:
            feats = torch.cat(aux, dim=-1) if aux_layers else final
            hidden[rows] = feats.to(store, torch.bfloat16)
    return Features(token_ids.to(store), labels, hidden, offsets, list(seqs.prompt_lens),
                    soft_ids, soft_logp)


def choose_draft_vocab(features: Features, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids a draft vocabulary keeps, sorted: the most frequent labels (what
    the draft must produce), then the most frequent tokens anywhere, then any others."""
    size = min(size, vocab_size)
    counts = torch.bincount(features.labels.cpu(), minlength=vocab_size).double()
    counts += torch.bincount(features.token_ids.cpu(), minlength=vocab_size).double() * 1e-6
    return counts.topk(size).indices.sort().values
