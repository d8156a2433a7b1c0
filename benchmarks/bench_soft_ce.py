"""The draft trainer's loss on one TTT step's rows: the chunked soft cross-entropy
(drafts.soft_ce, gradient taken with the loss) against the checkpointed autograd form it
replaced, forward and backward, for a full-vocabulary head (NEXTN: 49,152 ids, trainable LM
head) and EAGLE3's 8,192 ids.

    python benchmarks/bench_soft_ce.py [--rows 2048] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import common

common.add_repo_to_path()

SHAPES = (("NEXTN-like", 49152), ("EAGLE3-like", 8192))  # (name, vocabulary)
HIDDEN, TOP_K = 576, 16


def _checkpointed(h, w, y, ids, probs):
    """The form head_loss used before drafts.soft_ce (logits recomputed in backward)."""
    from torch.utils.checkpoint import checkpoint

    def loss(h, w):
        logp = torch.log_softmax(F.linear(h, w.to(h.dtype)).float(), dim=-1)
        return -(probs * logp.gather(1, ids.clamp(min=0)))[y >= 0].sum()
    return checkpoint(loss, h, w, use_reentrant=False)


def time_variant(fn, h, w, device, repeats: int) -> float:
    """Best of `repeats` forward + backward wall times, in ms."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        _, seconds = common.timed(lambda: fn().backward(), device)
        best = min(best, seconds)
        h.grad = w.grad = None
    return 1e3 * best


def main() -> None:
    from drafts.soft_ce import soft_cross_entropy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "soft_ce.jsonl"))
    a = p.parse_args()
    device, gen = torch.device(a.device), torch.Generator().manual_seed(0)
    lines = []
    for name, vocab in SHAPES:
        w = (0.02 * torch.randn(vocab, HIDDEN, generator=gen)).to(device).requires_grad_(True)
        h = torch.randn(a.rows, HIDDEN, generator=gen).to(device).requires_grad_(True)
        y = torch.randint(-1, vocab, (a.rows,), generator=gen).to(device)
        ids = torch.randint(0, vocab, (a.rows, TOP_K), generator=gen).to(device)
        probs = torch.softmax(torch.randn(a.rows, TOP_K, generator=gen), -1).to(device)
        ms = {v: time_variant(fn, h, w, device, a.repeats) for v, fn in (
            ("checkpointed", lambda: _checkpointed(h, w, y, ids, probs)),
            ("chunked", lambda: soft_cross_entropy(h, w, y, ids, probs)))}
        lines.append({"bench": "soft_ce", "head": name, "vocab": vocab, "rows": a.rows,
                      "hidden": HIDDEN, "checkpointed_ms": ms["checkpointed"],
                      "chunked_ms": ms["chunked"], "speedup": ms["checkpointed"] / ms["chunked"],
                      "git": common.git_commit(), "time": common.now_iso(),
                      **common.machine_info(device)})
        print(f"[bench_soft_ce] {name}: checkpointed {ms['checkpointed']:.1f} ms, chunked "
              f"{ms['chunked']:.1f} ms ({lines[-1]['speedup']:.2f}x)", flush=True)
    common.append_jsonl(a.out, lines)


if __name__ == "__main__":
    main()
