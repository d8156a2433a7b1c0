"""Offline accept length: a draft's chains simulated on sequences the target wrote, exactly as the
engine drafts them, with no engine.

For a chain of S steps the engine verifies at a root token r (the last committed one): draft j
(j = 1..S) proposes token r + j, and the verify keeps the leading drafts that equal the target's
greedy tokens plus one bonus token, so the next root is r + accepted + 1. The first root is the
token the prefill produced. On a sequence the target wrote greedily, "equals the target's greedy
token" is "equals the sequence's next token", so a table hits[j - 1, q] (draft step j, rooted at
q - j, proposes token q correctly) decides every verify.

For heads the table comes from the unrolled TTT forward (drafts.train_heads.unrolled_steps):
step j at row p is draft step j of the chain rooted at token p - j + 2, reading the target's
hidden states up to the root and its own after (the draft KV cache the engine holds then). A
STANDALONE draft reads tokens only, so step j is its greedy next token after the true prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafts.train_data import Features, length_batches

OFFLINE_TOKEN_BUDGET = 16384


@dataclass
class ChainWalk:
    """Totals of simulated verifies over many sequences, for one chain length."""

    num_steps: int
    tokens: int = 0  # completion tokens, the prefill's first token included
    verifies: int = 0
    histogram: list = field(default_factory=list)  # verifies that accepted 0..num_steps drafts

    def __post_init__(self):
        self.histogram = self.histogram or [0] * (self.num_steps + 1)

    @property
    def accept_length(self) -> float:
        """completion tokens / verifies, as the engine's avg_spec_accept_length."""
        return self.tokens / max(self.verifies, 1)

    def add(self, hits: torch.Tensor, prompt_len: int) -> None:
        """hits: [>= num_steps, seq_len] bool of one sequence."""
        table = hits[:self.num_steps].tolist()
        n, r = len(table[0]), prompt_len
        self.tokens += n - prompt_len
        while r < n - 1:
            a = 0
            while a < self.num_steps and r + a + 1 < n and table[a][r + a + 1]:
                a += 1
            self.histogram[a] += 1
            self.verifies += 1
            r += a + 1

    def record(self) -> dict:
        return {"num_steps": self.num_steps, "accept_length": self.accept_length,
                "verifies": self.verifies, "tokens": self.tokens,
                "accept_histogram": self.histogram}


def walk_chains(hits: list, prompt_lens: list, steps_list: tuple) -> dict:
    """{num_steps: ChainWalk} over sequences (hits[i]: [S, len_i] bool, S >= every steps)."""
    walks = {s: ChainWalk(s) for s in steps_list}
    for h, p in zip(hits, prompt_lens):
        for w in walks.values():
            w.add(h, p)
    return walks


def _split_rows(x: torch.Tensor, lens: list) -> list:
    return list(torch.split(x, lens, dim=-1))


@torch.no_grad()
def head_hits(head, feats: Features, seq_ids: list, num_steps: int, device) -> list:
    """[num_steps, len] hit tables of `seq_ids`, from the head's unrolled chain."""
    from drafts.train_heads import head_rows, unrolled_steps
    from specpcg.attention.dense import DenseAttnBackend

    lc = head.config
    backend = DenseAttnBackend(lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.head_dim ** -0.5)
    # head_rows' labels are not read here: hits compare target ids (greedy_tokens maps a
    # smaller draft vocabulary to them, as the engine's chain does).
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.long, device=device)
    out = {}
    lens = [feats.seq_len(i) - 1 for i in range(feats.num_seqs)]
    for batch in length_batches(lens, list(seq_ids), OFFLINE_TOKEN_BUDGET):
        rows = head_rows(feats, batch, t2d, device, with_next=False)
        rows.hidden = rows.hidden.to(head.head_weight.dtype)
        # Row p proposes token p + 2 of its sequence (none for the last row: -1).
        want = torch.cat([torch.cat([feats.token_ids[feats.offsets[i] + 2:feats.offsets[i + 1]],
                                     feats.token_ids.new_full((1,), -1)])
                          for i in batch]).to(device)
        steps = []
        for k, _, hidden, _ in unrolled_steps(head, backend, rows, num_steps):
            valid = rows.batch.positions >= k - 1  # a step-k draft exists from p = k - 1 on
            steps.append(valid & (head.greedy_tokens(hidden) == want))
        hit = torch.stack(steps).cpu()  # [S, R]: row p hits token p + 2
        for i, part in zip(batch, _split_rows(hit, [lens[i] for i in batch])):
            table = torch.zeros(num_steps, lens[i] + 1, dtype=torch.bool)
            table[:, 2:] = part[:, :-1]
            out[i] = table
    return [out[i] for i in seq_ids]


