"""Router decisions for every guard, and the graph configuration rules, with their reasons."""

from types import SimpleNamespace

import pytest
import torch

from specpcg import Engine
from specpcg.config import EngineConfig
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.graphs.decode_runner import DecodeGraphRunner
from specpcg.graphs.piecewise_runner import PiecewiseRunner
from specpcg.graphs.policy import decide_decode_graph, decide_piecewise, piecewise_serves_decode
from specpcg.router import EAGER, ForwardRouter, Refusal

NULL, LAST, FULL = CaptureHiddenMode.NULL, CaptureHiddenMode.LAST, CaptureHiddenMode.FULL


def _batch(mode, ext_lens, hidden=NULL, aux=(), all_logits=False):
    n = sum(ext_lens)
    return ForwardBatch(
        forward_mode=mode, input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(n, dtype=torch.long), out_cache_loc=torch.zeros(n, dtype=torch.long),
        req_pool_indices=torch.zeros(len(ext_lens), dtype=torch.long),
        seq_lens=torch.tensor(ext_lens), extend_seq_lens=torch.tensor(ext_lens),
        seq_lens_cpu=list(ext_lens), extend_seq_lens_cpu=list(ext_lens),
        capture_hidden_mode=hidden, aux_hidden_layers=aux, return_all_logits=all_logits)


def _piecewise(max_tokens=64, hidden=NULL, aux=(), decode_modes=False):
    # Built without capture: refusal() reads only what the runner declares it captured.
    r = PiecewiseRunner.__new__(PiecewiseRunner)
    r.buckets, r.hidden_mode, r.aux_layers = [4, 8, max_tokens], hidden, aux
    if decode_modes:
        r.modes = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    return r


def _decode(max_bs=8, hidden=NULL, verify=4, aux=(), tree=False):
    r = DecodeGraphRunner.__new__(DecodeGraphRunner)
    r.buckets, r.hidden_mode, r.aux_layers = [1, 2, 4, max_bs], hidden, aux
    r.tree_keys = {ForwardMode.TARGET_VERIFY: (verify,)} if tree else {}
    r.tokens_per_req = {ForwardMode.DECODE: 1}
    if verify:
        r.tokens_per_req[ForwardMode.TARGET_VERIFY] = verify
    return r


def _router(pcg=None, dec=None, reasons=None):
    return ForwardRouter(SimpleNamespace(forward=lambda b: "eager-out"), pcg, dec, reasons)


@pytest.mark.parametrize("batch,expected", [
    (_batch(ForwardMode.EXTEND, [10, 20]), ("piecewise", None)),
    (_batch(ForwardMode.EXTEND, [40, 40]), (EAGER, Refusal.TOO_MANY_TOKENS)),
    (_batch(ForwardMode.EXTEND, [5], all_logits=True), (EAGER, Refusal.INPUT_LOGPROBS)),
    (_batch(ForwardMode.EXTEND, [5], hidden=FULL), (EAGER, Refusal.HIDDEN_MODE_NOT_CAPTURED)),
    (_batch(ForwardMode.EXTEND, [5], aux=(1,)), (EAGER, Refusal.AUX_LAYERS_NOT_CAPTURED)),
    (_batch(ForwardMode.DECODE, [1, 1, 1]), ("decode_graph", None)),
    (_batch(ForwardMode.DECODE, [1] * 9), (EAGER, Refusal.TOO_MANY_REQUESTS)),
    (_batch(ForwardMode.DECODE, [1], hidden=LAST), (EAGER, Refusal.HIDDEN_MODE_NOT_CAPTURED)),
    (_batch(ForwardMode.TARGET_VERIFY, [4, 4]), ("decode_graph", None)),
    (_batch(ForwardMode.TARGET_VERIFY, [4, 3]), (EAGER, Refusal.TOKENS_PER_REQUEST)),
    (_batch(ForwardMode.DRAFT_EXTEND, [2]), (EAGER, Refusal.MODE_NOT_CAPTURED)),
])
def test_router_guards(batch, expected):
    assert _router(_piecewise(), _decode()).choose(batch) == expected


def _tree_verify(ext_lens, keys=None):
    width = ext_lens[0]
    batch = _batch(ForwardMode.TARGET_VERIFY, ext_lens)
    batch.tree_mask = torch.ones(len(ext_lens), width, keys or width, dtype=torch.bool).tril()
    return batch


