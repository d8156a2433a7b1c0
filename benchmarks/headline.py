"""The README's headline table: a few figures picked from the latest JSON lines, each with the
commit and results file it came from. `benchmarks/report.py --readme README.md` writes it
between the README's two markers; the prose around it stays hand-written.
"""

from __future__ import annotations

from pathlib import Path

import common

BEGIN = "<!-- report:headline:begin -->"
END = "<!-- report:headline:end -->"


def latest(records: list[dict], bench: str, key) -> dict:
    """key(line) -> the latest `bench` line with that key."""
    return {key(r): r for r in records if r.get("bench") == bench}


def row(figure: str, value: str, line: dict, file: str) -> tuple:
    return figure, value, line.get("git") or "-", f"`{file}`"


def engine_rows(records: list[dict]) -> list[tuple]:
    t = latest(records, "engine", lambda r: (r["system"], r["metric"], r["batch_size"]))
    rows = []
    for bs in sorted({k[2] for k in t if k[1] == "decode_tok_s"}):
        ours = t.get(("specpcg_graphs", "decode_tok_s", bs))
        hf = t.get(("hf_static", "decode_tok_s", bs))
        if ours and hf:
            rows.append(row(f"no-spec decode, batch {bs}, against HF static-cache `generate`",
                            f"{common.fmt(ours['value'])} vs {common.fmt(hf['value'])} tok/s "
                            f"({ours['value'] / hf['value']:.2f}x)", ours, "engine.jsonl"))
    return rows


def spec_rows(records: list[dict]) -> list[tuple]:
    t = latest(records, "spec", lambda r: (r["system"], r.get("pcg"), r["batch_size"]))
    hf = t.get(("hf_plain", None, 1))
    spec = [r for (system, pcg, bs), r in t.items()
            if bs == 1 and pcg and system != "nospec" and not system.startswith("hf_")]
    if not spec:
        return []
    best = max(spec, key=lambda r: r["output_tok_s"])
    value = (f"{best['system'].upper()}: {common.fmt(best['output_tok_s'])} tok/s, "
             f"{best['speedup']:.2f}x no-spec")
    if hf:
        value += f", {best['output_tok_s'] / hf['output_tok_s']:.0f}x HF plain `generate`"
    return [row("best speculative decoding, batch 1, GSM8K", value, best, "spec.jsonl")]


def heads_rows(records: list[dict]) -> list[tuple]:
    t = latest(records, "heads", lambda r: (r["system"], str(r.get("setting")), r["pcg"],
                                            r["batch_size"]))
    chains = [r for r in t.values() if r.get("setting") and r["setting"][1] == 1 and r["pcg"]]
    rows = []
    for bs, figure, field in ((1, "highest head speedup, batch 1", "speedup"),
                              (16, "highest head accept length, batch 16", "accept_length")):
        best = max((r for r in chains if r["batch_size"] == bs), key=lambda r: r[field],
                   default=None)
        if best:
            rows.append(row(figure, f"{best['system']} {tuple(best['setting'])}: accept length "
                            f"{best['accept_length']:.2f}, {best['speedup']:.2f}x no-spec", best,
                            "heads.jsonl"))
    return rows


def accept_rows(records: list[dict]) -> list[tuple]:
    t = latest(records, "accept", lambda r: (r.get("part"), r["model"], r.get("prob"),
                                             r["batch_size"]))
    rows = []
    for model in dict.fromkeys(k[1] for k in t if k[0] == "B"):
        lines = [r for k, r in t.items() if k[0] == "B" and k[1] == model and k[2]]
        parts = []
        for bs in sorted({r["batch_size"] for r in lines}):
            eff = [r["efficiency"] for r in lines if r["batch_size"] == bs and r.get("efficiency")]
            if eff:
                parts.append(f"batch {bs}: {min(eff):.2f}-{max(eff):.2f}")
        if parts:
            rows.append(row(f"framework efficiency (synthetic acceptance), {model}",
                            "; ".join(parts), lines[-1], "accept.jsonl"))
    return rows


def graphs_rows(records: list[dict]) -> list[tuple]:
    t = latest(records, "graphs", lambda r: (r["model"], r["metric"], r["batch_size"],
                                             r.get("graph")))
    rows = []
    for (model, metric, _, _), r in t.items():
        if metric == "bw_fraction" and r.get("bw_limit_tok_s"):
            value = (f"{common.fmt(r['measured_tok_s'])} of {common.fmt(r['bw_limit_tok_s'])} "
                     f"tok/s ({r['value']:.2f})")
            rows.append(row(f"batch-1 decode against the HBM bound, {model}", value, r,
                            "graphs.jsonl"))
    return rows


def matrix_rows(records: list[dict]) -> list[tuple]:
    """One row per mode (default, deterministic): the latest line of each cell of that mode."""
    cells = latest(records, "gsm8k_matrix", lambda r: (
        bool(r.get("deterministic")), r["algorithm"], r["pcg"], r["attention_backend"],
        str(r.get("spec_settings"))))
    rows = []
    for mode in (False, True):
        lines = [r for key, r in cells.items() if key[0] == mode]
        if not lines:
            continue
        passed = sum(not r.get("failures") for r in lines)
        spec = [r["identical_frac"] for r in lines if r["algorithm"] != "none"]
        value = f"{passed} of {len(lines)} cells passed"
        if spec:
            value += f"; identical to no-spec {min(spec):.0%}-{max(spec):.0%}"
        commits = sorted({r.get("git") for r in lines if r.get("git")})
        label = "GSM8K matrix on the GPU" + (", deterministic mode" if mode else "")
        rows.append(row(label, value + f" (cells from {', '.join(commits)})", lines[-1],
                        "gsm8k_matrix.jsonl"))
    return rows


def reference_rows(records: list[dict]) -> list[tuple]:
    """Our decode over the compiled static-cache peer's, per model: each batch's latest ratio."""
    t = latest(records, "reference", lambda r: (r["model"], r["batch"]))
    rows = []
    for model in sorted({m for m, _ in t}):
        lines = [t[k] for k in sorted(k for k in t if k[0] == model)]
        value = "; ".join(f"batch {r['batch']}: {r['ratio']:.2f}x "
                          f"({common.fmt(r['specpcg_tok_s'])} vs "
                          f"{common.fmt(r['static_compiled_tok_s'])} tok/s)" for r in lines)
        rows.append(row(f"decode against a compiled static-cache peer, {model}", value,
                        lines[-1], "reference.jsonl"))
    return rows


SOURCES = (("engine.jsonl", engine_rows), ("spec.jsonl", spec_rows),
           ("heads.jsonl", heads_rows), ("accept.jsonl", accept_rows),
           ("graphs.jsonl", graphs_rows), ("reference.jsonl", reference_rows),
           ("gsm8k_matrix.jsonl", matrix_rows))


def table(results_dir: Path) -> str:
    rows = []
    for file, make in SOURCES:
        path = Path(results_dir) / file
        missing = [(file, "not measured", "-", "-")]
        rows += make(common.read_jsonl(path)) if path.exists() else missing
    lines = ["| figure | value | commit | results |", "| --- | --- | --- | --- |"]
    return "\n".join(lines + [f"| {' | '.join(r)} |" for r in rows])


def write_readme(readme: Path, results_dir: Path) -> None:
    """Replaces what lies between BEGIN and END in `readme` with the headline table."""
    text = Path(readme).read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{readme}: the markers {BEGIN!r} and {END!r} are missing or out of order")
    block = f"{BEGIN}\n{table(results_dir)}\n{END}"
    Path(readme).write_text(text[:start] + block + text[end + len(END):], encoding="utf-8")
