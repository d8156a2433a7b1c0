"""The GSM8K matrix: speculative algorithm {none, NGRAM, STANDALONE, EAGLE, EAGLE3, NEXTN} x
piecewise CUDA graph {on, off} x attention backend, each cell running the same greedy few-shot
GSM8K prompts and checked against no-spec with the same graph setting and backend:

- the same accuracy (GPU bf16: within GPU_ACCURACY_SLACK questions, as near-tie divergences may
  change an answer);
- the same tokens (CPU fp32: every token; GPU bf16: the identical rate is reported and every
  divergence must be a near-tie, the two logits within GPU_NEAR_TIE_ULPS bf16 steps);
- an average accept length at or above a floor that fits the draft (module constants below);
- target prefills replay the piecewise graph exactly when PCG is on (invariant 4), and a draft
  never runs a piecewise graph (invariant 5);
- every KV slot free at the end, the target's and a model draft's own (invariant 6).

CPU slice (CI): the default model in fp32, PCG off (the only CPU option: no CUDA device), a few
questions, every algorithm; EAGLE-family drafts are random heads (they accept ~nothing, but
losslessness must hold for any head). GPU (`cuda` marker): 200 questions x 256 tokens in one
batched generate call per cell, trained drafts from `tests/gpu_drafts.py`; one JSON line
per cell goes to benchmarks/results/gsm8k_matrix.jsonl ($SPECPCG_MATRIX_OUT overrides), written
before the cell's asserts, with the list of what failed.

Every engine here is built from a checkpoint parsed once per module (`parse_checkpoints_once`):
parsing the default GGUF costs ~10 s of CPU per Engine, which the CPU slice cannot afford 7 times.
"""


import importlib.util

import pytest
import torch

from specpcg import Engine
from specpcg.gsm8k import build_prompts
from specpcg.models.loader import default_model_path
from tests.matrix_common import (accept_length, append_record, draft_piecewise_forwards,
                                 extend_counts, first_divergence, kv_leaks, machine_fields,
                                 parse_checkpoints_once, run_gsm8k)
from tests.test_cuda_graphs import _token_gap

SPEC_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
HEAD_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")

# ---- CPU slice: sizes and accept-length floors (n = num_draft_tokens, the verify width) ----
CPU_NUM_QUESTIONS, CPU_NUM_SHOTS, CPU_MAX_NEW_TOKENS = 3, 1, 24
CPU_ENGINE = {"device": "cpu", "max_total_tokens": 16384, "show_progress": False}
CPU_EAGLE3_DRAFT_VOCAB = 8192
CPU_ACCEPT_FLOORS = {
    "NGRAM": lambda n: 1.0,  # the bonus token alone: it cannot go below
    "STANDALONE": lambda n: 0.9 * n,  # the target drafting for itself accepts nearly all
    "EAGLE": lambda n: 1.0,  # random heads: nothing beyond the bonus token is promised
    "EAGLE3": lambda n: 1.0,
    "NEXTN": lambda n: 1.0,
}
CPU_PCG_REASON = "no CUDA device"  # why the policy turns the piecewise graph off on a CPU

# ---- GPU matrix: sizes, floors for trained drafts (revise as the drafts improve) ----
GPU_NUM_QUESTIONS, GPU_NUM_SHOTS, GPU_MAX_NEW_TOKENS = 200, 5, 256
GPU_ENGINE = {"device": "cuda", "max_total_tokens": 131072, "max_running_requests": 64,
              "cuda_graph_max_bs": 64, "show_progress": False}
GPU_ACCEPT_FLOORS = {"NGRAM": 1.3, "STANDALONE": 1.3, "EAGLE": 1.8, "EAGLE3": 2.0, "NEXTN": 1.8}
# The torch backend attends one request at a time in Python (~50x slower at batch 64): it runs
# as the reference for EAGLE3's tree, on fewer questions; the Triton tree cell runs them all.
GPU_QUESTIONS_BY_BACKEND = {"triton": GPU_NUM_QUESTIONS, "torch": 40,
                            "flashinfer": GPU_NUM_QUESTIONS}
GPU_TREE = {"speculative_num_steps": 5, "speculative_eagle_topk": 4,
            "speculative_num_draft_tokens": 8}
