"""The table and plot of probe_neighbor.py's lines: per run (the second engine and its flags),
the first engine's rounds by stage (alone, beside the second engine, its decode graphs captured
again, the second closed): tok/s and the decode graph runner's time a call.

    python benchmarks/neighbor_report.py benchmarks/results/neighbor_split_6af20be_h200.jsonl
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import common

STAGES = ("alone", "beside", "captured again", "closed")


def run_label(line: dict) -> str:
    """The run a line belongs to: the second engine, its arguments and the probe's flags."""
    parts = [line["second"], line.get("algorithm") or ""]
    parts += [f"{k}={v}" for k, v in sorted((line.get("second_kw") or {}).items())]
    parts += [flag for flag in ("second_first", "held_alone") if line.get(flag)]
    return " ".join(p for p in parts if p)


def stage_of(stage: str) -> str:
    """A line's stage as one of STAGES (the probe's names carry the second engine's)."""
    if "recaptured" in stage:
        return "captured again"
    if stage.endswith("closed"):
        return "closed"
    if stage.startswith(("beside", "built after")):
        return "beside"
    return "alone"


def grouped(records: list) -> dict:
    """{run: {stage: [lines]}}, runs and stages in the order first met."""
    out = defaultdict(lambda: defaultdict(list))
    for line in records:
        if line.get("probe") == "neighbor":
            out[run_label(line)][stage_of(line["stage"])].append(line)
    return out


def _med(lines: list, key: str):
    values = [ln[key] for ln in lines if ln.get(key) is not None]
    return common.median(values) if values else None


def render_table(records: list) -> str:
    rows = []
    for run, stages in grouped(records).items():
        for stage, lines in stages.items():
            rates = [ln["tok_s"] for ln in lines]
            rows.append([run, stage, len(lines), f"{min(rates):,.0f}-{max(rates):,.0f}",
                         common.fmt(_med(lines, "device_in_call_us")),
                         common.fmt(_med(lines, "device_between_calls_us")),
                         common.fmt(_med(lines, "host_call_to_call_us"))])
    return common.markdown_table(["run", "stage", "rounds", "tok/s", "device us in a call",
                                  "device us between calls", "host us call to call"], rows)


def render_plot(records: list, png) -> None:
    groups = grouped(records)
    runs = list(groups)
    stages = [s for s in STAGES if any(s in groups[r] for r in runs)]
    labels = [r.replace(" ", "\n") for r in runs]  # one word a line: long runs overlap
    panels = [{"title": title, "ylabel": ylabel, "labels": labels,
               "values": {s: [_med(groups[r][s], key) if s in groups[r] else None
                              for r in runs] for s in stages}}
              for title, ylabel, key in (("first engine's rounds", "tok/s", "tok_s"),
                                         ("its decode graph runner", "device us a call",
                                          "device_in_call_us"))]
    common.grouped_bar_plot(panels, stages, png, "A no-spec engine beside another "
                                                        "(probe_neighbor.py)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="probe_neighbor.py's --out")
    common.render_results(p.parse_args(argv).file, render_table, render_plot)


if __name__ == "__main__":
    main()
