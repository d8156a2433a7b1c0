"""Tensor and pipeline parallelism on CPU (gloo, one process per rank): greedy tokens identical
to one process in fp32, with no speculation and with every algorithm (chains, and an EAGLE3
tree under TP), on a tiny model at tp_size=2, pp_size=2 and both together (and tp 4 with KV
heads replicated, pp 4), and on the default model at tp_size=3 (9 query heads, 3 KV heads) and
pp_size=2; sizes that do not fit the model are refused; a killed rank gives a clear error."""

import os
import signal
import time

from types import SimpleNamespace

import pytest
import torch

from drafts.head_checkpoint import random_head, save_head
from drafts.train_standalone import save_standalone, truncated_model
from specpcg import Engine
from test_train import _tiny_target

GREEDY = {"max_new_tokens": 16, "temperature": 0}
IDS = [[5, 9, 2, 7], [11, 3, 8, 8, 1, 2, 3], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tp")
    target = _tiny_target(root / "target")
    kw = dict(model_path=target, skip_tokenizer_init=True, device="cpu", dtype="float32",
              max_total_tokens=2048, show_progress=False)
    plain = Engine(**kw)
    want = [o["output_ids"] for o in plain.generate(input_ids=IDS, sampling_params=GREEDY)]
    drafts = {}
    for algo in ("EAGLE", "EAGLE3", "NEXTN"):
        head, spec = random_head(algo, plain.model_config, torch.device("cpu"), torch.float32,
                                 draft_vocab_size=96)
        drafts[algo] = save_head(head, spec, plain.model_config, str(root / algo))
    model, cfg = truncated_model(target, 1, torch.device("cpu"))
    drafts["STANDALONE"] = save_standalone(model, cfg, target, str(root / "standalone"))
    plain.shutdown()
    return kw, want, drafts


def _parallel_outputs(kw, **extra):
    engine = Engine(**kw, **extra)
    try:
        return [o["output_ids"] for o in engine.generate(input_ids=IDS, sampling_params=GREEDY)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("algo", [None, "NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"])
def test_tp2_greedy_tokens_match_one_process(tiny, algo):
    kw, want, drafts = tiny
    spec = {} if algo is None else {"speculative_algorithm": algo,
                                    "speculative_draft_model_path": drafts.get(algo)}
    assert _parallel_outputs(kw, tp_size=2, **spec) == want


def test_a_standalone_draft_is_sharded_over_every_tensor_rank(tiny, monkeypatch):
    """Under TP a STANDALONE draft is cut like the target: rank 0 holds its shard (half the
    heads, row-parallel o_proj) and rank 1 the other half, so each draft forward's all-reduces
    need rank 1 to run it too (a rank that skipped one would hang the group); its forwards run
    eagerly (collectives), and the tokens are one process's."""
    from drafts import wiring
    from specpcg.distributed.shard import RowParallelLinear
    from specpcg.graphs.policy import decide_decode_graph

    seen, real = [], wiring.build_graphs
    monkeypatch.setattr(wiring, "build_graphs", lambda cfg, *a, **k: (
        seen.append(decide_decode_graph(cfg, "cuda", "triton", True)), real(cfg, *a, **k))[1])
    kw, want, drafts = tiny
    engine = Engine(**kw, tp_size=2, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=drafts["STANDALONE"], dist_timeout_s=60)
    try:
        got = [o["output_ids"] for o in engine.generate(input_ids=IDS, sampling_params=GREEDY)]
        draft, heads = engine.draft, engine.draft_ctx.model_config.num_heads
        info = engine.get_server_info()["speculative"]["draft"]
        stats = {(s["mode"], s["runner"]) for s in draft.router.forward_stats()}
    finally:
        engine.shutdown()
    assert got == want
    assert draft.model_cfg.num_heads == heads // 2
    assert isinstance(draft.model.model.layers[0].self_attn.o_proj, RowParallelLinear)
    assert draft.round is None and draft.graphs.decode is None
    assert seen and not any(d.enabled for d in seen)  # on a GPU too: collectives in its forward
    assert all("tensor" in d.reason for d in seen), [d.reason for d in seen]
    assert info["tensor_parallel_shards"] == 2, info
    assert ("DECODE", "eager") in stats, stats


def test_a_draft_the_ranks_cannot_split_runs_whole_on_rank_0():
    from types import SimpleNamespace

    from drafts.standalone import shard_refusal

    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert shard_refusal(cfg, 2) is None and shard_refusal(cfg, 4) is None
    assert "does not divide the model's 4 attention heads" in shard_refusal(cfg, 3)
    assert shard_refusal(cfg, 1) == "one tensor-parallel rank"


@pytest.mark.parametrize("algo", ["EAGLE3"])
def test_drafts_take_the_one_gpu_graph_rules_under_tp(tiny, algo, monkeypatch):
    """A head runs on rank 0 alone, whole, with no collective in its forward: its graphs are
    decided as on one GPU (the rule that keeps the target's full decode graphs off under TP/PP
    must not reach it), and its tokens still match one process."""
    from drafts import wiring
    from specpcg.graphs.policy import decide_decode_graph

    seen, real = [], wiring.build_graphs

    def recording(cfg, *args, **kw):
        seen.append(decide_decode_graph(cfg, "cuda", "triton", True))
        return real(cfg, *args, **kw)

    monkeypatch.setattr(wiring, "build_graphs", recording)
    kw, want, drafts = tiny
    assert _parallel_outputs(kw, tp_size=2, speculative_algorithm=algo,
                             speculative_draft_model_path=drafts[algo]) == want
    assert seen and all(d.enabled for d in seen), [d.reason for d in seen]


def test_tp2_eagle3_tree_matches_one_process(tiny):
    kw, want, drafts = tiny
    assert _parallel_outputs(kw, tp_size=2, speculative_algorithm="EAGLE3", attention_backend="torch",
                       speculative_draft_model_path=drafts["EAGLE3"], speculative_num_steps=3,
                       speculative_eagle_topk=2, speculative_num_draft_tokens=5) == want


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path):
    """4 query heads, 2 KV heads, 4 ranks: each KV head lives on two ranks."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(1)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    kw = dict(model_path=str(tmp_path / "m"), skip_tokenizer_init=True, device="cpu",
              dtype="float32", max_total_tokens=1024, show_progress=False)
    want = [o["output_ids"] for o in Engine(**kw).generate(input_ids=IDS, sampling_params=GREEDY)]
    assert _parallel_outputs(kw, tp_size=4) == want


@pytest.mark.slow
def test_default_model_tp3_and_pp2_match_and_tp2_is_refused(tmp_path):
    """The default model (9 query heads, 3 KV heads) at tp 3 and pp 2, with no spec and with
    every algorithm: STANDALONE drafts with the model itself (sharded over the 3 ranks at tp
    3), the heads are random ones of the model's shape."""
    from specpcg.models.loader import default_model_path

    kw = dict(device="cpu", max_total_tokens=2048, show_progress=False)
    prompts = ["The capital of France is", "Water boils at"]
    params = {"max_new_tokens": 8, "temperature": 0}
    one = Engine(**kw)
    want = [o["output_ids"] for o in one.generate(prompt=prompts, sampling_params=params)]
    drafts = {"STANDALONE": default_model_path()}
    for algo in ("EAGLE", "EAGLE3", "NEXTN"):
        head, spec = random_head(algo, one.model_config, torch.device("cpu"), torch.float32,
                                 draft_vocab_size=8192 if algo == "EAGLE3" else 0)
        drafts[algo] = save_head(head, spec, one.model_config, str(tmp_path / algo))
    one.shutdown()
    with pytest.raises(ValueError, match="tp_size=2 does not divide the model's 9 attention"):
        Engine(tp_size=2, **kw)
    for layout in ({"tp_size": 3}, {"pp_size": 2}):
        for algo in (None, "NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"):
            spec = {} if algo is None else {"speculative_algorithm": algo,
                                            "speculative_draft_model_path": drafts.get(algo)}
            engine = Engine(**kw, **layout, **spec)
            try:
                got = [o["output_ids"] for o in engine.generate(prompt=prompts,
                                                                sampling_params=params)]
            finally:
                engine.shutdown()
            assert got == want, (layout, algo)


def test_a_killed_rank_gives_a_clear_error(tiny):
    kw, _, _ = tiny
    engine = Engine(tp_size=2, dist_timeout_s=10, **kw)
    try:
        engine.generate(input_ids=IDS[0], sampling_params={"max_new_tokens": 2})
        worker = engine.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"parallel rank 1 exited \(exit code -9\)"):
            engine.generate(input_ids=IDS[0], sampling_params={"max_new_tokens": 2})
        assert time.time() - t0 < 15
        procs = engine.tp.procs
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in procs)  # no orphan processes


