"""Overlapped speculative steps (specpcg/speculative/overlap.py): the host queues step n + 1
from step n's results on the device. Token for token the synchronous loop's outputs, with the
same acceptance, and every KV slot given back.

On the synthetic EAGLE world (tests/eagle_world.py: a noisy target, so drafts are sometimes
rejected; three requests stop at EOS inside an accepted run, the others at different lengths),
through the Triton backend (the one that plans from device tensors) in the interpreter.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from specpcg.speculative.overlap import SpecOverlap
from tests.eagle_world import ALGOS, TREE, _check_no_leak, _engine, same_as_sync
from tests.eagle_world import plain, world  # noqa: F401 (fixtures)

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and the interpreter (TRITON_INTERPRET=1)")


def _run(world, algo, **kw):
    engine = _engine(world.noisy, algo, world.heads[algo], attention_backend="triton", **kw)
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    return engine, outs


def _count_steps(monkeypatch) -> list:
    steps = []
    real = SpecOverlap.step
    monkeypatch.setattr(SpecOverlap, "step", lambda self: steps.append(1) or real(self))
    return steps


def _pad_every_step(monkeypatch) -> list:
    """Every step runs at a bucket past its batch, as on a GPU, with padding rows after the
    batch (on the caches' padding rows, at position 0); returns the (batch, bucket) sizes."""
    from specpcg.speculative.step_graph import SpecStepGraphs

    sizes = []

    def padded(self, n):
        bs = min(2 * n + 1, self.buckets[-1])
        sizes.append((n, bs))
        return bs if bs > n else None

    monkeypatch.setattr(SpecStepGraphs, "bucket", padded)
    return sizes


@needs_interpreter
@pytest.mark.parametrize("algo", ALGOS)
def test_overlapped_steps_emit_the_synchronous_tokens(world, algo, monkeypatch):
    """EAGLE3's steps also run padded (_pad_every_step): the real rows keep the synchronous
    loop's tokens and acceptance, and the padding rows never move."""
    _, sync = _run(world, algo, disable_overlap_schedule=True)
    steps = _count_steps(monkeypatch)
    sizes = _pad_every_step(monkeypatch) if algo == "EAGLE3" else None
    engine, over = _run(world, algo)
    assert len(steps) > 5, "no speculative step was overlapped"
    assert engine.get_server_info()["speculative"]["overlapped_steps"] == len(steps)
    hist = same_as_sync(over, sync, 4)
    assert hist[0] > 0 and sum(hist[1:]) > 0, "the world should both accept and reject drafts"
    if sizes is not None:
        assert any(bs > n for n, bs in sizes)
        state = engine.scheduler.spec_overlap.graphs.state
        assert not state.live.all() and state.live.any()
        assert not state.prefix[~state.live].any(), "a padding row moved off position 0"
    _check_no_leak(engine)


@needs_interpreter
def test_overlapped_tree_steps_emit_the_synchronous_tokens(world, monkeypatch):
    """A head's trees: the step graph verifies the tree, moves the accepted path's KV to the
    verify's first positions (the host mirrors it when it reads the step), and the next round
    catches up on the path's hidden states."""
    algo = "EAGLE3"
    tree = {k: v for k, v in TREE.items() if k != "attention_backend"}  # _run takes triton
    _, sync = _run(world, algo, disable_overlap_schedule=True, **tree)
    steps = _count_steps(monkeypatch)
    engine, over = _run(world, algo, **tree)
    assert len(steps) > 5, "no tree step was overlapped"
    hist = same_as_sync(over, sync, 4)
    assert hist[0] > 0 and sum(hist[2:]) > 0
    _check_no_leak(engine)


def test_path_first_puts_the_accepted_nodes_first_in_path_order():
    import torch

    from kernels.step_commit import path_first

    accept_index = torch.tensor([[0, 2, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1],
                                 [0, 1, 2, 3, 4, 5]])
    order = path_first(accept_index, torch.tensor([2, 0, 5]))
    assert order.tolist() == [[0, 2, 5, 1, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]


@needs_interpreter
def test_overlapped_standalone_steps_emit_the_synchronous_tokens(world, monkeypatch):
    """STANDALONE: the noise-free target drafts for the noisy one, its catch-up fed only the
    path past the drafts it fed (prompts of 1 and 2 tokens included)."""
    def run(**kw):
        engine = _engine(world.noisy, "STANDALONE", world.exact, attention_backend="triton",
                         speculative_num_steps=3, **kw)
        return engine, engine.generate(input_ids=world.prompts, sampling_params=world.params)

    _, sync = run(disable_overlap_schedule=True)
    steps = _count_steps(monkeypatch)
    engine, over = run()
    assert len(steps) > 5, "no STANDALONE step was overlapped"
    hist = same_as_sync(over, sync, 4)
    assert hist[3] > 0 and sum(hist[:3]) > 0, "the world should both accept all and reject"
    kv, draft_kv = engine.get_server_info()["kv_cache"], engine.draft.kv_cache.info()
    assert kv["free_slots"] == kv["total_slots"]
    assert draft_kv["free_slots"] == draft_kv["total_slots"]


@needs_interpreter
def test_sampled_requests_take_the_synchronous_step(world, monkeypatch):
    """A sampled request draws from its generator on the host: no overlapped step runs, and a
    seeded request gives the same tokens with overlap on or off."""
    params = [{**p, "temperature": 0.8, "seed": 7} for p in world.params[:4]]
    algo = "EAGLE3"
    sync = _engine(world.noisy, algo, world.heads[algo], attention_backend="triton",
                   disable_overlap_schedule=True).generate(input_ids=world.prompts[:4],
                                                           sampling_params=params)
    steps = _count_steps(monkeypatch)
    engine = _engine(world.noisy, algo, world.heads[algo], attention_backend="triton")
    over = engine.generate(input_ids=world.prompts[:4], sampling_params=params)
    assert not steps
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in sync]
    _check_no_leak(engine)


@needs_interpreter
def test_a_request_arriving_mid_run_flushes_the_step_in_flight(world, monkeypatch):
    """Requests sent one after another into a running engine: each arrival resolves the step in
    flight before its prefill; outputs match the synchronous loop's."""
    algo = "EAGLE"
    sync_engine = _engine(world.noisy, algo, world.heads[algo], attention_backend="triton",
                          disable_overlap_schedule=True)
    engine = _engine(world.noisy, algo, world.heads[algo], attention_backend="triton")
    flushes = []
    real = SpecOverlap.flush
    monkeypatch.setattr(SpecOverlap, "flush", lambda self: flushes.append(
        self.inflight is not None) or real(self))
    outs = {}
    for name, eng in (("sync", sync_engine), ("over", engine)):
        rids, done = [], {}
        for i in range(4):  # request 0 alone for a few steps, then the others one by one
            rids.append(eng.submit(input_ids=world.prompts[i], sampling_params=world.params[i]))
            for _ in range(6 if i == 0 else 3):
                done.update({o["meta_info"]["id"]: o["output_ids"] for o in eng.step()})
        while eng.has_unfinished():
            done.update({o["meta_info"]["id"]: o["output_ids"] for o in eng.step()})
        outs[name] = [done[r] for r in rids]
    assert outs["over"] == outs["sync"]
    assert any(flushes), "no arrival found a step in flight"
    _check_no_leak(engine)


@pytest.mark.cuda
@pytest.mark.parametrize("algo,setting", [("EAGLE3", (7, 1, 8)), ("EAGLE3", (5, 4, 8)),
                                          ("NGRAM", (7, 1, 8)), ("NGRAM", (5, 4, 8)),
                                          ("STANDALONE", (3, 1, 4))])
def test_gpu_overlap_is_bitwise_the_synchronous_loop_in_deterministic_mode(algo, setting):
    """bf16 on the GPU with graphs (a trained EAGLE3 head's chain and tree, NGRAM's chain and
    trie matched on the device, the default model drafting for itself): in the batch-invariant
    mode the overlapped loop gives exactly the synchronous loop's tokens and acceptance (a
    finished request rides along one extra step there, which the mode makes harmless), and
    the steps did overlap."""
    from specpcg import Engine
    from specpcg.gsm8k import build_prompts
    from specpcg.models.loader import default_model_path
    from tests.gpu_drafts import gpu_draft

    prompts = build_prompts(48, num_shots=0)[0]
    params = [{"max_new_tokens": 48 + 8 * (i % 5), "temperature": 0} for i in range(48)]
    draft = {"EAGLE3": lambda: gpu_draft("EAGLE3"), "NGRAM": lambda: None,
             "STANDALONE": default_model_path}[algo]()
    steps, topk, tokens = setting
    runs = {}
    for mode in ("sync", "overlap"):
        engine = Engine(device="cuda", max_total_tokens=65536, speculative_algorithm=algo,
                        speculative_draft_model_path=draft, speculative_num_steps=steps,
                        speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                        enable_deterministic_inference=True, disable_adaptive_speculation=True,
                        disable_overlap_schedule=mode == "sync", show_progress=False)
        outs = engine.generate(prompt=prompts, sampling_params=params)
        overlapped = engine.get_server_info()["speculative"]["overlapped_steps"]
        assert (overlapped is None) if mode == "sync" else overlapped > 20, overlapped
        runs[mode] = outs
        stats = {(s["mode"], s["runner"]): s["count"] for s in engine.router.forward_stats()}
        runner = "spec_step_graph" if mode == "overlap" else "decode_graph"
        assert stats.get(("TARGET_VERIFY", runner), 0) > 0, stats
        engine.shutdown()
    sync, over = runs["sync"], runs["overlap"]
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in sync]
    assert [o["meta_info"]["spec_accept_histogram"] for o in over] == \
        [o["meta_info"]["spec_accept_histogram"] for o in sync]
    assert sum(o["meta_info"]["spec_accept_length"] for o in over) / len(over) > 1.2


