"""benchmarks/bench_alone.py: every system in a process of its own, the order reversed every
other pass, and cells over every pass's timed batches."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_alone  # noqa: E402
from bench_adaptive import render_table  # noqa: E402


def _args(**kw):
    base = dict(systems=["no-spec", "pinned", "adaptive"], passes=3, model_path=None,
                device="cpu", batches=[1, 4], setting="3,1,4", repeats=2, max_new_tokens=8,
                prompt_len=16, alone_prompts=1)
    return SimpleNamespace(**{**base, **kw})


def _fake_worker(rates_of):
    calls = []

    def run(script, flag, spec):
        assert flag == "--worker" and script.endswith("bench_alone.py")
        calls.append(spec["system"])
        k = calls.count(spec["system"]) - 1  # this system's pass
        return {"machine": {"device": "fake"}, "batches": {
            str(bs): {"rates": rates_of(spec["system"], bs, k), "stalls_per_round": [{}, {}],
                      "plain_decode_tokens_per_round": [bs, bs], "switches_by_why": {},
                      "adaptive_buckets": None, "chain_depth": None}
            for bs in spec["batches"]}}
    return run, calls


def test_each_pass_runs_every_system_once_the_order_reversed_every_other_pass():
    run, calls = _fake_worker(lambda s, bs, k: [100.0, 100.0])
    got = bench_alone.run_passes(_args(), "STANDALONE", "/d", run=run)
    assert calls == ["no-spec", "pinned", "adaptive", "adaptive", "pinned", "no-spec",
                     "no-spec", "pinned", "adaptive"]
    assert {s: len(v) for s, v in got.items()} == {"no-spec": 3, "pinned": 3, "adaptive": 3}


def test_a_cell_is_the_median_over_every_pass_against_no_specs():
    # no-spec: 100 a batch; pinned 90 in two passes, 150 in one; adaptive 120 in one pass only
    rates = {"no-spec": lambda bs, k: [100.0, 100.0],
             "pinned": lambda bs, k: [150.0, 150.0] if k == 1 else [90.0, 90.0],
             "adaptive": lambda bs, k: [120.0, 120.0] if k == 0 else [bs * 100.0, bs * 100.0]}
    run, _ = _fake_worker(lambda s, bs, k: rates[s](bs, k))
    args = _args()
    lines = bench_alone.lines_of(args, "STANDALONE", "/d",
                                 bench_alone.run_passes(args, "STANDALONE", "/d", run=run))
    cell = {(x["system"], x["batch"]): x for x in lines}
    assert set(cell) == {("pinned", 1), ("pinned", 4), ("adaptive", 1), ("adaptive", 4)}
    assert cell[("pinned", 1)]["speedup"] == 0.9  # 4 of 6 timed batches at 90
    assert cell[("adaptive", 1)]["speedup"] == 1.0  # 100, 100, 100, 100, 120, 120
    assert cell[("adaptive", 4)]["speedup"] == 4.0
    assert len(cell[("pinned", 4)]["rates"]) == 6 and cell[("pinned", 4)]["passes"] == 3
    assert all(x["bench"] == "adaptive_alone" and not x["interleaved"] for x in lines)


def test_the_worker_times_one_engine_alone(tmp_path):
    """A real engine (a tiny random Llama on CPU, NGRAM): one untimed and `repeats` timed
    batches of each size, with what the stall counter saw in each."""
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    out = bench_alone.worker({"system": "adaptive", "algorithm": "NGRAM", "draft": None,
                              "model_path": str(tmp_path), "device": "cpu",
                              "batches": [1, 2], "setting": [3, 1, 4], "repeats": 2,
                              "max_new_tokens": 6, "prompt_len": 16,
                              "engine_options": {"skip_tokenizer_init": True,
                                                 "dtype": "float32"}})
    assert set(out["batches"]) == {"1", "2"}
    for bs, cell in out["batches"].items():
        assert len(cell["rates"]) == 2 and all(r > 0 for r in cell["rates"])
        assert len(cell["stalls_per_round"]) == 2
        assert all(0 <= p <= 6 * int(bs) for p in cell["plain_decode_tokens_per_round"])
        assert cell["adaptive_buckets"]  # the adaptive engine's buckets, by size
    assert out["machine"]["git"] is not None


def test_a_batch_of_one_runs_alone_prompts_one_after_another_each_named_by_its_text(tmp_path):
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    out = bench_alone.worker({"system": "no-spec", "algorithm": "NGRAM", "draft": None,
                              "model_path": str(tmp_path), "device": "cpu",
                              "batches": [1, 2], "setting": [3, 1, 4], "repeats": 2,
                              "max_new_tokens": 6, "prompt_len": 16, "alone_prompts": 3,
                              "engine_options": {"skip_tokenizer_init": True,
                                                 "dtype": "float32"}})
    one, two = out["batches"]["1"], out["batches"]["2"]
    assert one["alone_prompts"] == 3 and two["alone_prompts"] is None
    # three prompts a timed batch of one, two in a batch of two; greedy: the same each round
    assert [len(r) for r in one["digests_per_round"]] == [3, 3]
    assert [len(r) for r in two["digests_per_round"]] == [2, 2]
    assert one["digests_per_round"][0] == one["digests_per_round"][1]


def test_a_line_counts_the_outputs_whose_text_is_no_specs():
    def run(script, flag, spec):
        texts = {"no-spec": ["a", "b"], "pinned": ["a", "c"], "adaptive": ["a", "b"]}
        cell = {"rates": [100.0, 100.0], "stalls_per_round": [{}, {}],
                "plain_decode_tokens_per_round": [0, 0], "switches_by_why": {},
                "adaptive_buckets": None, "chain_depth": None, "alone_prompts": None,
                "digests_per_round": [texts[spec["system"]]] * 2}
        if spec["system"] == "adaptive":  # a worker of a checkout that names no outputs
            del cell["digests_per_round"]
        return {"machine": {"device": "fake"}, "batches": {"2": cell}}

    args = _args(batches=[2], passes=2)
    lines = bench_alone.lines_of(args, "NGRAM", None, bench_alone.run_passes(args, "NGRAM",
                                                                             None, run=run))
    texts = {x["system"]: x["texts_as_no_spec"] for x in lines}
    assert texts == {"pinned": [4, 8], "adaptive": None}  # 2 passes x 2 rounds x 2 requests


def test_each_workers_result_is_kept_as_it_ends_so_a_cut_run_keeps_the_finished_ones():
    kept = []

    def cut(script, flag, spec):
        if len(kept) == 4:  # the fifth worker never returns: a time limit
            raise TimeoutError
        return run(script, flag, spec)

    run, _ = _fake_worker(lambda s, bs, k: [100.0 + k, 100.0])
    try:
        bench_alone.run_passes(_args(passes=2), "NGRAM", None, run=cut, keep=kept.append)
    except TimeoutError:
        pass
    assert [(x["system"], x["pass"]) for x in kept] == [
        ("no-spec", 0), ("pinned", 0), ("adaptive", 0), ("adaptive", 1)]
    assert all(x["bench"] == bench_alone.WORKER_BENCH and x["algorithm"] == "NGRAM"
               for x in kept)
    assert kept[3]["batches"]["4"]["rates"] == [101.0, 100.0]  # the worker's own result


def test_a_tree_runs_its_systems_from_the_other_checkout_named_system_at_tree():
    seen = []

    def run(script, flag, spec, code=None):
        seen.append((spec["system"], script, code))
        rate = 80.0 if code else 100.0  # the other checkout's engines run slower
        return {"machine": {"device": "fake", "git": "c0de" if code else "a1b2"}, "batches": {
            str(bs): {"rates": [rate, rate], "stalls_per_round": [{}, {}],
                      "plain_decode_tokens_per_round": [bs, bs], "switches_by_why": {},
                      "adaptive_buckets": None, "chain_depth": None}
            for bs in spec["batches"]}}

    args = _args(passes=2, tree="old=/checkouts/old", tree_systems=["adaptive"])
    assert bench_alone.systems_of(args) == ["no-spec", "pinned", "adaptive", "adaptive@old"]
    results = bench_alone.run_passes(args, "STANDALONE", "/d", run=run)
    assert [s for s, _, _ in seen] == ["no-spec", "pinned", "adaptive", "adaptive",
                                       "adaptive", "adaptive", "pinned", "no-spec"]
    old = [(script, code) for _, script, code in seen if code]
    assert old == [("/checkouts/old/benchmarks/bench_alone.py", "/checkouts/old")] * 2
    assert all(script.endswith("bench_alone.py") and not script.startswith("/checkouts")
               for _, script, code in seen if not code)
    lines = bench_alone.lines_of(args, "STANDALONE", "/d", results)
    cell = {(x["system"], x["batch"]): x["speedup"] for x in lines}
    assert cell[("adaptive@old", 1)] == 0.8 and cell[("adaptive", 4)] == 1.0
    old_line = next(x for x in lines if x["system"] == "adaptive@old")
    assert (old_line["git"], old_line["tree_git"]) == ("a1b2", "c0de")  # this run's lines
    table = render_table(lines, bench="adaptive_alone")
    assert "| adaptive bs 1 | adaptive bs 4 | adaptive@old bs 1 | adaptive@old bs 4 |" in table
    assert bench_alone.systems_of(_args()) == ["no-spec", "pinned", "adaptive"]  # no tree


def test_a_relative_tree_is_read_from_here_and_a_tree_without_the_bench_is_refused(
        tmp_path, monkeypatch):
    """--tree NAME=DIR with DIR relative names a checkout from where the bench was started (its
    worker runs inside that checkout, where the relative path would name another); one without
    benchmarks/bench_alone.py is refused before any worker runs."""
    (tmp_path / "old" / "benchmarks").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    args = _args(tree="old=old", tree_systems=["adaptive"])
    assert bench_alone._tree(args) == ("old", str(tmp_path / "old"))
    with pytest.raises(SystemExit, match="--tree old=old: no benchmarks/bench_alone.py"):
        bench_alone.run_all(args)
