"""benchmarks/bench_layouts.py's report, from JSON lines (no engine): greedy identity against
the one-GPU line of the same graph setting, speculative efficiency, TTFT and each rank's
start-up, and its plot."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_layouts  # noqa: E402

BASE = {"bench": "layouts", "device": "GPU", "model": "shape:x", "dtype": "bfloat16",
        "prompt_len": 32, "new_tokens": 64}


def _decode(tp, pp, system, sha, tok_s, pcg=True, al=1.0):
    return {**BASE, "metric": "decode", "tp": tp, "pp": pp, "layout": f"tp{tp}pp{pp}",
            "pcg": pcg, "system": system, "batch": 4, "output_sha": sha,
            "decode_tok_s": tok_s, "accept_length": al}


def _lines():
    one = ["a", "b", "c", "d"]
    spec = bench_layouts.lines_of(
        [{"system": "no-spec", "metric": "decode", "batch": 4, "decode_tok_s": 100.0,
          "accept_length": 1.0, "output_sha": ["a", "b", "x", "d"]},
         {"system": "NGRAM p=0.7", "metric": "decode", "batch": 4, "decode_tok_s": 150.0,
          "accept_length": 2.5, "output_sha": ["q"] * 4}],
        (2, 1), True, type("A", (), {"model_path": "shape:x", "dtype": "bfloat16",
                                     "prompt_len": 32, "max_new_tokens": 64})(),
        {"device": "GPU"})
    ranks = [{"rank": r, "stage": 0, "tp_rank": r, "memory_allocated_mb": 9000.0 + r,
              "piecewise_cuda_graph": {"enabled": True, "capture_time_s": 1.5 + r,
                                       "capture_memory_mb": 40.0}} for r in range(2)]
    return [_decode(1, 1, "no-spec", one, 200.0), _decode(1, 1, "no-spec", one[::-1], 190.0,
                                                          pcg=False),
            _decode(1, 1, "EAGLE3", one, 150.0, al=1.1),
            {**BASE, "metric": "startup", "system": "no-spec", "tp": 2, "pp": 1,
             "layout": "tp2pp1", "pcg": True, "value": 30.0, "ranks": ranks},
            {**BASE, "metric": "ttft", "system": "no-spec", "tp": 2, "pp": 1, "layout": "tp2pp1",
             "pcg": True, "prompt_len": 512, "value": 12.5}] + spec


def test_identity_is_against_the_one_gpu_line_of_the_same_graph_setting():
    lines = _lines()
    tp2, synthetic = lines[-2], lines[-1]
    assert bench_layouts.identical(tp2, lines) == 0.75  # request 3 differs
    assert bench_layouts.identical(lines[1], lines) == 1.0  # graphs off: its own reference
    assert bench_layouts.identical(synthetic, lines) is None  # NOT lossless: not compared
    assert synthetic["efficiency"] == 150.0 / 100.0 / 2.5  # against its own layout's no-spec


def test_the_report_holds_every_table_and_the_plot(tmp_path):
    lines = _lines()
    text = bench_layouts.render_table(lines)
    row = next(r for r in text.splitlines() if r.startswith("| tp2pp1 pcg | no-spec"))
    assert "| 100 | 0.75 |" in row
    assert "| tp2pp1 pcg | NGRAM p=0.7 | 150 | - | 2.50 / 0.60 |" in text
    assert "| tp2pp1 pcg | 12.5 |" in text  # TTFT at 512 tokens
    assert "| tp2pp1 pcg | 1 | 0 | 2.50 | 40.0 |" in text  # rank 1's capture
    bench_layouts.render_plot(lines, tmp_path / "layouts.png")
    assert (tmp_path / "layouts.png").stat().st_size > 1000
