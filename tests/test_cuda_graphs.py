"""Graph = eager on the GPU: every captured bucket (piecewise and decode, with padding), graphs on
and off give the same greedy tokens, and forward_stats shows which runner served each forward."""

import pytest
import torch

from specpcg import Engine
from specpcg.core import ForwardMode, Request, SamplingParams
from specpcg.graphs.decode_runner import DecodeGraphRunner
from specpcg.batch import make_batch

pytestmark = pytest.mark.cuda
TOL = 2e-3  # fp32 engine, TF32 off: graph and eager differ only by kernel choice at padded shapes


@pytest.fixture(scope="module")
def engine():
    torch.backends.cuda.matmul.allow_tf32 = False
    return Engine(device="cuda", dtype="float32", piecewise_cuda_graph_max_tokens=1024,
                  cuda_graph_max_bs=16, max_total_tokens=65536)


def _new_reqs(engine, lens, prefill=0):
    reqs = []
    for i, n in enumerate(lens):
        ids = [(7 * i + 13 * j) % 1000 + 10 for j in range(n)]
        r = Request(prompt_ids=ids, params=SamplingParams())
        r.req_pool_idx = engine.kv_cache.new_request()
        reqs.append(r)
    return reqs


def _release(engine, reqs):
    for r in reqs:
        engine.kv_cache.release(r.req_pool_idx)


def _extend(engine, lens):
    reqs = _new_reqs(engine, lens)
    for r in reqs:
        engine.kv_cache.extend(r.req_pool_idx, len(r.prompt_ids))
    batch = make_batch(engine.kv_cache, ForwardMode.EXTEND, reqs, [r.prompt_ids for r in reqs],
                       engine.device)
    return reqs, batch


def test_every_piecewise_bucket_equals_eager(engine):
    pcg = engine.graphs.piecewise
    assert pcg is not None and engine.get_server_info()["piecewise_cuda_graph"]["enabled"]
    for n in pcg.buckets:
        lens = [n - 1] if n < 8 else [n // 2, n - n // 2 - 1]  # one padded token
        reqs, batch = _extend(engine, lens)
        assert engine.router.choose(batch) == ("piecewise", None)
        eager = engine.runner.forward(batch).logits
        graph = pcg.forward(batch).logits
        diff = (graph - eager).abs().max().item()
        assert diff < TOL, f"bucket {n}: max abs diff {diff}"
        _release(engine, reqs)


def _decode_batch(engine, bs, width):
    reqs, batch = _extend(engine, [5 + 3 * i for i in range(bs)])
    engine.runner.forward(batch)  # prefill their KV
    for r in reqs:
        r.num_cached = len(r.prompt_ids)
        engine.kv_cache.extend(r.req_pool_idx, width)
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    new = [[(11 * k + r.rid) % 500 + 3 for k in range(width)] for r in reqs]
    b = make_batch(engine.kv_cache, mode, reqs, new, engine.device)
    b.return_all_logits = width > 1
    return reqs, b


@pytest.mark.parametrize("width", [1, 4])
def test_every_decode_and_verify_bucket_equals_eager(engine, width):
    runner = engine.graphs.decode
    if width > 1:  # verify graphs of width 4 (the spec loop's default draft tokens)
        runner = DecodeGraphRunner(engine.runner, runner.buckets, runner.hidden_mode, (),
                                   torch.cuda.graph_pool_handle(), num_verify_tokens=4,
                                   show_progress=False)
        runner.capture()
    for bs in runner.buckets:
        real_bs = max(1, bs - 1)  # padding by one request where possible
        reqs, batch = _decode_batch(engine, real_bs, width)
        assert runner.refusal(batch) is None
        eager = engine.runner.forward(batch)
        graph = runner.forward(batch)
        got, want = (graph.all_logits, eager.all_logits) if width > 1 else (graph.logits, eager.logits)
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"bs {bs} width {width}: max abs diff {diff}"
        _release(engine, reqs)
    kv = engine.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]


def _random_trees(bs: int, width: int, device):
    """Trees of `width` nodes (node 0 the root), each node's parent an earlier node."""
    from kernels.tree import tree_from_parents

    gen = torch.Generator().manual_seed(bs)
    parents = torch.full((bs, width), -1, dtype=torch.long)
    for j in range(1, width):
        parents[:, j] = torch.randint(0, j, (bs,), generator=gen)
    tokens = torch.randint(3, 500, (bs, width), generator=gen)
    return tree_from_parents(tokens.to(device), parents.to(device))


def test_every_tree_verify_bucket_equals_eager(engine):
    """Tree verify graphs (topk > 1): the static mask buffer and node rows give what the eager
    tree verify gives, for every bucket, with padded requests attending as a chain."""
    width = 6
    runner = DecodeGraphRunner(engine.runner, engine.graphs.decode.buckets, engine.graphs.decode.hidden_mode,
                               (), torch.cuda.graph_pool_handle(), num_verify_tokens=width,
                               verify_tree=True, show_progress=False)
    runner.capture()
    for bs in runner.buckets:
        real_bs = max(1, bs - 1)
        reqs, batch = _decode_batch(engine, real_bs, width)
        tree = _random_trees(real_bs, width, engine.device)
        prefix = torch.tensor([r.num_cached for r in reqs], device=engine.device)
        batch.input_ids = tree.draft_tokens.reshape(-1)
        batch.positions = (prefix[:, None] + tree.depths).flatten()
        batch.tree_mask = tree.tree_mask
        assert runner.refusal(batch) is None
        eager = engine.runner.forward(batch).all_logits
        graph = runner.forward(batch).all_logits
        diff = (graph - eager).abs().max().item()
        assert diff < TOL, f"bs {bs}: max abs diff {diff}"
        _release(engine, reqs)


