"""bench_accept.py's tables and plots, from its JSON lines: accept length per draft and
setting (part A), speedup and framework efficiency at synthetic acceptance (part B)."""

from __future__ import annotations

from pathlib import Path

import common

ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE")  # table order
IDEAL = {"color": "black", "linestyle": ":", "marker": ""}  # the y = x line of the speedup plot


def latest(records: list[dict], part: str, key) -> list[dict]:
    """The latest line per key of one part, among lines measured on the last line's device."""
    records = [r for r in records if r.get("bench") == "accept" and r.get("part") == part]
    return list({key(r): r for r in records if r["device"] == records[-1]["device"]}.values())


def rows_a(records):
    order = {a: i for i, a in enumerate(ALGORITHMS)}
    rows = latest(records, "A", lambda r: (r["prompt_set"], r["algorithm"], tuple(r["setting"])))
    return sorted(rows, key=lambda r: (r["prompt_set"], order.get(r["algorithm"], 99),
                                       r["setting"][1] > 1, r["setting"]))


def rows_b(records):
    rows = latest(records, "B", lambda r: (r["model"], r["prob"], r["batch_size"]))
    return sorted(rows, key=lambda r: (r["model"], r["batch_size"], r["prob"] or 0))


def expected_al(p: float, r: dict) -> float:  # sum_{i=0..k} p^i, k = num_draft_tokens - 1
    return sum(p ** i for i in range(r["num_draft_tokens"]))


def fields(pairs) -> list:
    return [(header, lambda r, f=f: r.get(f)) for header, f in pairs]


def render_tables(records: list[dict]) -> str:
    out = []
    if rows_a(records):
        out.append("Part A: accept length, real drafts (greedy; hist: % of verify steps "
                   "accepting 0, 1, ... drafts)\n\n" + common.column_table(rows_a(records), [
                       ("set", lambda r: r["prompt_set"]), ("algorithm", lambda r: r["algorithm"]),
                       ("(steps, topk, tokens)", lambda r: "({}, {}, {})".format(*r["setting"]))]
                       + fields((("prompts", "num_prompts"), ("AL (run)", "accept_length"),
                                 ("AL (mean/req)", "accept_length_mean_req"),
                                 ("tok/s", "output_tok_s")))
                       + [("hist %", lambda r: " ".join(
                           f"{100 * h / (sum(r['histogram_engine']) or 1):.0f}"
                           for h in r["histogram_engine"]))]))
    if rows_b(records):
        out.append("Part B: framework efficiency, synthetic acceptance (NOT lossless)\n\n"
                   + common.column_table(rows_b(records), [
                       ("model", lambda r: r["model"]), ("batch", lambda r: r["batch_size"]),
                       ("p", lambda r: "no-spec" if r["prob"] is None else f"{r['prob']:g}"),
                       ("draft tokens", lambda r: r["num_draft_tokens"] if r["prob"] else "-"),
                       ("E[AL]", lambda r: expected_al(r["prob"], r) if r["prob"] else None)]
                       + fields((("AL", "accept_length"), ("decode tok/s", "decode_tok_s"),
                                 ("speedup", "speedup"), ("efficiency", "efficiency"),
                                 ("speedup / AL", "efficiency_mean_al")))))
    return "\n\n".join(out)


