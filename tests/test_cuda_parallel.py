"""Tensor and pipeline parallelism on GPUs (NCCL, one process and one GPU per rank): greedy
tokens identical to one GPU in fp32, with the graphs each layout keeps (piecewise graphs under
TP, each stage's graphs of its own layers under PP), with no speculation and with drafts.
Needs as many GPUs as ranks; skipped elsewhere."""

import pytest
import torch

from drafts.head_checkpoint import random_head, save_head
from drafts.train_standalone import save_standalone, truncated_model
from specpcg import Engine
from test_tensor_parallel import GREEDY, IDS
from test_train import _tiny_target

pytestmark = pytest.mark.cuda


def _gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_tp")
    target = _tiny_target(root / "target")
    kw = dict(model_path=target, skip_tokenizer_init=True, device="cuda", dtype="float32",
              max_total_tokens=2048, show_progress=False, dist_timeout_s=120)
    plain = Engine(**kw)
    want = [o["output_ids"] for o in plain.generate(input_ids=IDS, sampling_params=GREEDY)]
    head, spec = random_head("EAGLE3", plain.model_config, torch.device("cpu"), torch.float32,
                             draft_vocab_size=96)
    drafts = {"EAGLE3": save_head(head, spec, plain.model_config, str(root / "EAGLE3"))}
    model, cfg = truncated_model(target, 1, torch.device("cpu"))
    drafts["STANDALONE"] = save_standalone(model, cfg, target, str(root / "standalone"))
    plain.shutdown()
    return kw, want, drafts


def _run(kw: dict, **extra) -> tuple:
    """(greedy outputs, server info) of an engine of layout `extra`."""
    engine = Engine(**kw, **extra)
    try:
        out = [o["output_ids"] for o in engine.generate(input_ids=IDS, sampling_params=GREEDY)]
        return out, engine.get_server_info()
    finally:
        engine.shutdown()


def _spec(drafts: dict, algo):
    return {} if algo is None else {"speculative_algorithm": algo,
                                    "speculative_draft_model_path": drafts.get(algo)}


def _replays(info: dict, runner: str) -> int:
    return sum(s["count"] for s in info["forward_stats"]
               if s["runner"] == runner and s["mode"] in ("DECODE", "TARGET_VERIFY"))


@_gpus(2)
@pytest.mark.parametrize("algo", [None, "NGRAM", "STANDALONE", "EAGLE3"])
def test_tp2_on_two_gpus_matches_one_gpu(tiny, algo):
    """Decode steps and verifies replay the piecewise graphs on both ranks (NCCL all-reduces
    between their segments)."""
    kw, want, drafts = tiny
    got, info = _run(kw, tp_size=2, **_spec(drafts, algo))
    assert got == want
    assert _replays(info, "piecewise") > 0, info["forward_stats"]


@_gpus(2)
@pytest.mark.parametrize("algo", [None, "NGRAM", "STANDALONE", "EAGLE3"])
def test_pp2_on_two_gpus_matches_one_gpu(tiny, algo):
    """Each stage replays graphs of its own layers per micro-batch; states cross the GPUs
    one way (rank 0 runs the last stage)."""
    kw, want, drafts = tiny
    got, info = _run(kw, pp_size=2, **_spec(drafts, algo))
    assert got == want
    assert info["pipeline_stage_graphs"]["replays"] > 0, info["pipeline_stage_graphs"]


@_gpus(4)
@pytest.mark.parametrize("algo", [None, "STANDALONE", "EAGLE3"])
def test_tp2_pp2_on_four_gpus_matches_one_gpu(tiny, algo):
    kw, want, drafts = tiny
    got, _ = _run(kw, tp_size=2, pp_size=2, **_spec(drafts, algo))
    assert got == want


@_gpus(2)
@pytest.mark.slow
def test_default_model_pp2_on_two_gpus_matches_one_gpu():
    """The default model (30 layers, 15 a stage) in fp32, with and without NGRAM."""
    kw = dict(device="cuda", dtype="float32", max_total_tokens=4096, show_progress=False)
    prompts = ["The capital of France is", "Water boils at", "List three primes:"]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    one = Engine(**kw)
    try:
        want = [o["output_ids"] for o in one.generate(prompt=prompts, sampling_params=params)]
    finally:
        one.shutdown()
    for spec in ({}, {"speculative_algorithm": "NGRAM"}):
        engine = Engine(pp_size=2, **kw, **spec)
        try:
            got = [o["output_ids"] for o in engine.generate(prompt=prompts,
                                                            sampling_params=params)]
        finally:
            engine.shutdown()
        assert got == want, spec
