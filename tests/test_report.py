"""The README's headline table (benchmarks/headline.py): figures from the latest JSON lines,
written only between the README's markers."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import headline  # noqa: E402


def _write(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _engine(system, value, git):
    return {"bench": "engine", "system": system, "metric": "decode_tok_s", "batch_size": 1,
            "value": value, "git": git, "device": "gpu"}


def _cell(algorithm, identical, failures, git):
    return {"bench": "gsm8k_matrix", "algorithm": algorithm, "pcg": True,
            "attention_backend": "triton", "spec_settings": None, "identical_frac": identical,
            "failures": failures, "git": git, "device": "gpu"}


def test_headline_uses_the_latest_lines_and_keeps_the_prose(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    # An older run, then a newer one: only the newer figures may show.
    _write(results / "engine.jsonl", [_engine("specpcg_graphs", 100.0, "old"),
                                      _engine("hf_static", 100.0, "old"),
                                      _engine("specpcg_graphs", 600.0, "new"),
                                      _engine("hf_static", 300.0, "new")])
    # A cell that failed, then passed on a rerun; a second cell that failed.
    _write(results / "gsm8k_matrix.jsonl", [_cell("EAGLE", 0.5, ["accuracy"], "old"),
                                            _cell("EAGLE", 0.5, [], "new"),
                                            _cell("NGRAM", 0.25, ["a near-tie too wide"], "new")])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{headline.BEGIN}\nstale table\n{headline.END}\noutro\n")

    headline.write_readme(readme, results)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n")
    assert "stale table" not in text
    assert "| 600 vs 300 tok/s (2.00x) | new |" in text
    assert "1 of 2 cells passed; identical to no-spec 25%-50%" in text
    assert "| spec.jsonl | not measured |" in text  # a missing file is never filled in

    headline.write_readme(readme, results)  # idempotent: one table, not two
    assert readme.read_text() == text


def test_headline_refuses_a_readme_without_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="markers"):
        headline.write_readme(readme, tmp_path)
    assert readme.read_text() == "no markers here\n"


def test_drafts_table_names_each_rows_commit():
    import bench_drafts

    def line(system, al, git):
        return {"bench": "drafts", "system": system, "prompt_set": "chat", "accept_length": al,
                "speedup_bs1": 1.0, "speedup_bs16": 1.0, "git": git, "device": "gpu"}

    table = bench_drafts.render_table([line("NGRAM 7,1,8", 2.0, "aaa"),
                                       line("EAGLE3 7,1,8", 2.4, "bbb"),
                                       line("EAGLE3 7,1,8", 2.5, "ccc")])
    rows = {r.split("|")[1].strip(): r for r in table.splitlines() if r.startswith("| ")}
    assert rows["NGRAM 7,1,8"].rstrip(" |").endswith("aaa")
    assert "2.50" in rows["EAGLE3 7,1,8"] and rows["EAGLE3 7,1,8"].rstrip(" |").endswith("ccc")


def test_matmul_table_sums_a_step_and_finds_the_current_rules_tiling():
    pytest.importorskip("triton")
    import bench_matmul
    from kernels.matmul_triton import Tiling, cuda_tiling

    lines = []
    for layer, n, k in bench_matmul.SHAPES["default"]:
        base = {"bench": "matmul", "model": "default", "layer": layer, "n": n, "k": k, "m": 1,
                "sms": 132}
        rule = cuda_tiling(n, k, 132)
        other = Tiling(block_n=256 if rule.block_n != 256 else 16)
        lines += [{**base, "impl": "cublas", "us": 10.0},
                  {**base, "impl": "triton", "tiling": rule.__dict__, "us": 20.0},
                  {**base, "impl": "triton", "tiling": other.__dict__, "us": 5.0}]
    sums = bench_matmul.step_sums(lines)[("default", 1)]
    assert sums == {"cublas": 1210.0, "rule": 2420.0, "best": 605.0}  # 4 x 30 layers + LM head
    row = [r for r in bench_matmul.render_table(lines).splitlines() if r.startswith("| default")]
    assert "| 0.50 | 2.00 |" in row[0]


def test_bench_step_names_the_batch1_graphs_of_chain_and_tree_runners():
    """Decode graphs are keyed (mode, tree keys, batch size); the round's (kind, batch size)."""
    from types import SimpleNamespace

    import bench_step
    from specpcg.core import ForwardMode

    decode = SimpleNamespace(graphs={(ForwardMode.DECODE, 0, 1): "d1",
                                     (ForwardMode.DECODE, 0, 2): "d2",
                                     (ForwardMode.TARGET_VERIFY, 8, 1): "v1"})
    engine = SimpleNamespace(router=SimpleNamespace(runners={"decode_graph": decode}),
                             draft=SimpleNamespace(round=SimpleNamespace(
                                 graphs={("chain", 1): "c1", ("chain", 4): "c4"})))
    assert bench_step.batch1_graphs(engine) == {"target_decode": "d1",
                                                "target_target_verify_tree8": "v1",
                                                "draft_chain": "c1"}