@needs_interpreter
@pytest.mark.parametrize("algo", ["EAGLE3", "STANDALONE"])
def test_chains_cut_short_emit_the_plain_tokens(world, plain, algo, monkeypatch):
    """Chain depth per batch size (specpcg/speculative/depth.py): steps verifying 1, 2 and all
    3 drafts in turn (the widths an adaptive engine captures) emit no-spec's tokens; the verifies
    cut short accept at most their depth, and the draft's next round starts where they ended
    (STANDALONE: its KV holds drafts past the cut, which its catch-up must not keep)."""
    from specpcg.speculative.adaptive import AdaptiveSpeculation
    from specpcg.speculative.step_graph import SpecStepGraphs

    # Adaptive (the depth ladder's widths are captured), speculating at every step.
    monkeypatch.setattr(AdaptiveSpeculation, "use_spec",
                        lambda self, *args, **kwargs: True)
    widths = []

    def cycle(self, bs):
        widths.append((2, 3, 4)[len(widths) % 3])
        return widths[-1]

    monkeypatch.setattr(SpecStepGraphs, "pick_width", cycle)
    draft = world.exact if algo == "STANDALONE" else world.heads[algo]
    engine = _engine(world.noisy, algo, draft, attention_backend="triton",
                     speculative_num_steps=3, disable_adaptive_speculation=False)
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert engine.scheduler.spec_overlap.graphs.widths == [4, 3, 2]
    assert len(widths) > 6
    assert [o["output_ids"] for o in outs] == plain.batch
    hist = engine.spec_decoder.depth_hist
    assert {d for d, _ in hist} == {1, 2, 3}
    assert all(m <= d for d, m in hist)
    # Cut verifies that accepted all they verified (their bonus is the target's token at the
    # cut), and verifies that rejected a draft.
    assert hist[(1, 1)] > 0 and hist[(2, 2)] > 0
    assert sum(n for (d, m), n in hist.items() if m < d) > 0
    _check_no_leak(engine)


