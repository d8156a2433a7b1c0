"""A head's EAGLE-2 tree: the expansion (shared by the eager path and the graph), and the tree
round that replays every tree step and the tree's selection as one CUDA graph.

Eagerly each tree step is a batch built on the host, an attention plan and a decode-graph
replay, about a millisecond of host work per step at batch 1; in the round graph a step reads
the branches, their hidden states and their ancestry straight from the step before, and the
attention plan of each step (the node rows of kernels.tree_rows.tree_path_rows) is built on the
device inside the graph. The host sends positions, slots and request rows once per round
(DraftGraphRunner.load).
"""

from __future__ import annotations

import torch

from kernels.tree import build_tree
from kernels.tree_step import advance_tree
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode


def expand_tree(root, top_tokens, top_scores, hidden, num_steps: int, num_draft_tokens: int,
                step):
    """EAGLE-2 expansion. root [bs]: the last committed tokens; top_tokens, top_scores [bs, K]:
    the root's K best children and their log-probs; hidden [bs, H]: the draft's hidden state at
    the root; step(tokens [bs, K], branch_hidden [bs, K, H], ancestors [bs, K, fed], s) feeds
    step s's K branches and returns (top_ids, top_logp [bs, K, K]: each branch's K best
    children and their log-probs, hidden [bs, K, H]). Returns the Tree of the num_draft_tokens
    best-scored nodes (kernels.tree.build_tree). Device ops only."""
    bs, k = top_tokens.shape
    dev = top_tokens.device
    cand_tokens = torch.zeros(bs, num_steps, k, k, dtype=torch.long, device=dev)
    cand_scores = torch.full((bs, num_steps, k, k), float("-inf"), device=dev)
    branch_parents = torch.zeros(bs, num_steps, k, dtype=torch.long, device=dev)
    cand_tokens[:, 0, 0], cand_scores[:, 0, 0] = top_tokens, top_scores
    tokens, scores = top_tokens, top_scores  # [bs, K]: the branches fed next
    branch_hidden = hidden[:, None].expand(bs, k, hidden.shape[-1])
    # [bs, K, fed so far]: which fed nodes each branch sees
    ancestors = torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k)
    if num_steps > 1:
        branch_parents[:, 1] = torch.arange(k, device=dev)
    for s in range(1, num_steps):
        top_ids, top_logp, step_hidden = step(tokens, branch_hidden, ancestors, s)
        # The step's bookkeeping: one kernel on the GPU, a dozen in torch (kernels/tree_step.py).
        branches = advance_tree(cand_tokens, cand_scores, branch_parents, top_ids, top_logp,
                                scores, ancestors, s)
        if branches is None:  # the last step
            break
        scores, tokens, ancestors = branches.scores, branches.tokens, branches.ancestors
        branch_hidden = step_hidden.gather(
            1, branches.parent[..., None].expand(-1, -1, hidden.shape[-1]))
    return build_tree(root, cand_tokens, cand_scores, branch_parents, num_draft_tokens)


def step_children(model, head_hidden: torch.Tensor, bs: int, k: int):
    """A tree step's (top_ids, top_logp) [bs, K, K] from its [bs * K, H] head outputs: fused
    kernels on the GPU (torch's softmax and radix select cost 80-90 us a step at batch 16)
    over the head's own vocabulary (kernels/topk.py)."""
    ids, logp = model.top_children(head_hidden, k)
    return ids.view(bs, k, k), logp.view(bs, k, k)


