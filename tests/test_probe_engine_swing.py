"""probe_engine_swing's reading of its own output: one (median rate, step, busy) per engine,
an engine's rates taken only with the window that follows them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_engine_swing as swing  # noqa: E402

OUTPUT = """\
engine 0: build 24.3s rates 1257 1257 1240 1243 1253 | 1980 MHz, P0 | marker Memcpy DtoH
# window: 127 steps, 1320.0 us a step, busy 455.6 us, idle 864.3 us a step (kernels' own time)
  gaps over 20 us:  323.9 us a step  a -> b
  untraced again: 864 tok/s (incl. prefill)
engine 1: build 13.7s rates 719 733 719 738 733 | no nvidia-smi | marker x
# window: only 2 steps found
engine 2: build 14.1s rates 730 720 713 722 715 | 1980 MHz, P0 | marker Memcpy DtoH
# window: 127 steps, 979.5 us a step, busy 457.7 us, idle 521.8 us a step (kernels' own time)
"""


def test_each_engine_with_a_window_gives_its_median_rate_step_and_busy(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text(OUTPUT)
    assert swing.read_output(str(path)) == [(1253.0, 1320.0, 455.6), (720.0, 979.5, 457.7)]


def test_the_plot_has_a_step_panel_and_a_rate_panel_per_file(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    path.write_text(OUTPUT)
    seen = {}
    monkeypatch.setattr(swing.common, "grouped_bar_plot",
                        lambda panels, series, out, title: seen.update(panels=panels, out=out))
    swing.plot([f"a={path}", f"b={path}"], "p.png")
    assert seen["out"] == "p.png" and len(seen["panels"]) == 4
    assert seen["panels"][0]["values"]["kernels busy"] == [455.6, 457.7]
    assert seen["panels"][1]["values"]["median of 5"] == [1253.0, 720.0]


AB_OUTPUT = """\
engine 0: build 24.3s rates 1500 1510 1490 1505 1495 | 1980 MHz, P0 | marker Memcpy DtoH
  sampler pick: rates 1300 1310 1290 1305 1295
# window: 127 steps, 700.0 us a step, busy 458.0 us, idle 242.0 us a step (kernels' own time)
engine 1: build 13.7s rates 900 910 890 905 895 | 1980 MHz, P0 | marker Memcpy DtoH
# window: 127 steps, 979.5 us a step, busy 457.7 us, idle 521.8 us a step (kernels' own time)
"""


def test_an_ab_output_pairs_each_engines_two_medians_and_skips_an_engine_without_one(tmp_path):
    path = tmp_path / "ab.txt"
    path.write_text(AB_OUTPUT)
    assert swing.read_ab(str(path)) == [(1500.0, 1300.0)]
    assert swing.read_output(str(path)) == [(1500.0, 700.0, 458.0), (900.0, 979.5, 457.7)]


def test_the_sampler_pick_drops_the_graphs_picks_and_restores_the_sampler():
    import specpcg.overlap as overlap

    seen, real = [], overlap.sample
    overlap.sample = lambda logits, reqs, greedy_ids=None: seen.append(greedy_ids)
    try:
        with swing.sampler_pick():
            overlap.sample("logits", [], "graph picks")
        overlap.sample("logits", [], "graph picks")
    finally:
        overlap.sample = real
    assert seen == [None, "graph picks"]


def test_the_ab_plot_has_both_picks_by_engine(tmp_path, monkeypatch):
    path = tmp_path / "ab.txt"
    path.write_text(AB_OUTPUT)
    seen = {}
    monkeypatch.setattr(swing.common, "grouped_bar_plot",
                        lambda panels, series, out, title: seen.update(panels=panels))
    swing.main(["--plot-ab", str(path), "--out", str(tmp_path / "p.png")])
    assert seen["panels"][0]["values"] == {"graph's pick": [1500.0],
                                           "sampler's pick": [1300.0]}