def test_an_idle_engine_outlives_the_collective_timeout(tiny):
    """The other ranks wait for rank 0's next step however long the engine idles (a server
    between requests): dist_timeout_s bounds collectives, not the wait for work. Before, the
    ranks' wait for a message timed out with it and an engine idle that long was dead."""
    kw, want, _ = tiny
    engine = Engine(tp_size=2, dist_timeout_s=10, **kw)
    try:
        first = [o["output_ids"] for o in engine.generate(input_ids=IDS, sampling_params=GREEDY)]
        time.sleep(12)
        again = [o["output_ids"] for o in engine.generate(input_ids=IDS, sampling_params=GREEDY)]
    finally:
        engine.shutdown()
    assert first == again == want


def test_a_rank_that_raises_is_named_with_its_error(tiny):
    """A rank whose forward raises exits; rank 0's next step names the rank and what it raised,
    within seconds, and shutting down leaves no process behind."""
    kw, _, _ = tiny
    engine = Engine(tp_size=2, dist_timeout_s=10, **kw)
    try:
        engine.generate(input_ids=IDS[0], sampling_params={"max_new_tokens": 2})
        engine.tp._send(("forward",))  # a message rank 1 cannot unpack: it raises there
        engine.tp.procs[0].join(timeout=10)
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"parallel rank 1 exited \(exit code 1\) after "
                                               r"ValueError: not enough values to unpack"):
            engine.generate(input_ids=IDS[0], sampling_params={"max_new_tokens": 2})
        assert time.time() - t0 < 15
        procs = engine.tp.procs
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("algo", [None, "NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"])
def test_pp2_greedy_tokens_match_one_process(tiny, algo):
    kw, want, drafts = tiny
    spec = {} if algo is None else {"speculative_algorithm": algo,
                                    "speculative_draft_model_path": drafts.get(algo)}
    assert _parallel_outputs(kw, pp_size=2, **spec) == want


