"""Training sources by name: `gsm8k`, `gsm8k-fewshot`, `sharegpt`, a `.jsonl` path, or a weighted
mixture of them (`sharegpt:0.8,gsm8k:0.2`)."""

from __future__ import annotations

import os

from drafts.data.base import Sample, Source
from drafts.data.mixture import draw, parse_mixture, split_counts

# Chat first: on the H100, EAGLE3 heads from the default command accepted 2.975 on held-out chat
# prompts trained on 0.7 / 0.2 / 0.1 and 3.004 on this mixture, with zero-shot GSM8K still 3.2+
# (benchmarks/results/train19, train20).
DEFAULT_DATA = "sharegpt:0.8,gsm8k:0.15,gsm8k-fewshot:0.05"


def _named_sources() -> dict:
    from drafts.data.gsm8k import Gsm8kChat, Gsm8kFewShot
    from drafts.data.sharegpt import ShareGpt

    return {"gsm8k": Gsm8kChat, "gsm8k-fewshot": Gsm8kFewShot, "sharegpt": ShareGpt}


def create_source(name: str) -> Source:
    named = _named_sources()
    if name in named:
        return named[name]()
    if name.endswith(".json") and os.path.isfile(name):  # a ShareGPT-style JSON array
        from drafts.data.sharegpt import ShareGpt

        return ShareGpt(name)
    if name.endswith(".jsonl"):
        from drafts.data.jsonl import JsonlChats

        return JsonlChats(name)
    raise ValueError(f"data source {name!r} is unknown: use one of {sorted(named)}, a .jsonl "
                     f"or ShareGPT .json path, or a mixture such as 'sharegpt:0.8,gsm8k:0.2'")


def check_spec(spec: str, readable: bool = False) -> list:
    """(source, weight) of each part of `spec`, made without reading any: a bad name or weight
    fails here; with `readable`, so does a source whose data is not there (`Source.check`)."""
    parts = [(create_source(name), weight) for name, weight in parse_mixture(spec)]
    for source, _ in parts if readable else ():
        source.check()
    return parts


def training_samples(spec: str, num: int, seed: int = 0) -> list:
    """`num` training samples drawn from the sources of `spec` by their weights."""
    parts = check_spec(spec)
    return draw([s.train() for s, _ in parts], split_counts(num, [w for _, w in parts]), seed)


def heldout_samples(spec: str, num: int, seed: int = 0) -> list:
    """`num` held-out samples of `spec`'s sources by their weights (what no draft trained on)."""
    parts = check_spec(spec)
    return draw([s.heldout() for s, _ in parts], split_counts(num, [w for _, w in parts]), seed)


__all__ = ["DEFAULT_DATA", "Sample", "Source", "check_spec", "create_source", "heldout_samples",
           "training_samples"]
