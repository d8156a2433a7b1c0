"""The ring a target's plain decode steps write a head's hidden rows into (specpcg/hidden_ring.py,
kernels/hidden_ring.py): the Triton kernel against its torch twin (the interpreter on CPU), its
reads in order across the wrap, its size, and a head handed every position through it over
stretches of plain steps longer than the ring, as with the rows copied out after each step."""

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import specpcg.hidden_ring as hidden_ring  # noqa: E402
from kernels.hidden_ring import write_ring  # noqa: E402
from specpcg.hidden_ring import HiddenRing  # noqa: E402
from tests.eagle_world import ALGOS, world, _engine  # noqa: E402,F401 (fixtures)

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("sources,h,n", [(3, 24, 5), (1, 40, 1), (2, 1100, 3)])
def test_triton_matches_the_twin(sources, h, n):
    gen = torch.Generator().manual_seed(sources * 1000 + h)
    rows, depth = 6, 8
    src = [torch.randn(n + 2, h, generator=gen)[:n] for _ in range(sources)]
    positions = torch.randint(0, 40, (n,), generator=gen)
    pool_rows = torch.randperm(rows, generator=gen)[:n]
    pool_rows[-1] = rows - 1  # a padding row takes writes like any other
    got = torch.full((rows, depth, sources * h), -3.0)
    want = got.clone()
    write_ring(got, src, positions, pool_rows, use_triton=True)
    write_ring(want, src, positions, pool_rows, use_triton=False)
    assert torch.equal(got, want)
    for i in range(n):
        entry = want[pool_rows[i], positions[i] % depth]
        assert torch.equal(entry, torch.cat([s[i] for s in src]))
    assert int((want != -3.0).any(-1).sum()) == n  # nothing else written
    with pytest.raises(ValueError, match="do not fill a ring row"):
        write_ring(got, [torch.zeros(n, h + 1)] * sources, positions, pool_rows)
    with pytest.raises(ValueError, match="1 to 3 sources, got 0"):
        write_ring(got, [], positions, pool_rows)


@needs_interpreter
@pytest.mark.parametrize("sources,h,n,vocab", [(3, 24, 5, 5000), (1, 40, 1, 300),
                                                (3, 16, 2, 100), (2, 1100, 3, 4000)])
def test_the_greedy_picks_launch_writes_the_ring_as_the_twins_do(sources, h, n, vocab):
    """The pick's first kernel writes each row's sources, whether its rows take one chunk or
    several, fewer chunks than sources among them (vocab 100: one; 4,000: two of 2,048)."""
    from kernels.topk import argmax_rows

    gen = torch.Generator().manual_seed(sources * 7 + vocab)
    rows, depth = 6, 8
    src = [torch.randn(n, h, generator=gen) for _ in range(sources)]
    positions = torch.randint(0, 40, (n,), generator=gen)
    pool_rows = torch.randperm(rows, generator=gen)[:n]
    logits = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    rings = [torch.full((rows, depth, sources * h), -3.0) for _ in range(3)]
    got = argmax_rows(logits, use_triton=True, ring=(rings[0], src, positions, pool_rows))
    want = argmax_rows(logits, use_triton=False, ring=(rings[1], src, positions, pool_rows))
    write_ring(rings[2], src, positions, pool_rows, use_triton=False)
    assert torch.equal(got, logits.argmax(-1)) and torch.equal(want, got)
    assert torch.equal(rings[0], rings[2]) and torch.equal(rings[1], rings[2])
    assert int((rings[0] != -3.0).any(-1).sum()) == n
    with pytest.raises(ValueError, match="do not fill a ring row"):
        argmax_rows(logits, ring=(rings[0], [s[:, 1:] for s in src], positions, pool_rows))
    with pytest.raises(ValueError, match=f"the ring's sources have {n + 1} rows, the picks {n}"):
        more = [torch.zeros(n + 1, h)] * sources
        argmax_rows(logits, ring=(rings[0], more, positions, pool_rows))


