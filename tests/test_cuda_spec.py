"""Speculative decoding on the GPU in bf16: identical-output rate against plain decoding,
mismatches only at near-ties, and the graphs in use (piecewise prefill, verify graphs)."""

import pytest

from specpcg import Engine
from specpcg.gsm8k import build_prompts
from specpcg.models.loader import default_model_path
from tests.test_cuda_graphs import NEAR_TIE_ULPS, _token_gap

pytestmark = pytest.mark.cuda
PARAMS = {"max_new_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def prompts():
    return build_prompts(20, num_shots=1)[0]


@pytest.fixture(scope="module")
def plain(prompts):
    engine = Engine(device="cuda", max_total_tokens=32768)
    outs = [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=PARAMS)]
    return engine, outs


def count_identical_check_near_ties(label, base, ref, outs, prompts) -> int:
    """How many outputs equal plain decoding's; asserts every other one first diverges at a
    near-tie of the plain engine's logits."""
    same = 0
    for out, want, prompt in zip(outs, ref, prompts):
        got = out["output_ids"]
        if got == want:
            same += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        print(f"{label}: divergence at token {k}")
        assert _token_gap(base, base.tokenizer.encode(prompt) + want[:k], got[k], want[k]) \
            <= NEAR_TIE_ULPS
    return same


TREE = {"speculative_num_steps": 5, "speculative_eagle_topk": 4,
        "speculative_num_draft_tokens": 8}


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "NGRAM-tree"])
def test_spec_bf16_matches_plain_except_near_ties(algo, prompts, plain):
    """NGRAM-tree: trees verify through their own graphs (topk > 1), never eagerly."""
    base, ref = plain
    kw = {"speculative_draft_model_path": default_model_path()} if algo == "STANDALONE" else {}
    if algo == "NGRAM-tree":
        algo, kw = "NGRAM", TREE
    engine = Engine(device="cuda", max_total_tokens=32768, speculative_algorithm=algo, **kw)
    outs = engine.generate(prompt=prompts, sampling_params=PARAMS)
    same = count_identical_check_near_ties(algo, base, ref, outs, prompts)
    info = engine.get_server_info()
    print(f"{algo}: identical {same}/20, avg accept length "
          f"{info['internal_states'][0]['avg_spec_accept_length']:.2f}")
    # bf16: the verify forward (N tokens per request) rounds differently from one-token decode,
    # so near-ties flip (H100: 12/20 identical, every divergence within 1 ulp). Every mismatch is
    # checked above; this floor catches a systematic break that starts at non-ties.
    assert same >= 10
    stats = {(s["mode"], s["runner"]): s["count"] for s in info["forward_stats"]}
    assert stats.get(("EXTEND", "piecewise"), 0) > 0 and ("EXTEND", "eager") not in stats
    # Synchronous verifies replay the decode graph, overlapped ones the step graph.
    assert stats.get(("TARGET_VERIFY", "decode_graph"), 0) \
        + stats.get(("TARGET_VERIFY", "spec_step_graph"), 0) > 0, stats
    assert ("TARGET_VERIFY", "eager") not in stats and ("TARGET_VERIFY", "piecewise") not in stats
    kv = info["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]
