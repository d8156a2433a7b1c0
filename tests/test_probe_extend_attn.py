"""benchmarks/probe_extend_attn.py: its cells' inputs and variants (no GPU; the kernel through
the Triton interpreter)."""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_extend_attn  # noqa: E402


def test_each_prompt_of_a_cell_has_its_own_row_and_no_prefix():
    inputs = probe_extend_attn.cell_inputs(3, 4, "cpu")
    assert inputs["req_to_token"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert inputs["req_pool_indices"].tolist() == [0, 1, 2]
    assert inputs["seq_lens"].tolist() == inputs["extend_lens"].tolist() == [4, 4, 4]
    assert inputs["q_starts"].tolist() == [0, 4, 8, 12]


def test_configs_name_their_variants():
    args = SimpleNamespace(configs=["32,64,4,2"], module=[])
    names = [(name, config) for name, _, config in probe_extend_attn.variants(args)]
    assert names == [("this", None), ("this/32,64,4,2", (32, 64, 4, 2))]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or os.environ.get("TRITON_INTERPRET") != "1", reason="needs CPU triton")
def test_a_cells_prompts_are_attended_each_alone():
    """Two prompts of a cell give what each gives as a cell of one (its keys, no one else's)."""
    from specpcg.attention import triton_extend

    torch.manual_seed(0)
    q, k, v = torch.randn(40, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    both = torch.zeros_like(q)
    probe_extend_attn.runner(triton_extend, 2, 20, None)(
        q, k, v, both, probe_extend_attn.cell_inputs(2, 20, "cpu"))
    for i in range(2):
        rows = slice(20 * i, 20 * i + 20)
        alone = torch.zeros_like(q[rows])
        probe_extend_attn.runner(triton_extend, 1, 20, None)(
            q[rows], k[rows], v[rows], alone, probe_extend_attn.cell_inputs(1, 20, "cpu"))
        assert torch.equal(alone, both[rows])


def _line(variant, batch, length, us, shape="smollm2-135m"):
    return json.dumps({"variant": variant, "shape": shape, "batch": batch, "length": length,
                       "us_per_call": us})


def test_the_plot_takes_each_variants_least_and_refuses_an_empty_selection(tmp_path, monkeypatch):
    results = tmp_path / "r.jsonl"
    results.write_text("\n".join([_line("this", 1, 512, 9.0), _line("this", 1, 512, 8.0),
                                  _line("old", 1, 512, 12.0), _line("this", 8, 512, 18.0)]))
    drawn = {}
    monkeypatch.setattr(probe_extend_attn.common, "line_plot",
                        lambda panels, path, title: drawn.update(panels=panels, path=path))
    probe_extend_attn.main(["--plot", str(tmp_path / "p.png"), str(results), "this"])
    assert [p["title"] for p in drawn["panels"]] == ["smollm2-135m, batch 1",
                                                     "smollm2-135m, batch 8"]
    assert drawn["panels"][0]["series"] == {"this": [(512, 8.0)]}
    with pytest.raises(ValueError, match="no results of variants"):
        probe_extend_attn.main(["--plot", str(tmp_path / "p.png"), str(results), "new"])