def test_pp4_matches_and_too_many_stages_are_refused(tiny):
    kw, want, _ = tiny
    assert _parallel_outputs(kw, pp_size=4) == want  # one layer per stage
    with pytest.raises(ValueError, match="pp_size=5 must be between 1 and the model's 4 layers"):
        Engine(pp_size=5, **kw)


@pytest.mark.parametrize("algo", [None, "NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"])
def test_tp2_pp2_greedy_tokens_match_one_process(tiny, algo):
    kw, want, drafts = tiny
    spec = {} if algo is None else {"speculative_algorithm": algo,
                                    "speculative_draft_model_path": drafts.get(algo)}
    assert _parallel_outputs(kw, tp_size=2, pp_size=2, **spec) == want


def test_every_rank_reports_its_start_up_and_steps_go_on(tiny):
    """get_server_info()["ranks"]: each rank's place and graph capture cost (none on CPU),
    gathered after the captures; the steps after it still meet on every rank."""
    kw, want, _ = tiny
    engine = Engine(tp_size=2, pp_size=2, **kw)
    try:
        ranks = engine.get_server_info()["ranks"]
        out = [o["output_ids"] for o in engine.generate(input_ids=IDS, sampling_params=GREEDY)]
    finally:
        engine.shutdown()
    assert [(r["rank"], r["stage"], r["tp_rank"]) for r in ranks] == [
        (0, 1, 0), (1, 1, 1), (2, 0, 0), (3, 0, 1)]
    assert all(r["piecewise_cuda_graph"] == {"enabled": False} for r in ranks)
    assert out == want