def render_plots(records: list[dict], out: str, hist_setting: tuple) -> list:
    stem, paths = Path(out).with_suffix(""), []
    a, b = rows_a(records), rows_b(records)
    if a:
        tag = "{model}, {device} ({dtype}, git {git})".format(**a[-1])
        sets = list(dict.fromkeys(r["prompt_set"] for r in a))
        panels = []
        for name in sets:
            series, styles = {}, {}
            for r in (r for r in a if r["prompt_set"] == name):
                label = r["algorithm"] + (" tree" if r["setting"][1] > 1 else "")
                series.setdefault(label, []).append((r["setting"][2], r["accept_length"]))
                styles[label] = {"linestyle": "--"} if r["setting"][1] > 1 else {}
            panels.append({"title": f"{name}: accept length", "xlabel": "draft tokens (verify "
                           "width)", "ylabel": "accept length", "series": series,
                           "styles": styles})
        paths.append(f"{stem}_al.png")
        common.line_plot(panels, paths[-1], f"accept length vs draft tokens; {tag}")
        chosen = [r for r in a if tuple(r["setting"]) == hist_setting] or [
            r for r in a if tuple(r["setting"]) == tuple(a[-1]["setting"])]
        setting = chosen[0]["setting"]
        hist_panels = [{"title": f"{name}: setting {tuple(setting)}", "ylabel": "share of "
                        "verify steps", "labels": [str(k) for k in range(setting[2])],
                        "values": {r["algorithm"]: [h / (sum(r["histogram_engine"]) or 1)
                                                    for h in r["histogram_engine"]]
                                   for r in chosen if r["prompt_set"] == name}}
                       for name in sets]
        paths.append(f"{stem}_hist.png")
        common.grouped_bar_plot(hist_panels, list(dict.fromkeys(r["algorithm"] for r in chosen)),
                                paths[-1], f"accepted drafts per verify step; {tag}")
    if b:
        tag = "{device} (git {git}), NGRAM chain of {num_draft_tokens}".format(**b[-1])
        spec = [r for r in b if r["prob"] is not None]
        top = max([r["accept_length"] for r in spec] + [2.0])
        panels, eff_panels = [], []
        for model in dict.fromkeys(r["model"] for r in b):
            rows = [r for r in spec if r["model"] == model]
            series = {f"bs {bs}": [(r["accept_length"], r["speedup"]) for r in rows
                                   if r["batch_size"] == bs]
                      for bs in dict.fromkeys(r["batch_size"] for r in rows)}
            series["ideal (y = x)"] = [(1.0, 1.0), (top, top)]
            panels.append({"title": model, "xlabel": "accept length", "ylabel": "decode "
                           "speedup", "series": series, "styles": {"ideal (y = x)": IDEAL}})
            eff_panels.append({"title": model, "xlabel": "batch size", "ylabel": "decode step / "
                               "verify step (time)", "logx": True, "series": {
                                   f"p={p:g} (E[AL] {expected_al(p, rows[0]):.2f})": [
                                       (r["batch_size"], r["efficiency"])
                                       for r in rows if r["prob"] == p]
                                   for p in dict.fromkeys(r["prob"] for r in rows)}})
        paths.append(f"{stem}_speedup.png")
        common.line_plot(panels, paths[-1], f"speedup vs accept length (synthetic); {tag}")
        paths.append(f"{stem}_efficiency.png")
        common.line_plot(eff_panels, paths[-1], f"framework efficiency (synthetic); {tag}")
    return paths


COMPARE_METRICS = {  # --compare-metric: (a row's value, axis label, title)
    "efficiency": (lambda r: r["efficiency"], "decode step / verify step (time)",
                   "framework efficiency (synthetic acceptance), side by side"),
    "tok_s": (lambda r: r["decode_tok_s"], "decode tok/s",
              "decode tok/s, no-spec and speculative (synthetic acceptance), side by side"),
}


def plot_compare(labelled: list, out: str, metric: str = "efficiency") -> str:
    """Part B runs side by side (one file per build: LABEL=FILE): framework efficiency, or
    decode tok/s with no-spec as a group of its own; a panel per batch size, a group of bars
    per p and a bar per build. Returns the PNG's path."""
    value, ylabel, title = COMPARE_METRICS[metric]
    runs = [(label, rows_b(common.read_jsonl(path))) for label, path in labelled]
    batches = sorted({r["batch_size"] for _, rows in runs for r in rows})
    probs = sorted({r["prob"] for _, rows in runs for r in rows if r["prob"] is not None})
    if metric == "tok_s":
        probs = [None] + probs
    panels = []
    for bs in batches:
        values = {label: [next((value(r) for r in rows if r["batch_size"] == bs
                                and r["prob"] == p), None) for p in probs]
                  for label, rows in runs}
        panels.append({"title": f"batch {bs}", "ylabel": ylabel, "values": values,
                       "labels": ["no-spec" if p is None else f"p={p:g}" for p in probs]})
    common.grouped_bar_plot(panels, [label for label, _ in runs], out, title)
    return out