def _token_gap(engine, ids, a, b) -> float:
    """|logit(a) - logit(b)| after `ids`, from the eager path of `engine`, in bf16 ulps at the
    logits' magnitude (bf16 keeps 8 significant bits: near 30 its step is 0.125)."""
    import math

    from tests.test_model_parity import _prefill_logits

    logits = _prefill_logits(engine, [ids])[-1].float()
    gap = (logits[a] - logits[b]).abs().item()
    magnitude = max(logits[a].abs().item(), logits[b].abs().item(), 1e-3)
    ulp = 2.0 ** (math.floor(math.log2(magnitude)) - 7)
    print(f"logit gap {gap:.3f} = {gap / ulp:.1f} bf16 ulps")
    return gap / ulp


NEAR_TIE_ULPS = 2  # a divergence is a near-tie when the two logits are within 2 bf16 steps


def _on_off(dtype):
    from specpcg.gsm8k import build_prompts

    prompts, _ = build_prompts(20, num_shots=1)
    params = {"max_new_tokens": 48, "temperature": 0}
    kw = {"device": "cuda", "dtype": dtype, "max_total_tokens": 32768}
    on, off = Engine(cuda_graph_max_bs=32, **kw), Engine(disable_cuda_graph=True, **kw)
    outs = [[o for o in e.generate(prompt=prompts, sampling_params=params)] for e in (on, off)]
    return on, off, outs[0], outs[1], prompts


def test_graphs_on_off_identical_fp32_and_stats():
    torch.backends.cuda.matmul.allow_tf32 = False
    on, off, out_on, out_off, _ = _on_off("float32")
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(out_on, out_off))
    print(f"graphs on/off identical greedy outputs (fp32): {same}/20")
    assert same == 20
    by_runner = {(s["mode"], s["runner"]): s["count"] for s in on.get_server_info()["forward_stats"]}
    assert by_runner.get(("EXTEND", "eager"), 0) == 0 and by_runner[("EXTEND", "piecewise")] > 0
    assert by_runner.get(("DECODE", "eager"), 0) == 0 and by_runner[("DECODE", "decode_graph")] > 0
    off_stats = {(s["mode"], s["runner"], s["reason"]) for s in off.get_server_info()["forward_stats"]}
    assert ("EXTEND", "eager", "disable_cuda_graph is set") in off_stats


def test_graphs_on_off_bf16_differ_only_at_near_ties():
    on, off, out_on, out_off, prompts = _on_off("bfloat16")
    same = 0
    for a, b, prompt in zip(out_on, out_off, prompts):
        x, y = a["output_ids"], b["output_ids"]
        if x == y:
            same += 1
            continue
        k = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
        print(f"divergence at token {k}")
        assert _token_gap(off, off.tokenizer.encode(prompt) + y[:k], x[k], y[k]) <= NEAR_TIE_ULPS
    print(f"graphs on/off identical greedy outputs (bf16): {same}/20")
    assert same >= 16


def test_piecewise_graphs_serve_decode_where_no_full_decode_graph_can():
    """The torch attention backend cannot be captured in a full decode graph (as under tensor or
    pipeline parallelism, no full decode graph is built): decode steps and verifies replay the
    piecewise graphs, equal to eager per bucket, and an NGRAM engine's greedy tokens equal an
    eager engine's (fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(device="cuda", dtype="float32", attention_backend="torch", max_total_tokens=32768,
              piecewise_cuda_graph_max_tokens=256, speculative_algorithm="NGRAM",
              speculative_num_steps=3, speculative_num_draft_tokens=4,
              disable_adaptive_speculation=True)
    on, off = Engine(**kw), Engine(disable_cuda_graph=True, **kw)
    info = on.get_server_info()
    assert not info["cuda_graph"]["enabled"]
    assert info["piecewise_cuda_graph"]["modes"] == ["EXTEND", "DECODE", "TARGET_VERIFY"]
    for width in (1, 4):
        for bs in (1, 3, 17):
            reqs, batch = _decode_batch(on, bs, width)
            assert on.router.choose(batch) == ("piecewise", None)
            eager = on.runner.forward(batch)
            graph = on.graphs.piecewise.forward(batch)
            got, want = ((graph.all_logits, eager.all_logits) if width > 1
                         else (graph.logits, eager.logits))
            assert (got - want).abs().max().item() < TOL, (bs, width)
            _release(on, reqs)
    prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(6)]
    # Plain-text prompts make the instruct model stop at once: ignore_eos keeps it decoding.
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = [[o["output_ids"] for o in e.generate(prompt=prompts, sampling_params=params)]
            for e in (on, off)]
    assert outs[0] == outs[1] and all(len(o) == 24 for o in outs[0])
    stats = {(s["mode"], s["runner"]) for s in on.get_server_info()["forward_stats"]}
    assert ("TARGET_VERIFY", "piecewise") in stats and ("TARGET_VERIFY", "eager") not in stats
    on.shutdown()
    off.shutdown()
