"""sim_adaptive.py's table and plot: per cell, adaptive speculation against the faster pinned
side, for the lines of the file's last run."""

import common


def _hiccup(record: dict) -> str:
    prob, factor = record.get("hiccup", (0.0, 1.0))
    return f"{prob:.0%} {factor:g}x" if prob > 0 else "none"


def _last_run(records: list) -> list:
    """The lines of the last run: its commit and look budget."""
    key = lambda r: (r.get("git"), r.get("look_budget"), r.get("max_every"),  # noqa: E731
                     r.get("rounds"), r.get("growth"),
                     r.get("shadow", False), r.get("shadow_finish", 0), r.get("sequence", False))
    return [r for r in records if key(r) == key(records[-1])] if records else []


def render_table(records: list) -> str:
    latest = _last_run(records)
    rows = [[_hiccup(r), f"{r.get('alpha', 0.7):.2f}" + (" rising" if r.get("growth") else "")
             + (", shadow verifies" if r.get("shadow") else "")
             + (f", finish over {r['shadow_finish']}" if r.get("shadow_finish") else ""),
             f"{r['spread']:.2f}", str(r["batch"]),
             f"{r['plain_s'] / r['spec_s']:.2f}x", f"{r['plain_s'] / r['adaptive_s']:.2f}x",
             f"{r['vs_best']:.3f}"] for r in latest]
    return common.markdown_table(["hiccups (share of steps, slowdown)", "mean accept chance",
                                  "accept spread", "batch", "pinned spec vs plain",
                                  "adaptive vs plain", "adaptive vs the faster pinned side"],
                                 rows)


def render_plot(records: list, path) -> None:
    latest = _last_run(records)
    spreads = sorted({r["spread"] for r in latest})
    panels = [{"title": f"accept spread {s:.2f}", "ylabel": "speed",
               "labels": [f"bs {r['batch']}\n{_hiccup(r)}" for r in latest
                          if r["spread"] == s],
               "values": {"adaptive vs the faster pinned side":
                          [r["vs_best"] for r in latest if r["spread"] == s]}}
              for s in spreads]
    common.grouped_bar_plot(panels, ["adaptive vs the faster pinned side"], path,
                            "simulated adaptive speculation (1.0: as fast as the better side)")
