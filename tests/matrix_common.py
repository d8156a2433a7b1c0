"""Helpers for the GSM8K matrix (tests/test_gsm8k_matrix.py): one cell = one engine configuration
running the same greedy few-shot GSM8K prompts; what it measured, compared with no-spec."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specpcg.gsm8k import STOP, extract_answer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MATRIX_OUT = REPO_ROOT / "benchmarks" / "results" / "gsm8k_matrix.jsonl"
MATRIX_OUT_ENV = "SPECPCG_MATRIX_OUT"


@contextmanager
def parse_checkpoints_once():
    """While active, a checkpoint (weights and tokenizer) is parsed once per path and handed to
    every engine built from it; each engine still builds and loads its own model from it.

    Why: the default model is a GGUF file whose metadata (a 49k-token vocabulary) the reader
    walks in Python three times per Engine, ~10 s of CPU each time, which would be most of the
    CPU slice's budget. The loader itself is tested in test_loader / test_default_model."""
    import specpcg.models.loader as loader
    import specpcg.tokenizer as tokenizer

    real_checkpoint, real_tokenizer = loader.load_checkpoint, tokenizer.load_tokenizer
    checkpoints, tokenizers = {}, {}

    def load_checkpoint(model_path):
        key = os.path.abspath(os.fspath(model_path))
        if key not in checkpoints:
            checkpoints[key] = real_checkpoint(model_path)
        cfg, state = checkpoints[key]
        return cfg, dict(state)  # the model copies the tensors in; callers may pop names

    def load_tokenizer(model_path):
        key = os.path.abspath(os.fspath(model_path))
        if key not in tokenizers:
            tokenizers[key] = real_tokenizer(model_path)
        return tokenizers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "load_checkpoint", load_checkpoint)
        patch.setattr(tokenizer, "load_tokenizer", load_tokenizer)
        yield


@dataclass
class Run:
    """One generate call over every prompt of a cell, and the engine's counters after it."""

    output_ids: list
    texts: list
    preds: list
    accuracy: float
    seconds: float  # wall time of the generate call
    info: dict = field(repr=False)

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)


def run_gsm8k(engine, prompts: list, golds: list, max_new_tokens: int) -> Run:
    """All prompts in one generate call (the scheduler batches them), greedy, stop at STOP."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "stop": STOP}
    t0 = time.perf_counter()
    outs = engine.generate(prompt=prompts, sampling_params=params)
    seconds = time.perf_counter() - t0
    preds = [extract_answer(o["text"]) for o in outs]
    accuracy = sum(p == g for p, g in zip(preds, golds)) / len(golds)
    return Run([o["output_ids"] for o in outs], [o["text"] for o in outs], preds, accuracy,
               seconds, engine.get_server_info())


def first_divergence(got: list, want: list):
    """Index of the first differing token; len(shorter) when one is a prefix of the other;
    None when identical."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def extend_counts(info: dict) -> tuple:
    """(EXTEND forwards served by the piecewise graph, EXTEND forwards run eagerly, the eager
    reasons) from get_server_info()["forward_stats"]."""
    stats = [s for s in info["forward_stats"] if s["mode"] == "EXTEND"]
    piecewise = sum(s["count"] for s in stats if s["runner"] == "piecewise")
    eager = [s for s in stats if s["runner"] == "eager"]
    return piecewise, sum(s["count"] for s in eager), sorted({s["reason"] for s in eager})


def kv_leaks(engine, info: dict) -> list:
    """Messages for every KV cache (the target's; a model draft's own) with slots still held."""
    caches = {"target": info["kv_cache"]}
    draft_kv = getattr(getattr(engine, "draft", None), "kv_cache", None)
    if draft_kv is not None:
        caches["draft"] = draft_kv.info()
    return [f"{name} KV: free_slots {kv['free_slots']} != total_slots {kv['total_slots']}"
            for name, kv in caches.items() if kv["free_slots"] != kv["total_slots"]]


def draft_piecewise_forwards(engine) -> int:
    """Forwards a draft's own router served with a piecewise graph (invariant 5: always 0)."""
    router = getattr(getattr(engine, "draft", None), "router", None)
    if router is None:
        return 0
    return sum(s["count"] for s in router.forward_stats() if s["runner"] == "piecewise")


def accept_length(info: dict):
    states = info["internal_states"][0]
    return states.get("avg_spec_accept_length") if info.get("speculative") else None


def _bench_common():
    """benchmarks/common.py (machine_info, git_commit, now_iso), loaded by path: `benchmarks`
    is no package and `common` is too generic a name to put on sys.path."""
    spec = importlib.util.spec_from_file_location("specpcg_bench_common",
                                                  REPO_ROOT / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_fields(device) -> dict:
    common = _bench_common()
    return {**common.machine_info(device), "timestamp": common.now_iso()}


def matrix_out_path() -> Path:
    return Path(os.environ.get(MATRIX_OUT_ENV) or DEFAULT_MATRIX_OUT)


def append_record(record: dict, path=None) -> Path:
    path = Path(path or matrix_out_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return path
