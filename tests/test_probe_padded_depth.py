"""benchmarks/probe_padded_depth.py: its chain of launches is the model's linear layers in turn
(run in the Triton interpreter on CPU; the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest
import torch
from test_gemv import needs_interpreter  # sets TRITON_INTERPRET first on CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_padded_depth  # noqa: E402

from kernels import gemv  # noqa: E402


@needs_interpreter
@pytest.mark.parametrize("normed", [False, True])
def test_the_chain_is_each_launch_on_the_one_before(normed):
    torch.manual_seed(0)
    depth, rows = 48, 3
    weights = [torch.randn(depth, depth) * depth ** -0.5 for _ in range(3)]
    x, residual, gain = torch.randn(rows, depth), torch.randn(rows, depth), torch.rand(depth) + 0.5
    bufs = (torch.empty(rows, depth), torch.empty(rows, depth))
    norm = (residual, gain, torch.empty(rows, depth)) if normed else None
    got = probe_padded_depth.chain(weights, x, bufs, norm)
    want = x
    for w in weights:
        want = (gemv.normed_linear_torch(want, residual, gain, 1e-5, w)[0] if normed
                else gemv.linear_torch(want, w))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if normed:  # the launch writes x + residual of its rows (the last call's here)
        torch.testing.assert_close(norm[2], bufs[1] + residual)


def _line(rows, norm, depth, us, **extra):
    return {"probe": "padded_depth", "rows": rows, "norm": norm, "depth": depth,
            "us_a_call": us, **extra}


def test_a_plot_has_a_panel_for_plain_and_normed_launches_and_a_line_a_row_count(tmp_path,
                                                                                  monkeypatch):
    """Each point the median of its depth's lines; a results file's "tree" tag splits lines."""
    import json

    path = tmp_path / "r.jsonl"
    lines = [_line(8, False, 576, 2.2), _line(8, False, 576, 2.4), _line(8, False, 512, 1.7),
             _line(2, False, 512, 1.5), _line(8, True, 576, 3.2),
             _line(8, False, 576, 2.1, tree="pieces")]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    drawn = {}
    monkeypatch.setattr(probe_padded_depth.common, "line_plot",
                        lambda panels, png, title: drawn.update(png=png, panels=panels))
    probe_padded_depth.main(["--plot", str(tmp_path / "out.png"), str(path)])
    plain, normed = drawn["panels"]
    assert drawn["png"] == str(tmp_path / "out.png")
    assert plain["series"] == {"2 rows": [(512, 1.5)],
                               "8 rows": [(512, 1.7), (576, pytest.approx(2.3))],
                               "8 rows, pieces": [(576, 2.1)]}
    assert normed["series"] == {"8 rows": [(576, 3.2)]}