@needs_interpreter
@pytest.mark.parametrize("resume", ["graphs", "eager"])
@pytest.mark.parametrize("algo", ALGOS + ("STANDALONE", "EAGLE3-tree"))
def test_speculation_resumes_overlapped_after_plain_steps(world, plain, algo, resume):  # noqa: F811
    """One speculative step, then 3 plain ones, by turns: each speculative step after plain
    ones is queued as an overlapped step (a head first catches up on the plain steps' rows,
    bar the last, which the step's graph takes as a one-row path; STANDALONE on their tokens,
    bar the root), where it ran synchronously before. That catch-up runs on the resume
    runners' bodies (drafts/resume.py: what their graphs replay) or, without them, eagerly.
    The tokens stay no-spec's, and on the exact target every verify still accepts all its
    drafts: the catch-up fed the draft every position, in place. Each catch-up after plain
    steps runs before the plain step in flight is read (the device still busy with it)."""
    from tests.eagle_world import _exact_outputs_all_accepted
    from tests.test_adaptive_engine import Stretches

    algo, _, shape = algo.partition("-")
    kw = {k: v for k, v in TREE.items() if k != "attention_backend"} if shape else {}
    draft = world.exact if algo == "STANDALONE" else world.heads[algo]
    for target in (world.noisy, world.exact):
        engine = _engine(target, algo, draft, attention_backend="triton",
                         disable_adaptive_speculation=False, **kw)
        engine.scheduler.adaptive = Stretches(3)
        replays = _count_resume_replays(engine, resume == "graphs")
        overlapped, sync = _count_steps_of(engine)
        in_flight = _catch_ups_in_flight(engine)
        if target is world.noisy:
            outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
            assert [o["output_ids"] for o in outs] == plain.batch
        else:
            outs = _exact_outputs_all_accepted(world, engine)
        assert all(o["meta_info"]["plain_decode_tokens"] > 0 for o in outs)
        # The first speculative step after the prefill may run synchronously; none after.
        assert len(sync) <= 1 and len(overlapped) >= 3, (len(sync), len(overlapped))
        if resume == "graphs":  # every look after 3 plain steps (the prompts: maybe eager)
            assert len(replays) >= len(overlapped) - 1, (len(replays), len(overlapped))
        # After the prefill, maybe one with no plain step before it; all others in flight.
        assert in_flight.count(False) <= 1 and in_flight.count(True) >= 2, in_flight
        _check_no_leak(engine)
    if algo == "STANDALONE":  # the noisy target drafting for itself: its KV decides
        engine = _engine(world.noisy, algo, world.noisy, attention_backend="triton",
                         disable_adaptive_speculation=False)
        engine.scheduler.adaptive = Stretches(3)
        _count_resume_replays(engine, resume == "graphs")
        outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
        assert [o["output_ids"] for o in outs] == plain.batch
        steps = engine.spec.num_steps
        for out in outs:
            hist = out["meta_info"]["spec_accept_histogram"]
            assert hist[steps] == sum(hist) > 0, hist