@torch.no_grad()
def model_hits(model, feats: Features, seq_ids: list, num_steps: int, device) -> list:
    """[num_steps, len] hit tables of a draft model (STANDALONE): token q is hit when the
    model's greedy token after the true prefix q - 1 is token q, for every step."""
    from specpcg.attention.dense import DenseAttnBackend, dense_batch, dense_forward

    cfg = model.config
    backend = DenseAttnBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)
    lens = [feats.seq_len(i) for i in range(feats.num_seqs)]
    out = {}
    for batch in length_batches(lens, list(seq_ids), OFFLINE_TOKEN_BUDGET):
        rows = torch.cat([torch.arange(feats.offsets[i], feats.offsets[i + 1]) for i in batch])
        tokens = feats.token_ids[rows.to(feats.token_ids.device)].to(device)
        hidden, _ = dense_forward(model, backend, dense_batch(tokens, [lens[i] for i in batch]))
        pred = model.compute_logits(hidden).argmax(-1).cpu()
        for i, p, t in zip(batch, _split_rows(pred, [lens[i] for i in batch]),
                           _split_rows(tokens.cpu(), [lens[i] for i in batch])):
            hit = torch.zeros(lens[i], dtype=torch.bool)
            hit[1:] = p[:-1] == t[1:]
            out[i] = hit[None].expand(num_steps, -1)
    return [out[i] for i in seq_ids]


def offline_accept(hits: list, prompt_lens: list, steps_list: tuple) -> dict:
    """{"S,1,S+1": record} for each chain length S of steps_list."""
    walks = walk_chains(hits, prompt_lens, steps_list)
    return {f"{s},1,{s + 1}": w.record() for s, w in walks.items()}


def offline_accept_by_source(hits: list, prompt_lens: list, sources: list,
                             steps_list: tuple) -> dict:
    """{source: offline_accept of that source's sequences}: a mixture's chat and math sets accept
    very differently, and the engine is judged on each (drafts.evaluate)."""
    out = {}
    for name in sorted(set(sources)):
        pick = [j for j, s in enumerate(sources) if s == name]
        out[name] = offline_accept([hits[j] for j in pick], [prompt_lens[j] for j in pick],
                                   steps_list)
    return out


def load_draft_model(algorithm: str, path: str, target, target_cfg, device, dtype):
    """The draft at `path` as the engine loads it (its dtype included)."""
    if algorithm == "STANDALONE":
        from specpcg.config import EngineConfig
        from specpcg.models.loading import load_target

        cfg = EngineConfig(model_path=path, skip_tokenizer_init=True)
        model, _, _ = load_target(cfg, device, dtype)
        return model
    from drafts.head_checkpoint import load_head

    head, _ = load_head(path, algorithm, target_cfg, target, device, dtype)
    return head


def draft_hits(algorithm: str, draft, feats: Features, seq_ids: list, num_steps: int,
               device) -> list:
    if algorithm == "STANDALONE":
        return model_hits(draft, feats, seq_ids, num_steps, device)
    return head_hits(draft, feats, seq_ids, num_steps, device)