def _start_node(kw: dict, addr: str, node_rank: int, **layout):
    """Another machine's share of the ranks: `python -m specpcg serve --node-rank K` as its own
    process, as a user starts it on that machine."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "specpcg", "serve", "--model-path", kw["model_path"],
            "--device", "cpu", "--dtype", "float32", "--nnodes", "2",
            "--node-rank", str(node_rank), "--dist-init-addr", addr]
    for name, value in layout.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"tp_size": 2, "pp_size": 2}],
                         ids=["tp2", "tp2xpp2"])
def test_two_nodes_match_one_process(tiny, layout):
    """nnodes=2 on one machine: node 1 (its own command) runs ranks world/2.., node 0 the
    engine and the rest; the greedy tokens are one process's; node 1 exits when node 0 stops."""
    from specpcg.distributed.group import free_init_addr

    kw, want, _ = tiny
    addr = free_init_addr()
    node1 = _start_node(kw, addr, 1, **layout)
    try:
        got = _parallel_outputs(kw, nnodes=2, node_rank=0, dist_init_addr=addr, **layout)
        out, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert got == want
    assert node1.returncode == 0, out


def test_node_layouts_that_cannot_work_are_refused(tiny):
    kw, _, _ = tiny
    with pytest.raises(ValueError, match=r"nnodes=2 must divide tp_size \* pp_size = 3"):
        Engine(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1", **kw)
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes=2\), got 2"):
        Engine(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1", **kw)
    with pytest.raises(ValueError, match="dist_init_addr .* is required with nnodes=2"):
        Engine(tp_size=2, nnodes=2, **kw)
    with pytest.raises(ValueError, match="node_rank=1: the engine runs on node 0"):
        Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1", **kw)


def test_micro_batches_cut_whole_requests_into_balanced_groups():
    from specpcg.core import ForwardBatch, ForwardMode
    from specpcg.distributed.pipeline import micro_batches, sub_batch

    def batch(lens, **kw):
        n, t = len(lens), sum(lens)
        ar = torch.arange
        return ForwardBatch(ForwardMode.EXTEND, ar(t), ar(t), ar(t), ar(n), torch.tensor(lens),
                            torch.tensor(lens), list(lens), list(lens), **kw)

    b = batch([4, 4, 4, 4])
    assert micro_batches(b, 2) == [(0, 2, 0, 8), (2, 4, 8, 16)]
    assert micro_batches(batch([10, 1, 1, 1, 1]), 2) == [(0, 1, 0, 10), (1, 5, 10, 14)]
    assert micro_batches(batch([1, 1, 1]), 4) == [(0, 1, 0, 1), (1, 2, 1, 2), (2, 3, 2, 3)]
    one = [(0, 2, 0, 8)]
    assert micro_batches(batch([4, 4]), 1) == one and micro_batches(batch([8]), 2) == [(0, 1, 0, 8)]
    assert micro_batches(batch([4, 4], req_row_stride=4), 2) == one
    assert micro_batches(batch([4, 4], tree_mask=torch.ones(2, 4, 4)), 2) == one
    part = sub_batch(b, 2, 4, 8, 16)
    assert part.input_ids.tolist() == list(range(8, 16)) and part.seq_lens_cpu == [4, 4]
    assert part.req_pool_indices.tolist() == [2, 3] and part.num_tokens == 8


class _Calls:
    """Stands in for a rank's runner and piecewise graphs: records what was run."""

    def __init__(self):
        self.calls = []

    def forward(self, batch):
        self.calls.append(("forward", batch))

    def replay_body(self, batch):
        self.calls.append(("replay_body", batch))


def test_other_ranks_run_each_forward_the_way_rank_0_runs_it(monkeypatch):
    """A piecewise replay on rank 0 is a replay on every rank (a later pipeline stage stops at
    the body: its outputs went on inside the replay); an eager forward is eager everywhere; a
    route a rank cannot mirror ends that rank with the reason, never a silent other path."""
    from types import SimpleNamespace

    import specpcg.distributed.worker as worker

    stages = []
    monkeypatch.setattr(worker, "_run_stage", lambda runner, batch, like: stages.append(batch))
    runner, pcg = _Calls(), _Calls()
    graphs = SimpleNamespace(piecewise=pcg)
    worker.mirror(runner, graphs, "b1", "piecewise", False, None)
    worker.mirror(runner, graphs, "b2", "piecewise", True, None)
    worker.mirror(runner, graphs, "b3", "eager", False, None)
    worker.mirror(runner, graphs, "b4", "eager", True, None)
    assert pcg.calls == [("forward", "b1"), ("replay_body", "b2")]
    assert runner.calls == [("forward", "b3")] and stages == ["b4"]
    with pytest.raises(RuntimeError, match="did not capture"):
        worker.mirror(runner, SimpleNamespace(piecewise=None), "b5", "piecewise", False, None)
    with pytest.raises(RuntimeError, match="'decode_graph'"):
        worker.mirror(runner, graphs, "b6", "decode_graph", False, None)


def test_the_router_tells_the_other_ranks_which_graph_it_replays():
    from specpcg.core import ForwardMode
    from specpcg.router import ForwardRouter

    told = []

    class Runner(_Calls):
        def before_forward(self, batch, route="eager"):
            told.append((batch.forward_mode, route))

    class Piecewise(_Calls):
        def refusal(self, batch):
            return None

    from types import SimpleNamespace
    router = ForwardRouter(Runner(), Piecewise(), None, {"decode_graph": "off"})
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, rows_pending=False)
    router.forward(batch)
    assert told == [(ForwardMode.EXTEND, "piecewise")]


