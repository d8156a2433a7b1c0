"""EAGLE-family drafts on the GPU in bf16 with trained heads: identical outputs except at
near-ties, the piecewise graph serving every target prefill (invariant 4: it is captured with
the hidden states the head needs), verify on decode graphs, each draft round's catch-up and
steps on the round's own graphs, and no KV leak.

Heads come from `tests/gpu_drafts.py` (trained on first use, cached)."""


import pytest

from specpcg import Engine
from tests.test_cuda_spec import PARAMS, count_identical_check_near_ties, plain, prompts  # noqa: F401

pytestmark = pytest.mark.cuda
GRAPHED = ("decode_graph", "draft_round_graph", "spec_step_graph")


def _stats(router) -> dict:
    return {(s["mode"], s["runner"]): s["count"] for s in router.forward_stats()}


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "NEXTN"])
def test_head_bf16_matches_plain_and_graphs_serve(algo, prompts, plain):  # noqa: F811
    from tests.gpu_drafts import gpu_draft

    base, ref = plain
    engine = Engine(device="cuda", max_total_tokens=32768, speculative_algorithm=algo,
                    speculative_draft_model_path=gpu_draft(algo),
                    speculative_num_steps=5)
    outs = engine.generate(prompt=prompts, sampling_params=PARAMS)
    same = count_identical_check_near_ties(algo, base, ref, outs, prompts)
    info = engine.get_server_info()
    avg = info["internal_states"][0]["avg_spec_accept_length"]
    print(f"{algo}: identical {same}/20, avg accept length {avg:.2f}")
    assert same >= 10 and avg > 1.5  # a trained head accepts well beyond the bonus token
    target = _stats(engine.router)
    assert target.get(("EXTEND", "piecewise"), 0) > 0 and ("EXTEND", "eager") not in target
    # Verify on the decode graphs, or inside the overlapped step's graph.
    assert sum(target.get(("TARGET_VERIFY", r), 0) for r in GRAPHED) > 0, target
    assert ("TARGET_VERIFY", "eager") not in target
    draft = _stats(engine.draft.router)
    # Greedy chain rounds: the catch-up and every draft step replay the round's graphs (or the
    # overlapped step's, which holds the same bodies).
    assert sum(draft.get(("DRAFT_EXTEND", r), 0) for r in GRAPHED) > 0, draft
    assert sum(draft.get(("DECODE", r), 0) for r in GRAPHED) > 0, draft
    assert ("DECODE", "eager") not in draft
    assert engine.draft.round.info()["captured"]
    assert not any(r == "piecewise" for _, r in draft)  # invariant 5
    kv = info["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]
