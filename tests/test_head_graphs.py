"""A head draft's graphs on CPU: what the engine and the draft asked `build_graphs` for, as
server info and forward stats report it, and which tree verifies get graphs of their own."""

from __future__ import annotations

import os
from collections import Counter

import pytest

import specpcg.engine as engine_module
from specpcg.core import CaptureHiddenMode

from tests.eagle_world import (  # noqa: F401 (fixtures)
    ALGOS, NO_CUDA, world, plain, _engine)


# ---- 5. invariant 4 (and 5) on CPU ---------------------------------------------------------------

@pytest.mark.parametrize("algo", ALGOS)
def test_graph_needs_server_info_and_forward_stats(world, algo, monkeypatch):
    import drafts.wiring as wiring_module

    calls = {}

    def recording(name, build):
        def wrapper(cfg, runner, context_len, **kw):
            calls[name] = (cfg, kw)
            return build(cfg, runner, context_len, **kw)
        return wrapper

    monkeypatch.setattr(engine_module, "build_graphs",
                        recording("target", engine_module.build_graphs))
    monkeypatch.setattr(wiring_module, "build_graphs",
                        recording("draft", wiring_module.build_graphs))
    engine = _engine(world.noisy, algo, world.heads[algo])
    # The target's graphs are built for every hidden state the draft reads (invariant 4) ...
    aux = (1, 3, 4) if algo == "EAGLE3" else ()  # default aux ids (0, 2, 3), as entering ids
    assert engine.draft.needs_hidden == CaptureHiddenMode.FULL
    assert engine.draft.aux_layers == aux
    assert calls["target"][1] == {"hidden_mode": CaptureHiddenMode.FULL, "aux_layers": aux,
                                  "num_verify_tokens": 4, "verify_tree": False}
    # ... and the draft's never include piecewise graphs (invariant 5).
    draft_cfg, draft_kw = calls["draft"]
    assert draft_cfg.disable_piecewise_cuda_graph and not engine.draft.builds_piecewise
    assert draft_kw["hidden_mode"] == CaptureHiddenMode.LAST
    assert engine.draft.graphs.piecewise is None

    out = engine.generate(input_ids=world.prompts[3], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    verify_ct = out["meta_info"]["spec_verify_ct"]
    info = engine.get_server_info()
    assert info["piecewise_cuda_graph"] == {"enabled": False, "reason": NO_CUDA}
    assert info["cuda_graph"] == {"enabled": False, "reason": NO_CUDA}
    draft_info = info["speculative"]["draft"]
    assert draft_info["name"] == algo
    assert draft_info["aux_layer_ids"] == ([0, 2, 3] if algo == "EAGLE3" else [])
    assert draft_info["piecewise_cuda_graph"]["enabled"] is False
    assert draft_info["piecewise_cuda_graph"]["reason"]
    target_stats = {s["mode"]: s for s in info["forward_stats"]}
    assert set(target_stats) == {"EXTEND", "TARGET_VERIFY"}  # no plain DECODE with a draft
    assert target_stats["EXTEND"] == {"mode": "EXTEND", "runner": "eager", "reason": NO_CUDA,
                                      "count": 1}
    assert target_stats["TARGET_VERIFY"] == {"mode": "TARGET_VERIFY", "runner": "eager",
                                             "reason": NO_CUDA, "count": verify_ct}
    draft_stats = engine.draft.router.forward_stats()
    counts = Counter()
    for s in draft_stats:
        counts[s["mode"]] += s["count"]
    assert set(counts) == {"DRAFT_EXTEND", "DECODE"}  # drafts never prefill or verify
    assert counts["DRAFT_EXTEND"] == verify_ct  # one catch-up per round
    assert counts["DECODE"] == (engine.spec.num_steps - 1) * verify_ct
    # The first catch-up (the prompt) runs eagerly; then rounds run the round bodies, eagerly
    # too without CUDA, each saying why.
    assert {s["runner"] for s in draft_stats} == {"eager", "draft_round_eager"}
    assert all(s["reason"] for s in draft_stats)
    assert {s["reason"] for s in draft_stats if s["mode"] == "DECODE"} == {NO_CUDA}


@pytest.mark.parametrize("backend,verify", [("torch", 0), ("triton", 6)])
def test_a_tree_engine_captures_tree_verify_graphs_where_it_can(world, monkeypatch, backend,
                                                                 verify):
    """A tree's verify carries its mask: graphs hold it only on a backend that builds node rows
    from a static mask (Triton); elsewhere no verify width is captured and trees run eagerly."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU needs the interpreter (TRITON_INTERPRET=1)")
    import drafts.wiring as wiring_module

    calls = {}
    for name, module in (("target", engine_module), ("draft", wiring_module)):
        real = module.build_graphs
        monkeypatch.setattr(module, "build_graphs", lambda cfg, runner, ctx_len, _n=name,
                            _real=real, **kw: calls.setdefault(_n, kw) and _real(cfg, runner,
                                                                                 ctx_len, **kw))
    _engine(world.noisy, "EAGLE", world.heads["EAGLE"], speculative_eagle_topk=3,
            speculative_num_steps=3, speculative_num_draft_tokens=6, attention_backend=backend)
    assert calls["target"] == {"hidden_mode": CaptureHiddenMode.FULL, "aux_layers": (),
                               "num_verify_tokens": verify, "verify_tree": bool(verify)}
    # The head's tree steps: graphs of their own where the backend can replay trees.
    assert calls["draft"] == {"hidden_mode": CaptureHiddenMode.FULL,
                              "draft_tree": (3, 3) if verify else (), "draft": True}