def test_reads_come_back_in_order_across_the_wrap():
    ring = HiddenRing(rows=4, width=6, dtype=torch.float32, device="cpu", depth=8)
    pool_rows, first = [2, 0, 3], [5, 13, 0]
    steps = [torch.randn(3, 6) for _ in range(8)]  # 8 steps: every row wraps but the last
    for k, rows in enumerate(steps):
        positions = torch.tensor([f + k for f in first])
        ring.write([rows[:, :3], rows[:, 3:]], positions, torch.tensor(pool_rows))
    assert torch.equal(ring.read(pool_rows, first, 8), torch.stack(steps, dim=1))
    tail = [f + 5 for f in first]
    assert torch.equal(ring.read(pool_rows, tail, 3), torch.stack(steps[5:], dim=1))
    for bad in (0, 9):
        with pytest.raises(ValueError, match="a read covers 1 to 8 steps"):
            ring.read(pool_rows, first, bad)


def test_a_ring_is_as_deep_as_its_bytes_allow(monkeypatch):
    from specpcg.kv_cache import ReqToTokenPool

    def ctx(hidden, parallel=None):
        return SimpleNamespace(kv_cache=SimpleNamespace(req_pool=ReqToTokenPool(7, 16, "cpu")),
                               model_config=SimpleNamespace(hidden_size=hidden),
                               dtype=torch.bfloat16, device="cpu", parallel=parallel)

    ring = HiddenRing.for_draft(ctx(64), 3)
    assert ring.buf.shape == (8, hidden_ring.DEPTH, 192) and ring.buf.dtype == torch.bfloat16
    monkeypatch.setattr(hidden_ring, "MAX_BYTES", 8 * 192 * 2 * 20)
    assert HiddenRing.for_draft(ctx(64), 3).depth == 20
    assert HiddenRing.for_draft(ctx(64), 0).buf.shape[1:] == (60, 64)  # the last layer's
    assert HiddenRing.for_draft(ctx(64 * 3), 3) is None  # 6 steps deep: not made
    assert HiddenRing.for_draft(ctx(64, parallel=object()), 3) is None
    monkeypatch.setenv("SPECPCG_HIDDEN_RING", "0")
    assert HiddenRing.for_draft(ctx(64), 3) is None