def _count_resume_replays(engine, keep: bool) -> list:
    """The resume runners' replays, as a list (keep=False: the draft has none, so its
    catch-ups run eagerly)."""
    draft, replays = engine.scheduler.spec.draft, []
    if not keep:
        draft.resume = None
        return replays
    for rnd in draft.resume.runners:
        run = rnd.catch_up
        rnd.catch_up = lambda *a, run=run: replays.append(a[0]) or run(*a)
    return replays


def _catch_ups_in_flight(engine) -> list:
    """Per catch_up_to_paths call: whether a plain step was in flight, not yet read."""
    s, seen = engine.scheduler, []
    run = s.spec.draft.catch_up_to_paths
    s.spec.draft.catch_up_to_paths = lambda reqs: (
        seen.append(s.overlap.inflight is not None) or run(reqs))
    return seen


def _count_steps_of(engine) -> tuple:
    """(overlapped steps, synchronous speculative steps) the engine runs, as lists."""
    s, overlapped, sync = engine.scheduler, [], []
    ov_step, loop_step = s.spec_overlap.step, s.spec.step
    s.spec_overlap.step = lambda: overlapped.append(1) or ov_step()
    s.spec.step = lambda reqs: sync.append(1) or loop_step(reqs)
    return overlapped, sync


@needs_interpreter
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE3"])
def test_new_prompts_catch_up_in_the_prompt_runners_replays(world, algo, adaptive):
    """The first speculative step after a prefill catches the draft up on the new prompts in
    the prompt runner's replays (drafts/resume.py), pinned or adaptive, a prompt of 180
    tokens too (past the look runners' reach), where pinned speculation ran one eager forward:
    no eager catch-up runs, and on the exact target every verify still accepts all its drafts
    (the replays fed the draft every prompt position, in place)."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from drafts.resume import PROMPT_WIDTH
    from tests.eagle_world import _exact_outputs_all_accepted

    draft = world.exact if algo == "STANDALONE" else world.heads[algo]
    engine = _engine(world.exact, algo, draft, attention_backend="triton",
                     disable_adaptive_speculation=not adaptive)
    if adaptive:
        from tests.test_adaptive_engine import Stretches

        engine.scheduler.adaptive = Stretches(0)  # every step speculates
    d = engine.scheduler.spec.draft
    prompt_runner = [r for r in d.resume.runners if r.width == PROMPT_WIDTH]
    assert len(prompt_runner) == 1 and len(d.resume.runners) == (3 if adaptive else 1)
    replays, eager = [], []
    run = prompt_runner[0].catch_up
    prompt_runner[0].catch_up = lambda *a: replays.append(a[0]) or run(*a)
    if algo == "STANDALONE":
        forward = d._forward
        d._forward = lambda mode, *a: (eager.append(mode) if mode.name == "DRAFT_EXTEND"
                                       else None) or forward(mode, *a)
    else:
        eager_catch_up = d._eager_catch_up
        d._eager_catch_up = lambda *a: eager.append(1) or eager_catch_up(*a)
    long_prompt = world.subset[torch.randint(0, len(world.subset), (180,),
                                             generator=torch.Generator().manual_seed(5))]
    few = SimpleNamespace(pi=world.pi, prompts=world.prompts[:3] + [long_prompt.tolist()],
                          params=world.params[:3] + [{"max_new_tokens": 12, "temperature": 0}])
    _exact_outputs_all_accepted(few, engine)
    assert replays and not eager, (replays, eager)
    # bench_adaptive's *-eager-prompts systems: the same engine without the prompt runner.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import holds

    holds.eager_prompts(engine)
    replays.clear()
    _exact_outputs_all_accepted(few, engine)
    assert eager and not replays, (replays, eager)
    _check_no_leak(engine)