def test_tree_verify_replays_only_a_tree_graph():
    """A runner captured for chains refuses a tree (its graphs hold chain attention); a runner
    captured for trees replays trees of its width and refuses chains and other shapes."""
    chains = _router(_piecewise(), _decode())
    assert chains.choose(_tree_verify([4, 4])) == (EAGER, Refusal.TREE_MASK)
    assert chains.forward(_tree_verify([4, 4])) == "eager-out"
    assert chains.choose(_batch(ForwardMode.TARGET_VERIFY, [4, 4])) == ("decode_graph", None)
    trees = _router(_piecewise(), _decode(tree=True))
    assert trees.choose(_tree_verify([4, 4])) == ("decode_graph", None)
    assert trees.choose(_tree_verify([4] * 9)) == (EAGER, Refusal.TOO_MANY_REQUESTS)
    assert trees.choose(_tree_verify([4, 4], keys=6)) == (EAGER, Refusal.TREE_MASK)
    assert trees.choose(_batch(ForwardMode.TARGET_VERIFY, [4, 4])) == (
        EAGER, Refusal.CHAIN_NOT_CAPTURED)
    assert trees.choose(_batch(ForwardMode.DECODE, [1, 1])) == ("decode_graph", None)
    # A draft's tree step is in a mode no graph captures, whatever it carries.
    step = _batch(ForwardMode.DRAFT_EXTEND, [3, 3])
    step.tree_mask = torch.ones(2, 3, 6, dtype=torch.bool)
    assert trees.choose(step) == (EAGER, Refusal.MODE_NOT_CAPTURED)
    stats = {(s["mode"], s["reason"]): s["count"] for s in chains.forward_stats()}
    assert stats == {("TARGET_VERIFY", "tree_mask_not_captured"): 1}


def test_target_verify_never_replays_piecewise():
    router = _router(_piecewise(), None, {"decode_graph": "disable_cuda_graph is set"})
    # Small enough for a piecewise bucket, but the mode is not one piecewise graphs capture.
    assert _piecewise().refusal(_batch(ForwardMode.TARGET_VERIFY, [4])) == Refusal.MODE_NOT_CAPTURED
    assert router.choose(_batch(ForwardMode.TARGET_VERIFY, [4])) == (EAGER, "disable_cuda_graph is set")


def test_full_capture_serves_smaller_hidden_requests():
    router = _router(_piecewise(hidden=FULL, aux=(1, 5, 9)), _decode(hidden=FULL))
    for hidden in (NULL, LAST, FULL):
        assert router.choose(_batch(ForwardMode.EXTEND, [6], hidden=hidden, aux=(1, 9)))[0] == "piecewise"
        assert router.choose(_batch(ForwardMode.DECODE, [1], hidden=hidden))[0] == "decode_graph"


def test_verify_not_captured_when_width_zero():
    router = _router(None, _decode(verify=0), {"piecewise": "off"})
    assert router.choose(_batch(ForwardMode.TARGET_VERIFY, [4])) == (EAGER, Refusal.MODE_NOT_CAPTURED)


def test_disabled_runner_reason_and_counters(caplog):
    router = _router(None, None, {"piecewise": "no CUDA device (device is cpu)"})
    with caplog.at_level("INFO", logger="specpcg.router"):
        for _ in range(3):
            assert router.forward(_batch(ForwardMode.EXTEND, [3])) == "eager-out"
    assert router.forward_stats() == [{"mode": "EXTEND", "runner": "eager", "count": 3,
                                       "reason": "no CUDA device (device is cpu)"}]
    assert sum("EXTEND runs eagerly" in r.message for r in caplog.records) == 1  # logged once


def _cfg(**kw):
    base = dict(disable_piecewise_cuda_graph=False, disable_cuda_graph=False,
                enforce_piecewise_cuda_graph=False, pp_size=1, tp_size=1,
                piecewise_cuda_graph_max_tokens=4096)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,device,enabled,reason", [
    ({}, "cuda", True, "enabled by default on CUDA"),
    ({}, "cpu", False, "no CUDA device (device is cpu)"),
    ({"disable_piecewise_cuda_graph": True}, "cuda", False, "disable_piecewise_cuda_graph is set"),
    ({"disable_cuda_graph": True}, "cuda", False, "disable_cuda_graph is set"),
    # Piecewise graphs stay on under pipeline and tensor parallelism: every rank captures
    # them in lockstep, with the stage exchanges and collectives between segments.
    ({"pp_size": 2}, "cuda", True, "enabled by default on CUDA"),
    ({"tp_size": 2, "pp_size": 2}, "cuda", True, "enabled by default on CUDA"),
    ({"piecewise_cuda_graph_max_tokens": 2}, "cuda", False,
     "piecewise_cuda_graph_max_tokens=2 is below the smallest bucket (4 tokens)"),
    ({"piecewise_cuda_graph_max_tokens": 2, "enforce_piecewise_cuda_graph": True}, "cuda", True,
     "enforced by enforce_piecewise_cuda_graph"),
    ({"enforce_piecewise_cuda_graph": True}, "cpu", False, "no CUDA device (device is cpu)"),
    ({"tp_size": 2, "enforce_piecewise_cuda_graph": True}, "cuda", True,
     "enforced by enforce_piecewise_cuda_graph"),
])
def test_piecewise_rules(kw, device, enabled, reason):
    decision = decide_piecewise(_cfg(**kw), device)
    assert (decision.enabled, decision.reason) == (enabled, reason)


