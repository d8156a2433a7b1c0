"""Draft workers, registered by name with the engine's registry (specpcg.speculative.registry)."""

from __future__ import annotations

from specpcg.speculative.registry import DraftContext, register_draft


def _ngram(ctx: DraftContext):
    from drafts.ngram import NgramDraft

    eos = getattr(ctx.tokenizer, "eos_token_ids", ()) if ctx.tokenizer else ()
    return NgramDraft(pad_token=eos[0] if eos else 0)


def _standalone(ctx: DraftContext):
    from drafts.standalone import load_standalone

    return load_standalone(ctx)


def _head(ctx: DraftContext):
    from drafts.eagle import load_head_draft

    return load_head_draft(ctx)


register_draft("NGRAM", _ngram)
register_draft("STANDALONE", _standalone)
for _name in ("EAGLE", "EAGLE3", "NEXTN"):
    register_draft(_name, _head)