def _stretches_reach_the_head(world, algo, engine, monkeypatch) -> None:
    """One speculative step, then 19 plain ones, by turns, over answers of 40-54 tokens: the
    tokens are the target's own, and every position reaches the head once, in order, as a
    dense forward of the target and the head would have it."""
    from tests.test_adaptive_engine import Stretches
    from tests.test_eagle import _check_rows_against_dense, _Recorder

    engine.scheduler.adaptive = Stretches(19)
    params = [{**p, "max_new_tokens": 40 + 2 * i} for i, p in enumerate(world.params)]
    want = _engine(world.noisy).generate(input_ids=world.prompts, sampling_params=params)
    recorder = _Recorder(engine, reserves_ahead=True)
    outs = engine.generate(input_ids=world.prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    _check_rows_against_dense(world, algo, engine, recorder, outs, monkeypatch)


@pytest.mark.parametrize("ring", ["on", "off"])
@pytest.mark.parametrize("algo", ALGOS)
def test_stretches_longer_than_the_ring_hand_the_head_every_position(world, algo, ring,
                                                                      monkeypatch):
    """One speculative step, then 19 plain ones, by turns, with a ring 8 steps deep, answers of
    40-54 tokens: a stretch is read back from the ring before it wraps, and at the next
    speculative step or change of batch; every position still reaches the head once, in order,
    as a dense forward of the target and the head would have it (with the ring off, as copies
    after each step), and the tokens are the target's own."""
    monkeypatch.setattr(hidden_ring, "DEPTH", 8)
    if ring == "off":
        monkeypatch.setenv("SPECPCG_HIDDEN_RING", "0")
    engine = _engine(world.noisy, algo, world.heads[algo], disable_adaptive_speculation=False)
    assert (engine.draft.hidden_ring is None) == (ring == "off")
    assert engine.draft.info()["hidden_ring_depth"] == (8 if ring == "on" else None)
    assert engine.runner.hidden_ring is engine.draft.hidden_ring
    reads = []
    if ring == "on":
        real = engine.draft.hidden_ring.read
        monkeypatch.setattr(engine.draft.hidden_ring, "read",
                            lambda *a: reads.append(a[2]) or real(*a))
    _stretches_reach_the_head(world, algo, engine, monkeypatch)
    if ring == "on":
        assert reads.count(8) >= 2 and max(reads) == 8, reads  # full logs read before a wrap


@pytest.mark.parametrize("ring", ["on", "off"])
@pytest.mark.parametrize("algo", ALGOS)
def test_rows_past_the_limit_go_to_the_head_as_the_log_fills(world, algo, ring, monkeypatch):
    """A request may hold 10 rows (plain_log.PENDING_MAX) with logs 8 steps deep: over the
    same stretches of 19 plain steps, a full log's hand-over catches the head up on the rows
    whose next token the host holds, so no request holds more than a log's worth past the
    limit; every position still reaches the head once, in order, as a dense forward has it."""
    import drafts.plain_log as plain_log

    monkeypatch.setattr(hidden_ring, "DEPTH", 8)
    monkeypatch.setattr(plain_log, "TENSOR_DEPTH", 8)
    monkeypatch.setattr(plain_log, "PENDING_MAX", 10)
    if ring == "off":
        monkeypatch.setenv("SPECPCG_HIDDEN_RING", "0")
    engine = _engine(world.noisy, algo, world.heads[algo], disable_adaptive_speculation=False)
    folds = []  # (most rows a request held before, after, positions the head caught up)
    real = plain_log.fold_long

    def most(states) -> int:
        return max(sum(p.shape[0] for p in st.pending) for st in states)

    def fold(reqs, states, catch_up):
        before, cached = most(states), sum(st.num_cached for st in states)
        real(reqs, states, catch_up)
        folds.append((before, most(states), sum(st.num_cached for st in states) - cached))
    monkeypatch.setattr(plain_log, "fold_long", fold)
    _stretches_reach_the_head(world, algo, engine, monkeypatch)
    assert sum(n for *_, n in folds) > 0 and max(b for b, *_ in folds) <= 10 + 8, folds
    # What stays: the rows whose next token is still on the device (overlap: up to two)
    assert all(after <= 2 for before, after, _ in folds if before > 10), folds


@needs_interpreter
@pytest.mark.parametrize("algo,in_pick", [("EAGLE3", "1"), ("NEXTN", "0")])  # 3 sources, 1
def test_decode_graphs_write_the_ring_with_their_greedy_pick(world, algo, in_pick, monkeypatch):
    """Decode graphs (stood in for by replays of their captured body, as in
    test_decode_graph_host.py) write the head's rows in the greedy pick's launch
    (SPECPCG_RING_IN_PICK=1) or in one of their own: by stretches of 19 plain steps with a ring
    8 deep, every position reaches the head once, as a dense forward has it, and the tokens are
    the target's own."""
    import specpcg.graphs.decode_runner as decode_runner
    from specpcg.graphs.buckets import decode_batch_buckets
    from tests.test_decode_graph_host import _fake_capture

    monkeypatch.setattr(hidden_ring, "DEPTH", 8)
    monkeypatch.setenv("SPECPCG_RING_IN_PICK", in_pick)
    monkeypatch.setattr(decode_runner, "warm_and_capture", _fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the capture's timing
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    engine = _engine(world.noisy, algo, world.heads[algo], disable_adaptive_speculation=False,
                     attention_backend="triton")
    head = engine.draft
    runner = decode_runner.DecodeGraphRunner(
        engine.runner, decode_batch_buckets(8), head.needs_hidden, tuple(head.aux_layers), None,
        show_progress=False, write_rows=True)
    runner.capture()
    engine.router.runners["decode_graph"] = runner
    writes, real = [], head.hidden_ring.write
    monkeypatch.setattr(head.hidden_ring, "write",
                        lambda *a: writes.append(a[3] is not None) or real(*a))
    _stretches_reach_the_head(world, algo, engine, monkeypatch)
    replays = sum(g.replays for g in runner.graphs.values())
    assert replays > 40 and runner.ring_in_graph
    assert writes.count(in_pick == "1") >= replays and (in_pick == "0") not in writes


def _held_rows(monkeypatch, runs: list) -> list:
    """The default model and a random EAGLE3 head held to plain steps, one engine per run
    (SPECPCG_HIDDEN_RING, plain_log.PENDING_MAX or None for its own), 100 tokens for each of
    three prompts: per run, each request's rows in order (those folded into the head, then
    those it still held at its end) and the positions folded."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_step import random_head_dir
    from holds import plain_only

    import drafts.plain_log as plain_log
    from drafts.eagle import HeadDraft
    from specpcg import Engine
    from specpcg.models.loader import default_model_path

    head = random_head_dir("EAGLE3", default_model_path())
    rows, release, fold = {}, HeadDraft.release, plain_log.fold_long

    def kept(self, req):  # the request's rows once its log is handed over
        if self._plain is not None and req in self._plain.reqs:
            self._hand_over()
        rows.setdefault(req.rid, []).append(torch.cat(self._reqs[req.rid].pending).cpu())
        release(self, req)

    def folded(reqs, states, catch_up):
        def logged(some, their):
            for req, st in zip(some, their):
                rows.setdefault(req.rid, []).append(torch.cat(st.pending).cpu())
            catch_up(some, their)
        fold(reqs, states, logged)

    monkeypatch.setattr(HeadDraft, "release", kept)
    monkeypatch.setattr(plain_log, "fold_long", folded)
    prompts = [[(7 * i + j) % 900 + 3 for j in range(20 + 3 * i)] for i in range(3)]
    out = []
    for ring, limit in runs:
        monkeypatch.setenv("SPECPCG_HIDDEN_RING", ring)
        monkeypatch.setattr(plain_log, "PENDING_MAX", limit or 1024)
        engine = Engine(device="cuda", skip_tokenizer_init=True, max_running_requests=4,
                        speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                        show_progress=False)
        plain_only(engine)
        assert (engine.draft.hidden_ring is not None) == (ring == "1")
        rows.clear()
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 100,
                                                            "temperature": 0,
                                                            "ignore_eos": True})
        assert engine.graphs.decode.ring_in_graph == (ring == "1")
        engine.shutdown()
        assert len(rows) == 3
        # request ids count on across engines: in order
        out.append([(torch.cat(rows[r]), sum(p.shape[0] for p in rows[r][:-1]))
                    for r in sorted(rows)])
    return out


@pytest.mark.cuda
def test_decode_graphs_write_the_rows_the_copies_held(monkeypatch):
    """On the GPU, with the default model and a random EAGLE3 head held to plain steps: the rows
    the head is handed through the ring (written inside the decode graphs, read back past a
    wrap) are bitwise those the engine copied out after each replay with the ring off."""
    ringed, copied = _held_rows(monkeypatch, [("1", None), ("0", None)])
    for (a, _), (b, _) in zip(ringed, copied):
        assert a.shape[0] >= 100 + 20 - 1
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_decode_graphs_fold_rows_past_the_limit_into_the_head(monkeypatch):
    """On the GPU, the same with a request allowed 48 rows (plain_log.PENDING_MAX): the rows
    folded into the head as the ring's logs fill, then those held at the end, are in order
    bitwise the rows an engine without the limit held."""
    whole, limited = _held_rows(monkeypatch, [("1", None), ("1", 48)])
    for (a, none), (b, folded) in zip(whole, limited):
        assert none == 0 and folded >= 48
        assert torch.equal(a, b)