def test_decode_graph_rules():
    assert decide_decode_graph(_cfg(), "cuda", "triton", True).enabled
    off = decide_decode_graph(_cfg(), "cuda", "torch", False)
    assert not off.enabled and "'torch' cannot be captured" in off.reason
    assert decide_decode_graph(_cfg(disable_cuda_graph=True), "cuda", "triton", True).reason == \
        "disable_cuda_graph is set"
    for kw in ({"tp_size": 2}, {"pp_size": 2}):
        off = decide_decode_graph(_cfg(**kw), "cuda", "triton", True)
        assert not off.enabled and off.reason.startswith("tensor or pipeline parallelism: "
                                                         "collectives and stage exchanges")


def test_piecewise_graphs_serve_decode_only_where_no_full_decode_graph_is():
    on, tp = _cfg(), _cfg(tp_size=2)
    pcg = decide_piecewise(tp, "cuda")
    assert piecewise_serves_decode(pcg, decide_decode_graph(tp, "cuda", "triton", True))
    assert piecewise_serves_decode(pcg, decide_decode_graph(on, "cuda", "torch", False))
    assert not piecewise_serves_decode(pcg, decide_decode_graph(on, "cuda", "triton", True))
    pp = _cfg(pp_size=2)  # one micro-batch per graph: eager micro-batches keep stages busy
    assert not piecewise_serves_decode(decide_piecewise(pp, "cuda"),
                                       decide_decode_graph(pp, "cuda", "triton", True), 2)
    off = decide_piecewise(_cfg(disable_piecewise_cuda_graph=True, tp_size=2), "cuda")
    assert not piecewise_serves_decode(off, decide_decode_graph(tp, "cuda", "triton", True))
    none = _cfg(disable_cuda_graph=True)
    assert not piecewise_serves_decode(decide_piecewise(none, "cuda"),
                                       decide_decode_graph(none, "cuda", "triton", True))


def test_decode_steps_and_verifies_replay_piecewise_graphs_that_serve_them():
    """Under tensor parallelism (no full decode graph) decode steps and verifies
    replay the piecewise graphs; a head's tree steps and strided rows do not."""
    reason = decide_decode_graph(_cfg(tp_size=2), "cuda", "triton", True).reason
    router = _router(_piecewise(decode_modes=True), None, {"decode_graph": reason})
    assert router.choose(_batch(ForwardMode.DECODE, [1] * 9)) == ("piecewise", None)
    verify = _batch(ForwardMode.TARGET_VERIFY, [4, 4], aux=(), all_logits=True)
    assert router.choose(verify) == ("piecewise", None)
    assert router.choose(_batch(ForwardMode.DECODE, [1] * 65)) == (EAGER, Refusal.TOO_MANY_TOKENS)
    assert router.choose(_batch(ForwardMode.DRAFT_EXTEND, [2])) == (EAGER, reason)
    strided = _batch(ForwardMode.TARGET_VERIFY, [4, 4], all_logits=True)
    strided.req_row_stride = 5
    assert router.choose(strided) == (EAGER, Refusal.TOKENS_PER_REQUEST)
    extend = _batch(ForwardMode.EXTEND, [5], all_logits=True)  # input logprobs: still eager
    assert router.choose(extend) == (EAGER, Refusal.INPUT_LOGPROBS)
    # Piecewise graphs that serve EXTEND alone leave decode steps to the decode graph's reason.
    plain = _router(_piecewise(), None, {"decode_graph": reason})
    assert plain.choose(_batch(ForwardMode.DECODE, [1])) == (EAGER, reason)


def test_engine_on_cpu_reports_graphs_off_and_counts_eager(tmp_path):
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    # Overlap off: with it a finishing batch runs one more decode step (its token dropped).
    engine = Engine(model_path=str(tmp_path), skip_tokenizer_init=True, device="cpu",
                    dtype="float32", max_total_tokens=256, disable_overlap_schedule=True)
    engine.generate(input_ids=[[1, 2], [3, 4, 5]], sampling_params={"max_new_tokens": 3,
                                                                   "ignore_eos": True})
    info = engine.get_server_info()
    assert info["piecewise_cuda_graph"] == {"enabled": False,
                                            "reason": "no CUDA device (device is cpu)"}
    stats = {(s["mode"], s["runner"]): s["count"] for s in info["forward_stats"]}
    assert stats == {("EXTEND", "eager"): 1, ("DECODE", "eager"): 2}


def test_bad_parallel_sizes_are_refused():
    with pytest.raises(ValueError, match="pp_size must be a positive integer, got 0"):
        EngineConfig(pp_size=0)
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got -1"):
        EngineConfig(tp_size=-1)