def test_a_batch_sent_to_other_ranks_travels_on_the_host():
    """TPDriver sends batch.to("cpu") and each rank moves it to its own device: a pickled CUDA
    tensor would arrive on rank 0's GPU. ForwardBatch.to moves every tensor, keeps the rest."""
    from specpcg.core import ForwardBatch, ForwardMode
    from specpcg.distributed.worker import TPDriver

    ids, lens = torch.arange(5), torch.tensor([2, 3])
    batch = ForwardBatch(ForwardMode.EXTEND, ids, ids.clone(), ids.clone(),
                         torch.zeros(2, dtype=torch.long), lens, lens.clone(), [2, 3], [2, 3],
                         tree_mask=torch.ones(2, 1, 1, dtype=torch.bool))
    moved = batch.to("meta")
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                 "extend_seq_lens", "tree_mask"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(batch, name).device.type == "cpu", name
    assert moved.input_hidden is None and moved.seq_lens_cpu == [2, 3]

    sent, driver = [], object.__new__(TPDriver)
    driver._send = sent.append
    driver.kv_cache = SimpleNamespace(req_pool=SimpleNamespace(
        req_to_token=torch.arange(40).view(4, 10)))
    driver.before_forward(batch, "eager")
    kind, copy, rows, table, route = sent[0]
    assert (kind, route) == ("forward", "eager") and copy is not batch
    assert torch.equal(copy.input_ids, batch.input_ids)
    assert rows.tolist() == [0, 0] and table.shape == (2, 3)


def test_rank_0_runs_the_last_stage_where_sampling_and_drafts_are(tiny_path):
    """The final hidden states arise on rank 0, which samples and drafts: its group runs the
    last stage; ranks tp .. 2 tp - 1 the first (which embeds), and on in order."""
    from specpcg.config import EngineConfig
    from specpcg.distributed.pipeline import rank_of, stage_of
    from specpcg.distributed.worker import shard_of
    from specpcg.models.loading import load_target

    for tp, pp in ((1, 2), (1, 4), (2, 2), (3, 3)):
        stages = [stage_of(r, tp, pp) for r in range(tp * pp)]
        assert stages[:tp] == [pp - 1] * tp and stages[tp:2 * tp] == [0] * tp
        assert all(rank_of(stage_of(r, tp, pp), tp, pp, r % tp) == r for r in range(tp * pp))
    cfg = EngineConfig(model_path=str(tiny_path), skip_tokenizer_init=True, pp_size=2)
    full, full_cfg, _ = load_target(cfg, torch.device("cpu"), torch.float32)
    last, _ = shard_of(full, full_cfg, cfg, 0)
    first, _ = shard_of(full, full_cfg, cfg, 1)
    layers = full_cfg.num_layers
    assert (last.stage, last.end) == (1, layers) and (first.stage, first.start) == (0, 0)
    assert first.end == last.start == layers // 2