# bf16 verify (N tokens a request) and decode (one token) reduce in different orders; a
# divergence passes as a near-tie within this many bf16 steps of the logits.
# Measured at cab77cb on an H100: the largest gap among 200 questions was 3.0 steps, at the
# same token of the same question for all five algorithms (so the verify's numerics, not a
# draft's tokens, decided it).
GPU_NEAR_TIE_ULPS = 4
# Identical tokens give identical answers, so an answer changes only where its output diverged,
# and every divergence has passed the near-tie check. Such a flip still moves accuracy: at
# 8f3ffb0 EAGLE3's Triton tree diverged in 88 of 200 outputs (all within 4 ulps) and got one
# answer right that no-spec got wrong (0.005 against 0.000). The count of correct answers may
# differ from no-spec's by this many.
GPU_ACCURACY_SLACK = 2
# (algorithm, PCG, backend, tree: GPU_TREE instead of the default chain), grouped by baseline
# (PCG, backend), no-spec first in each group: one baseline engine alive at a time.
GPU_CELLS = ([(a, True, "triton", False) for a in (None, *SPEC_ALGORITHMS)]
             + [("EAGLE3", True, "triton", True)]
             + [(a, False, "triton", False) for a in (None, *SPEC_ALGORITHMS)]
             + [(None, True, "torch", False), ("EAGLE3", True, "torch", True)]
             + [(a, True, "flashinfer", False) for a in (None, "NGRAM", "EAGLE3")])


def _cell_name(algo, pcg, backend, tree=False) -> str:
    return f"{algo or 'none'}-pcg_{'on' if pcg else 'off'}-{backend}{'-tree' if tree else ''}"


def _check_graphs_and_kv(engine, run, pcg_on: bool) -> list:
    """Failures of the PCG-hit and KV-leak invariants, as messages."""
    failures = []
    pcg_info = run.info["piecewise_cuda_graph"]
    if pcg_info["enabled"] is not pcg_on:
        failures.append(f"piecewise_cuda_graph enabled={pcg_info['enabled']} (reason "
                        f"{pcg_info.get('reason')!r}), expected {pcg_on}")
    hits, eager, reasons = extend_counts(run.info)
    if pcg_on and (hits == 0 or eager):
        failures.append(f"PCG on: {hits} piecewise EXTEND forwards, {eager} eager ({reasons})")
    if not pcg_on and hits:
        failures.append(f"PCG off: {hits} EXTEND forwards replayed a piecewise graph")
    if draft_piecewise_forwards(engine):
        failures.append("the draft ran a piecewise graph (invariant 5)")
    return failures + kv_leaks(engine, run.info)


@pytest.fixture(scope="module")
def checkpoints_once():
    """Every engine of this module reuses one parse of each checkpoint (matrix_common says why)."""
    with parse_checkpoints_once():
        yield


# =================================== CPU slice ===================================
@pytest.fixture(scope="module")
def cpu_prompts():
    return build_prompts(CPU_NUM_QUESTIONS, num_shots=CPU_NUM_SHOTS)


@pytest.fixture(scope="module")
def cpu_baseline(cpu_prompts, checkpoints_once):
    engine = Engine(**CPU_ENGINE)
    yield engine, run_gsm8k(engine, *cpu_prompts, CPU_MAX_NEW_TOKENS)
    engine.shutdown()


@pytest.fixture(scope="session")
def random_heads(tmp_path_factory):
    """algo, target ModelConfig -> a random-weight head checkpoint, written once per session."""
    from drafts.head_checkpoint import random_head, save_head

    root, paths = tmp_path_factory.mktemp("random_heads"), {}

    def get(algo, target_cfg):
        if algo not in paths:
            vocab = CPU_EAGLE3_DRAFT_VOCAB if algo == "EAGLE3" else 0
            head, spec = random_head(algo, target_cfg, "cpu", torch.float32, draft_vocab_size=vocab)
            paths[algo] = save_head(head, spec, target_cfg, str(root / algo.lower()))
        return paths[algo]

    return get


def test_cpu_no_spec_cell(cpu_baseline):
    engine, run = cpu_baseline
    print(f"CPU none: accuracy {run.accuracy:.3f}, predictions {run.preds}, "
          f"{run.output_tokens} tokens in {run.seconds:.1f} s")
    assert run.info["piecewise_cuda_graph"]["enabled"] is False
    assert CPU_PCG_REASON in run.info["piecewise_cuda_graph"]["reason"]
    failures = _check_graphs_and_kv(engine, run, pcg_on=False)
    assert not failures, "\n".join(failures)
    assert all(len(ids) > 0 for ids in run.output_ids)