def _reference(model, batch, ours, peer, git, **extra):
    return {"bench": "reference", "model": model, "batch": batch, "specpcg_tok_s": ours,
            "static_compiled_tok_s": peer, "ratio": ours / peer, "git": git, **extra}


def test_reference_rows_and_bandwidth_share():
    """The peer's headline row takes each batch's latest line; the bandwidth share is computed
    from a line's own fields, and not at all for a line without the bytes a step reads."""
    import bench_reference

    lines = [_reference("default", 1, 650.0, 800.0, "old"), _reference("default", 1, 880.0,
             800.0, "new"), _reference("default", 8, 6000.0, 5000.0, "new")]
    (figure, value, commit, _), = headline.reference_rows(lines)
    assert figure.endswith("default") and commit == "new"
    assert value == "batch 1: 1.10x (880 vs 800 tok/s); batch 8: 1.20x (6,000 vs 5,000 tok/s)"
    measured = _reference("8b", 1, 150.0, 140.0, "g", copy_bandwidth_Bps=3.0e12,
                          read_bytes_per_token=15.0e9)
    assert bench_reference.bound_share(measured) == pytest.approx(0.75)
    assert bench_reference.bound_share(_reference("8b", 1, 150.0, 140.0, "g",
                                                  copy_bandwidth_Bps=3.0e12)) is None
    assert "| 8b | 1 | g | 150 | 140 | 1.07 | 0.75 |" in bench_reference.render_table([measured])


def _part_b(prob, batch, tok_s, efficiency):
    return {"bench": "accept", "part": "B", "model": "m", "prob": prob, "batch_size": batch,
            "decode_tok_s": tok_s, "efficiency": efficiency, "device": "gpu"}


def test_accept_runs_side_by_side_plot_efficiency_or_decode_tok_s(tmp_path, monkeypatch):
    """bench_accept --compare: a panel per batch, a group per p (no-spec first for tok/s) and a
    bar per run, each bar the run's own value."""
    import accept_report
    import common

    runs = {}
    for label, scale in (("new", 2.0), ("old", 1.0)):
        path = tmp_path / f"{label}.jsonl"
        _write(path, [_part_b(p, bs, scale * bs * (1 + (p or 0)), 0.5 * scale)
                      for bs in (1, 16) for p in (None, 0.7)])
        runs[label] = str(path)
    drawn = []
    monkeypatch.setattr(common, "grouped_bar_plot",
                        lambda panels, series, path, title: drawn.append((panels, series)))
    accept_report.plot_compare(list(runs.items()), "x.png")
    accept_report.plot_compare(list(runs.items()), "x.png", "tok_s")
    (eff, series), (tok, _) = drawn
    assert series == ["new", "old"] and [p["title"] for p in tok] == ["batch 1", "batch 16"]
    assert eff[0]["labels"] == ["p=0.7"] and eff[0]["values"] == {"new": [1.0], "old": [0.5]}
    assert tok[1]["labels"] == ["no-spec", "p=0.7"]
    assert tok[1]["values"] == {"new": [32.0, 54.4], "old": [16.0, 27.2]}


def test_results_read_alike_plain_or_gzipped(tmp_path):
    """The long step logs are kept gzipped: common.read_jsonl reads either, and names a file
    that is not there."""
    import gzip

    import common

    lines = [{"system": "pinned", "bs": 4}, {"system": "no-spec", "bs": 1}]
    plain = tmp_path / "log.jsonl"
    _write(plain, lines)
    packed = tmp_path / "log.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert common.read_jsonl(plain) == common.read_jsonl(packed) == lines
    with pytest.raises(ValueError, match="missing.jsonl.gz"):
        common.read_jsonl(tmp_path / "missing.jsonl.gz")
