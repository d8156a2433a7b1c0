"""sim_adaptive.py's command line, and its table and plot: per cell, adaptive speculation
against the faster pinned side, for the lines of the file's last run."""

import argparse

import common
from sim_rates import RATES


def _hiccup(record: dict) -> str:
    prob, factor = record.get("hiccup", (0.0, 1.0))
    return f"{prob:.0%} {factor:g}x" if prob > 0 else "none"


def _last_run(records: list) -> list:
    """The lines of the last run: its commit and look budget."""
    key = lambda r: (r.get("git"), r.get("look_budget"), r.get("max_every"),  # noqa: E731
                     r.get("rounds"), r.get("growth"),
                     r.get("shadow", False), r.get("shadow_finish", 0), r.get("sequence", False),
                     r.get("rates"), r.get("shadow_budget", 0))
    return [r for r in records if key(r) == key(records[-1])] if records else []


def render_table(records: list) -> str:
    latest = _last_run(records)
    rows = [[_hiccup(r), f"{r.get('alpha', 0.7):.2f}" + (" rising" if r.get("growth") else "")
             + (", shadow verifies" if r.get("shadow") else "")
             + (f", finish over {r['shadow_finish']}" if r.get("shadow_finish") else "")
             + (f", {r['shadow_budget']} a step" if r.get("shadow_budget") else ""),
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


def parser(prompt_len: int, doc: str) -> argparse.ArgumentParser:
    """sim_adaptive.py's options (prompt_len: --prompt-len's default; doc: its docstring)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--spreads", type=float, nargs="+", default=[0.0, 0.1, 0.2])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.7],
                   help="mean chance that a draft token is accepted (0.05: an untrained draft)")
    p.add_argument("--batches", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--hiccup", type=float, nargs=2, default=[0.0, 1.0], metavar=("PROB", "X"),
                   help="a step of either side takes X times as long with probability PROB")
    p.add_argument("--growth", action="store_true",
                   help="acceptance rising along each output, from 0 to twice the mean")
    p.add_argument("--shadow", action="store_true",
                   help="the controller gets shadow verifies, as NGRAM's engine does")
    p.add_argument("--shadow-budget", type=int, default=0, metavar="N",
                   help="N shadow verifies a step shared round-robin, as the engine's "
                        "EVALS_PER_STEP (0: every new token judged)")
    p.add_argument("--shadow-finish", type=int, default=0, metavar="N",
                   help="shadow verifies priced by the finish estimate over each request's last N")
    p.add_argument("--rounds", type=int, default=5,
                   help="batches each simulated engine runs, one after another")
    p.add_argument("--max-every", type=int, default=None,
                   help="the controller's EXPLORE_MAX_EVERY for this run (default: the engine's)")
    p.add_argument("--look-budget", type=float, default=None,
                   help="the controller's LOOK_BUDGET for this run (default: the engine's)")
    p.add_argument("--calibrate", default=None, metavar="JSONL",
                   help="step times and accept chances from a probe_adaptive_steps.py log "
                        "(pinned and no-spec systems); --alphas and --spreads are then unused")
    p.add_argument("--catch-up", type=float, nargs="+", default=None, metavar="A_MS B_US",
                   help="a switch into speculation costs A ms and B us per missed position; "
                        "C: ms more, once, at an engine's first look")
    p.add_argument("--rates", choices=sorted(RATES), default="h100-nextn",
                   help="measured step rates the simulated steps take (RATES)")
    p.add_argument("--prompt-len", type=int, default=prompt_len,
                   help="with --catch-up, the positions a new request's draft misses")
    p.add_argument("--untold-lag", action="store_true",
                   help="with --catch-up, the controller counts only plain steps' positions")
    p.add_argument("--unplaced", action="store_true", help="a batch of one's position untold")
    p.add_argument("--sequence", action="store_true",
                   help="--batches in order on one controller, one untimed and two timed "
                        "batches each (bench_adaptive's engine)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "sim_adaptive.jsonl"))
    return p
