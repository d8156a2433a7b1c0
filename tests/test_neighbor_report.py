"""benchmarks/neighbor_report.py: probe_neighbor.py's lines as a table and a plot, runs and
stages named as the probe ran them."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import neighbor_report as report  # noqa: E402


def _line(second: str, stage: str, tok_s: float, device_us=None, **run) -> dict:
    return {"probe": "neighbor", "second": second, "algorithm": run.pop("algorithm", "STANDALONE"),
            "second_kw": run.pop("second_kw", {}), "stage": stage, "tok_s": tok_s,
            "device_in_call_us": device_us, "device_between_calls_us": None,
            "host_call_to_call_us": 900.0, **run}


@pytest.mark.parametrize("stage, expected", [
    ("alone", "alone"), ("beside adaptive", "beside"), ("built after pinned", "beside"),
    ("recaptured, beside adaptive", "captured again"), ("held plain, alone", "alone"),
    ("held plain, alone, recaptured", "captured again"), ("adaptive closed", "closed")])
def test_each_probe_stage_is_one_of_the_reports(stage, expected):
    assert report.stage_of(stage) == expected


def test_runs_are_named_by_the_second_engine_its_arguments_and_flags():
    assert report.run_label(_line("adaptive", "alone", 1.0)) == "adaptive STANDALONE"
    line = _line("adaptive", "alone", 1.0, algorithm="NGRAM",
                 second_kw={"disable_cuda_graph": True}, held_alone=True)
    assert report.run_label(line) == "adaptive NGRAM disable_cuda_graph=True held_alone"
    assert report.run_label(_line("no-spec", "alone", 1.0, algorithm=None)) == "no-spec"


def test_the_table_and_plot_hold_each_stages_rounds(tmp_path):
    lines = [_line("adaptive", "alone", 16400.0, 886.0), _line("adaptive", "alone", 16500.0, 884.0),
             _line("adaptive", "beside adaptive", 14500.0, 997.0),
             _line("adaptive", "beside adaptive", 15100.0, 995.0),
             _line("pinned", "beside pinned", 15200.0), {"probe": "other"}]
    table = report.render_table(lines).splitlines()
    assert len(table) == 2 + 3  # header, rule, one row per run and stage
    assert table[2].split(" | ")[1:5] == ["alone", "2", "16,400-16,500", "885"]
    assert table[3].split(" | ")[1:5] == ["beside", "2", "14,500-15,100", "996"]
    assert table[4].split(" | ")[:5] == ["| pinned STANDALONE", "beside", "1", "15,200-15,200",
                                         "-"]
    path = tmp_path / "neighbor.jsonl"
    path.write_text("\n".join(json.dumps(ln) for ln in lines) + "\n")
    report.main([str(path)])
    assert path.with_suffix(".png").stat().st_size > 0