@pytest.mark.parametrize("algo", SPEC_ALGORITHMS)
def test_cpu_spec_cell_matches_no_spec(algo, cpu_prompts, cpu_baseline, random_heads):
    """fp32 on CPU: every token identical to no-spec, so the accuracy is too."""
    base_engine, base = cpu_baseline
    kw = {"speculative_algorithm": algo}
    if algo == "STANDALONE":
        kw["speculative_draft_model_path"] = default_model_path()
    elif algo in HEAD_ALGORITHMS:
        kw["speculative_draft_model_path"] = random_heads(algo, base_engine.model_config)
    engine = Engine(**CPU_ENGINE, **kw)
    try:
        run = run_gsm8k(engine, *cpu_prompts, CPU_MAX_NEW_TOKENS)
        info = run.info
        n = info["speculative"]["num_draft_tokens"]
        avg, floor = accept_length(info), CPU_ACCEPT_FLOORS[algo](n)
        print(f"CPU {algo}: accuracy {run.accuracy:.3f} (no-spec {base.accuracy:.3f}), avg accept "
              f"length {avg:.2f} (floor {floor:.2f}, {n} draft tokens), verify steps "
              f"{info['internal_states'][0]['spec_verify_ct']}, {run.seconds:.1f} s")
        for i, (got, want) in enumerate(zip(run.output_ids, base.output_ids)):
            k = first_divergence(got, want)
            assert k is None, (f"{algo}: question {i} diverges from no-spec at token {k} of "
                               f"{len(got)} / {len(want)}: got {got[k:k + 4]}, "
                               f"want {want[k:k + 4]}")
        assert run.accuracy == base.accuracy and run.preds == base.preds
        assert info["internal_states"][0]["spec_verify_ct"] > 0  # the spec loop ran
        assert avg >= floor, f"{algo}: avg accept length {avg:.3f} < floor {floor:.3f}"
        assert info["piecewise_cuda_graph"]["enabled"] is False
        assert CPU_PCG_REASON in info["piecewise_cuda_graph"]["reason"]
        failures = _check_graphs_and_kv(engine, run, pcg_on=False)
        assert not failures, "\n".join(failures)
    finally:
        engine.shutdown()


# =================================== GPU matrix ===================================
class _GpuBaselines:
    """The no-spec run per (PCG, backend). One baseline engine is alive at a time (the near-tie
    check needs it); GPU_CELLS is ordered so each is built once."""

    def __init__(self, prompts, golds):
        self.all_prompts, self.all_golds = prompts, golds
        self.key = self.engine = self.run = self.prompts = self.golds = None

    def get(self, pcg: bool, backend: str):
        if self.key != (pcg, backend):
            self.close()
            n = GPU_QUESTIONS_BY_BACKEND[backend]
            self.prompts, self.golds = self.all_prompts[:n], self.all_golds[:n]
            self.engine = _gpu_engine(None, pcg, backend)
            self.run = run_gsm8k(self.engine, self.prompts, self.golds, GPU_MAX_NEW_TOKENS)
            self.key = (pcg, backend)
        return self.engine, self.run

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
        self.key = self.engine = self.run = None


def _gpu_engine(algo, pcg: bool, backend: str, tree: bool = False,
                deterministic: bool = False) -> Engine:
    kw = {**GPU_ENGINE, "attention_backend": backend, "disable_piecewise_cuda_graph": not pcg,
          "enable_deterministic_inference": deterministic}
    if algo is not None:
        # Pinned: each cell measures the speculative path (adaptive speculation could run
        # some batch sizes on plain steps, which changes no token but skips what is tested).
        kw.update(speculative_algorithm=algo, disable_adaptive_speculation=True)
    if tree:
        kw.update(GPU_TREE)
    if algo in ("STANDALONE", *HEAD_ALGORITHMS):
        from tests.gpu_drafts import gpu_draft

        kw["speculative_draft_model_path"] = gpu_draft(algo)
    return Engine(**kw)


@pytest.fixture(scope="module")
def gpu_baselines(checkpoints_once):
    baselines = _GpuBaselines(*build_prompts(GPU_NUM_QUESTIONS, num_shots=GPU_NUM_SHOTS))
    yield baselines
    baselines.close()


def _near_tie_failures(base_engine, prompts, run, base) -> tuple:
    """(identical count, largest divergence gap in bf16 ulps, failures): a divergence passes
    only as a near-tie, checked on the baseline engine's eager path."""
    same, worst, failures = 0, 0.0, []
    for i, (got, want, prompt) in enumerate(zip(run.output_ids, base.output_ids, prompts)):
        k = first_divergence(got, want)
        if k is None:
            same += 1
            continue
        if k == min(len(got), len(want)):  # one output is a prefix of the other: no tie to blame
            worst = float("inf")
            failures.append(f"question {i}: {len(got)} tokens vs no-spec's {len(want)}, "
                            f"identical up to the shorter")
            continue
        ids = base_engine.tokenizer.encode(prompt) + want[:k]
        gap = _token_gap(base_engine, ids, got[k], want[k])
        worst = max(worst, gap)
        if gap > GPU_NEAR_TIE_ULPS:
            failures.append(f"question {i}: diverges at token {k} (got {got[k]}, want {want[k]}) "
                            f"with a logit gap of {gap:.1f} bf16 ulps > {GPU_NEAR_TIE_ULPS}")
    return same, worst, failures


