"""Draft workers by name. The engine reaches drafts only through `create_draft`."""

from __future__ import annotations


def create_draft(spec, engine, tokenizer):
    """spec: SpecConfig; engine: the Engine being built (its config, target config, device)."""
    if spec.algorithm == "NGRAM":
        from drafts.ngram import NgramDraft

        return NgramDraft(pad_token=getattr(tokenizer, "eos_token_ids", (0,))[0] if tokenizer else 0)
    if spec.algorithm == "STANDALONE":
        from drafts.wiring import load_standalone

        return load_standalone(spec, engine)
    if spec.algorithm in ("EAGLE", "EAGLE3", "NEXTN"):
        from drafts.eagle import load_head_draft

        return load_head_draft(spec, engine)
    raise ValueError(f"speculative_algorithm {spec.algorithm!r} has no draft worker")
