"""benchmarks/probe_decode_attn.py: its chain's inputs and plots of its results (no GPU)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_decode_attn  # noqa: E402


def _line(variant, batch, nodes, context, us, shape=None):
    line = {"variant": variant, "batch": batch, "nodes": nodes, "context": context,
            "us_per_call": us}
    return json.dumps(line if shape is None else {**line, "shape": shape})


def test_node_j_of_a_request_sees_its_row_up_to_itself():
    inputs = probe_decode_attn.step_inputs(2, 5, 3, "cpu")
    assert inputs["req_to_token"].tolist() == [list(range(8)), list(range(8, 16))]
    assert inputs["req_pool_indices"].tolist() == [0, 0, 0, 1, 1, 1]
    assert inputs["seq_lens"].tolist() == [6, 7, 8, 6, 7, 8]
    pools = probe_decode_attn.layer_pools(3, 2, 5, 3, probe_decode_attn.SHAPES["llama-3-8b"],
                                          "cpu")
    assert len(pools) == 3 and pools[0][0].shape == (16, 8, 128)
    assert pools[0][1].dtype == torch.bfloat16


def test_a_plot_has_a_panel_a_batch_and_a_line_a_named_variant_of_one_shape(tmp_path,
                                                                           monkeypatch):
    results = tmp_path / "r.jsonl"
    results.write_text("\n".join([
        _line("main", 1, 1, 64, 5.0), _line("main", 1, 1, 64, 4.0),  # older lines: no shape
        _line("main", 1, 1, 256, 6.0, "smollm2-135m"), _line("new", 1, 1, 64, 3.0),
        _line("other", 1, 1, 64, 9.0), _line("main", 16, 1, 64, 7.0),
        _line("main", 1, 1, 64, 8.0, "llama-3-8b")]) + "\n")
    drawn = []
    monkeypatch.setattr(probe_decode_attn.common, "line_plot",
                        lambda panels, path, title: drawn.extend(panels))
    probe_decode_attn.plot(str(tmp_path / "o.png"), str(results), ["main", "new"],
                           "smollm2-135m")
    assert [p["title"] for p in drawn] == ["smollm2-135m, batch 1", "smollm2-135m, batch 16"]
    assert drawn[0]["series"] == {"main": [(64, 4.5), (256, 6.0)], "new": [(64, 3.0)]}
    assert drawn[1]["series"] == {"main": [(64, 7.0)]}
    with pytest.raises(ValueError, match="no results of shape llama-3-8b and variants"):
        probe_decode_attn.plot(str(tmp_path / "o.png"), str(results), ["new"], "llama-3-8b")


def test_a_verify_panel_also_runs_each_variant_with_fewer_nodes_a_program():
    a, b = object(), object()
    runs = probe_decode_attn.runs([("this", a), ("main", b)], 8, [4, 3, 8, 2])
    assert runs[:6] == [("this", a, 8), ("main", b, 8), ("this/4", a, 4), ("main/4", b, 4),
                        ("this/2", a, 2), ("main/2", b, 2)]
    assert runs[6:] == runs[:6]  # twice, alternating
    assert probe_decode_attn.runs([("this", a)], 1, [4]) == [("this", a, 1)] * 2