def _gpu_record(cell: tuple, engine, run, base, same: int, worst: float, failures: list) -> dict:
    algo, pcg, backend, tree = cell
    hits, eager, reasons = extend_counts(run.info)
    n = len(base.output_ids)
    return {
        "bench": "gsm8k_matrix", "algorithm": algo or "none", "pcg": pcg,
        "attention_backend": backend, "num_questions": n, "num_shots": GPU_NUM_SHOTS,
        "spec_settings": GPU_TREE if tree else None,
        "near_tie_ulps": GPU_NEAR_TIE_ULPS,
        "max_new_tokens": GPU_MAX_NEW_TOKENS, "accuracy": run.accuracy,
        "baseline_accuracy": base.accuracy, "accuracy_slack": GPU_ACCURACY_SLACK,
        "answers_changed": sum(p != q for p, q in zip(run.preds, base.preds)),
        "identical_frac": same / n,
        "max_near_tie_ulps": None if worst == float("inf") else worst,
        "avg_accept_length": accept_length(run.info), "accept_floor": GPU_ACCEPT_FLOORS.get(algo),
        "num_draft_tokens": (run.info["speculative"] or {}).get("num_draft_tokens"),
        "piecewise_hits": hits, "eager_extend": eager, "eager_extend_reasons": reasons,
        "free_slots_ok": not kv_leaks(engine, run.info), "seconds": run.seconds,
        "output_tokens": run.output_tokens,
        # A preempted request is re-prefilled through the extend kernel, whose reduction order
        # differs from decode's: the counts say whether a cell's divergence can come from it.
        "num_preemptions": run.info.get("num_preemptions"),
        "baseline_num_preemptions": base.info.get("num_preemptions"),
        "kv_total_slots": (run.info.get("kv_cache") or {}).get("total_slots"),
        **machine_fields(engine.device), "failures": failures,
    }


@pytest.mark.cuda
@pytest.mark.parametrize("algo,pcg,backend,tree", GPU_CELLS,
                         ids=[_cell_name(*c) for c in GPU_CELLS])
def test_gpu_gsm8k_cell(algo, pcg, backend, tree, gpu_baselines):
    """bf16: identical rate reported, every divergence a near-tie; the same accuracy; accept
    length above its floor; piecewise hits exactly when PCG is on; no KV leak."""
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer (pip install flashinfer-python)")
    name = _cell_name(algo, pcg, backend, tree)
    base_engine, base = gpu_baselines.get(pcg, backend)
    engine = base_engine if algo is None else _gpu_engine(algo, pcg, backend, tree)
    try:
        run = base if algo is None else run_gsm8k(engine, gpu_baselines.prompts,
                                                  gpu_baselines.golds, GPU_MAX_NEW_TOKENS)
        same, worst, failures = (len(base.output_ids), 0.0, []) if algo is None else \
            _near_tie_failures(base_engine, gpu_baselines.prompts, run, base)
        n = len(base.output_ids)
        if round(abs(run.accuracy - base.accuracy) * n) > GPU_ACCURACY_SLACK:
            flipped = [i for i, (p, q) in enumerate(zip(run.preds, base.preds)) if p != q]
            failures.append(f"accuracy {run.accuracy:.4f} against no-spec's {base.accuracy:.4f}: "
                            f"more than {GPU_ACCURACY_SLACK} of {n} questions apart (answers "
                            f"differ at questions {flipped[:20]})")
        avg, floor = accept_length(run.info), GPU_ACCEPT_FLOORS.get(algo)
        if algo is not None and not avg >= floor:
            failures.append(f"avg accept length {avg:.3f} < floor {floor}")
        failures += _check_graphs_and_kv(engine, run, pcg)
        record = _gpu_record((algo, pcg, backend, tree), engine, run, base, same, worst,
                             failures)
        path = append_record(record)
        print(f"{name}: accuracy {run.accuracy:.3f} (no-spec {base.accuracy:.3f}), identical "
              f"{same}/{record['num_questions']}, worst gap {worst:.2f} ulps, avg accept length "
              f"{avg} (floor {floor}), piecewise hits {record['piecewise_hits']}, eager extend "
              f"{record['eager_extend']}, {run.output_tokens} tokens in {run.seconds:.1f} s "
              f"-> {path}")
        assert not failures, f"{name}:\n" + "\n".join(failures)
    finally:
        if engine is not base_engine:
            engine.shutdown()