class TreeRound:
    """The 'tree' kind of a head's round runner: tree steps 1 .. num_steps - 1 and the node
    selection. Request i's step-s branches write their KV to round slots (s - 1) * K .. s * K - 1
    (views()["chain"], step-major), at columns base + (s - 1) * K .. of its req_to_token row,
    exactly where the eager steps put them."""

    def __init__(self, model, rnd, topk: int, num_steps: int, num_draft_tokens: int):
        self.model, self.rnd = model, rnd
        self.topk, self.num_steps, self.num_draft_tokens = topk, num_steps, num_draft_tokens
        dev = rnd.buf.ints.device
        self.top_tokens = torch.zeros(rnd.max_bs, topk, dtype=torch.long, device=dev)
        self.top_scores = torch.zeros(rnd.max_bs, topk, dtype=torch.float32, device=dev)
        rnd.add_kind("tree", self._body)

    @property
    def round_slots(self) -> int:
        """KV slots a request's tree steps write: the round runner was sized for them."""
        return self.rnd.buf.steps

    def _body(self, bs: int, base_cpu: list):
        tree = self.tree_body(bs, base_cpu)
        return tree.draft_tokens, tree.parents

    def tree_body(self, bs: int, base_cpu: list):
        """Every tree step and the selection, from the round's buffers (top_tokens, top_scores
        and hidden0 hold the root's children): the Tree of the bs rows."""
        v, k = self.rnd.buf.views(bs), self.topk
        rows = v["rows"]
        widths = torch.full((bs,), k, dtype=torch.long, device=rows.device)
        positions, slots, seq_lens = self._step_inputs(v, bs)

        def step(tokens, branch_hidden, ancestors, s: int):
            batch = ForwardBatch(
                forward_mode=ForwardMode.DRAFT_EXTEND, input_ids=tokens.reshape(-1),
                positions=positions[s - 1], out_cache_loc=slots[s - 1], req_pool_indices=rows,
                seq_lens=seq_lens[s - 1], extend_seq_lens=widths,
                seq_lens_cpu=[n + s * k for n in base_cpu], extend_seq_lens_cpu=[k] * bs,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                input_hidden=branch_hidden.reshape(bs * k, -1), tree_mask=ancestors.contiguous())
            out, aux = self.rnd.forward(batch)
            return (*step_children(self.model, out, bs, k), aux[0].view(bs, k, -1))

        return expand_tree(v["roots"], self.top_tokens[:bs], self.top_scores[:bs],
                           self.rnd.buf.hidden0[:bs], self.num_steps, self.num_draft_tokens, step)

    def _step_inputs(self, v: dict, bs: int) -> tuple:
        """Every tree step's positions and KV slots ([S - 1, bs * K], request-major) and
        sequence lengths ([S - 1, bs]), built once a round: a handful of kernels where each
        step built its own with as many."""
        k, steps = self.topk, self.num_steps - 1
        base = v["seq_lens"]  # step s's branches sit at base + s - 1
        offsets = torch.arange(steps, device=base.device)[:, None]
        positions = (base + offsets)[:, :, None].expand(steps, bs, k).reshape(steps, bs * k)
        # views()["chain"]: step s's slot of branch j is row (s - 1) * K + j, one column a request
        slots = v["chain"].view(steps, k, bs).transpose(1, 2).reshape(steps, bs * k)
        # NOTE: at batch 1 both reshapes can be views with a zero stride; kernels need rows.
        return positions.contiguous(), slots.contiguous(), base + (offsets + 1) * k

    def run(self, bs: int, rows, hidden, base_cpu: list):
        """After the round's load and catch-up: (draft_tokens, parents) [n, N] of the n real
        requests, from the root's output rows and hidden states [n, H] the catch-up gave."""
        n = rows.shape[0]
        self.load_root(rows, hidden)
        draft_tokens, parents = self.rnd.run("tree", bs, base_cpu + [1] * (bs - n))
        return draft_tokens[:n].clone(), parents[:n].clone()

    def load_root(self, rows, hidden) -> None:
        """The root's children and hidden state (from [n, H] output rows and hidden states)
        for tree_body."""
        n = rows.shape[0]
        tokens, scores = self.model.top_children(rows, self.topk)
        self.top_tokens[:n].copy_(tokens)
        self.top_scores[:n].copy_(scores)
        self.rnd.buf.hidden0[:n].copy_(hidden)
