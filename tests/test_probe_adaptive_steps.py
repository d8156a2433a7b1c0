"""benchmarks/probe_adaptive_steps.py: a hold set on the controller holds every logged round, and
logging a choice changes nothing the controller reads."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _ngram_engine(path):
    """An NGRAM (3, 1, 4) engine of a tiny random Llama saved at `path`."""
    from specpcg import Engine
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", path)
    return Engine(model_path=str(path), device="cpu", dtype="float32",
                  skip_tokenizer_init=True, speculative_algorithm="NGRAM",
                  speculative_num_steps=3, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=4, show_progress=False)


def test_a_hold_holds_after_the_first_logged_round(tmp_path, capsys):
    import probe_adaptive_steps as probe
    from bench_adaptive import HOLDS

    engine = _ngram_engine(tmp_path)
    HOLDS["plain"](engine)
    held = engine.scheduler.adaptive.use_spec
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6]] * 2
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    args = SimpleNamespace(algorithm="NGRAM", script=None, log_outputs=False)
    for rnd in range(2):
        probe.logged_round(engine, args, "plain", 2, rnd, prompts, params, None)
        assert engine.scheduler.adaptive.use_spec is held  # the hold, back in place
    summaries = [line for line in capsys.readouterr().out.splitlines() if '"round"' in line]
    assert len(summaries) == 2
    assert all('"spec"' not in line.split('"calls"')[1].split('"recorded"')[0]
               for line in summaries)  # no speculative call in either round
    engine.shutdown()


def test_a_profiled_round_names_the_engines_own_functions(tmp_path, capsys):
    import json

    import probe_adaptive_steps as probe
    from specpcg import Engine
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    engine = Engine(model_path=str(tmp_path), device="cpu", dtype="float32",
                    skip_tokenizer_init=True, show_progress=False)
    out = tmp_path / "profile.jsonl"
    with open(out, "w") as f:
        probe.profiled_round(engine, "no-spec", 2, [[5, 6, 7]] * 2,
                             {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, 5, f)
    lines = [json.loads(line) for line in open(out)]
    assert [line["sort"] for line in lines] == ["tottime", "cumtime"]
    for line in lines:
        assert 0 < len(line["rows"]) <= 5
        assert all(r["name"].startswith(("specpcg/", "drafts/", "kernels/")) for r in line["rows"])
    cum = [r["cum_s"] for r in lines[1]["rows"]]
    assert cum == sorted(cum, reverse=True)
    assert any("scheduler.py" in r["name"] for r in lines[1]["rows"])  # the step's path
    assert "by cumtime" in capsys.readouterr().out
    engine.shutdown()


def test_logging_a_choice_leaves_the_controllers_finish_estimate_alone(tmp_path):
    import probe_adaptive_steps as probe
    from specpcg.speculative.bucket import Bucket

    engine = _ngram_engine(tmp_path)
    log = probe.instrument(engine)
    b, estimate = Bucket(), (0.5, 0.4)
    b.last_finish = estimate  # an earlier choice's, which Bucket.lead reads until the next
    engine.scheduler.adaptive._choose(b, None, 2)  # rates: no new estimate
    assert b.last_finish is estimate
    assert log[-1]["kind"] == "choose" and log[-1]["finish_s"] is None  # not made by it
    engine.shutdown()


def test_every_recorded_step_reaches_the_log(tmp_path):
    """The probe wraps the controller's record: it must see each step, the steady plain ones
    that only join their window included, or its looks' reports miss their steps."""
    import probe_adaptive_steps as probe
    from bench_adaptive import HOLDS

    engine = _ngram_engine(tmp_path)
    HOLDS["plain"](engine)
    log = probe.instrument(engine)
    engine.generate(input_ids=[[5, 6, 7, 5, 6, 7]] * 2,
                    sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    windows = engine.scheduler.adaptive._buckets.values()
    recorded = sum(b.decode.steps for b in windows)
    assert recorded >= 15
    assert sum(e["kind"] == "record" and not e["spec"] for e in log) >= recorded
    engine.shutdown()


def test_the_untimed_round_is_logged_as_round_minus_one_with_its_stalls(tmp_path, capsys):
    import json

    import probe_adaptive_steps as probe
    from stalls import StallWatch

    engine = _ngram_engine(tmp_path)
    out = tmp_path / "steps.jsonl"
    args = SimpleNamespace(algorithm="NGRAM", script=None, log_outputs=False)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with open(out, "w") as f:
        probe.untimed_round(engine, args, "adaptive", 2, [[5, 6, 7, 5, 6]] * 2, params, f,
                            StallWatch(engine.device))
    lines = [json.loads(line) for line in open(out)]
    summary = [x for x in lines if x.get("probe") == "adaptive_steps"]
    stalls = [x for x in lines if x.get("probe") == "adaptive_steps_stalls"]
    assert [x["round"] for x in summary + stalls] == [-1, -1]
    assert summary[0]["calls"]["prefill"]["calls"] >= 1
    assert isinstance(stalls[0]["stalls"], dict)
    assert lines.index(stalls[0]) == len(lines) - 1  # after the round's own lines
    assert '"adaptive_steps_stalls"' in capsys.readouterr().out
    with open(out, "w") as f:  # without a watch: not logged
        probe.untimed_round(engine, args, "adaptive", 2, [[5, 6, 7]] * 2, params, f, None)
    assert out.read_text() == ""
    engine.shutdown()


def test_a_rounds_line_names_each_outputs_digest_and_with_log_outputs_its_ids(tmp_path, capsys):
    import json

    import common
    import probe_adaptive_steps as probe

    engine = _ngram_engine(tmp_path)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7, 9]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    for log_outputs in (False, True):
        args = SimpleNamespace(algorithm="NGRAM", script=None, log_outputs=log_outputs)
        probe.logged_round(engine, args, "adaptive", 2, 0, prompts, params, None)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"round"' in x]
    assert "output_ids" not in lines[0]
    ids = lines[1]["output_ids"]
    assert [len(x) for x in ids] == [6, 6]
    # The same greedy outputs both rounds, and a digest per request that tells them apart.
    assert lines[0]["output_digests"] == lines[1]["output_digests"]
    assert lines[1]["output_digests"] == [common.output_digest(x) for x in ids]
    assert common.output_digest(ids[0]) != common.output_digest(ids[0][:-1] + [ids[0][-1] + 1])
    engine.shutdown()


def test_periods_bin_each_sides_steps_by_batch_size_from_one_call_to_the_next():
    import probe_adaptive_steps as probe

    log = [{"kind": "spec", "bs": 64, "t": 0.0, "s": 0.001},
           {"kind": "spec", "bs": 60, "t": 0.002, "s": 0.001},
           {"kind": "record", "bs": 60, "spec": True, "tokens": 3, "s": 0.001},
           {"kind": "spec", "bs": 33, "t": 0.0035, "s": 0.001},
           {"kind": "flush-spec", "bs": 33, "t": 0.0045, "s": 0.0005},
           {"kind": "plain", "bs": 33, "t": 0.005, "s": 0.001},
           {"kind": "plain", "bs": 33, "t": 0.006, "s": 0.001}]
    got = probe.periods(log)
    # Bins of 8: 60 falls in 56-63, 64 in a bin of its own; a flush between two calls ends
    # the side's run, so the spec call at 33 has no period.
    assert got["spec"] == {56: [1, 1.5], 64: [1, 2.0]}
    assert got["plain"] == {32: [1, 1.0]}
