"""Shared helpers for the benchmark scripts: timing, machine description, JSON lines, tables, plots.

Benchmarks are scripts (never timed tests). Each measurement is one JSON line; a script appends
its lines to a results file and renders a Markdown table and a PNG from them, so a table can be
re-rendered later from the file alone.
"""

from __future__ import annotations

import collections
import datetime
import gc
import gzip
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Benchmarks of the speculative path itself (accept length, its cost) speculate at every step
# and verify the whole chain: adaptive speculation would mix plain decode steps in where they
# measure faster, and cut chains at large batches (chain depth per batch size).
PINNED_SPEC = {"disable_adaptive_speculation": True}
GIT_ENV = "SPECPCG_GIT_COMMIT"  # set it where the checkout has no .git (a copied working tree)


def add_repo_to_path() -> None:
    """Lets `python benchmarks/x.py` import specpcg from this checkout without an install."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def load_module(name: str, path):
    """The Python file at `path` as a module named `name` (another tree's copy of one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# -- timing ------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device):
    """(fn(), seconds); the device is synchronized before and after so queued kernels count."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - t0


def replay_us(graph, replays: int) -> float:
    """GPU microseconds per replay of a captured CUDA graph (one warm-up replay first)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def output_digest(ids: list) -> str:
    """A short digest of one request's output ids: two engines' outputs for the same prompt are
    the same text exactly where their digests match (in bf16 a near tie can turn a speculative
    step's token from a plain step's, and the rest of the answer with it). bench_layouts.py
    compares its lines' digests with recorded ones: the encoding stays as it wrote them."""
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:12]


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def free_memory(device: torch.device) -> None:
    """Returns what a dropped model or KV cache held to the device before the next system."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- machine description -----------------------------------------------------------------------
def git_commit() -> Optional[str]:
    """Short commit of the checkout, read from .git files (no git process); None if unknown."""
    if os.environ.get(GIT_ENV):
        return os.environ[GIT_ENV][:7]
    git_dir = REPO_ROOT / ".git"
    if not (git_dir / "HEAD").is_file():
        return None
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head[:7]
    ref = head[5:]
    if (git_dir / ref).is_file():
        return (git_dir / ref).read_text().strip()[:7]
    packed = git_dir / "packed-refs"
    lines = packed.read_text().splitlines() if packed.is_file() else []
    return next((p[0][:7] for p in map(str.split, lines) if len(p) == 2 and p[1] == ref), None)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def parse_setting(text: str) -> tuple:
    """'7,1,8' -> (7, 1, 8): a (steps, topk, draft tokens) setting on a command line."""
    return tuple(int(x) for x in text.split(","))


def machine_info(device: torch.device) -> dict:
    """The fields every JSON line carries about where and with what it was measured."""
    import transformers

    return {"device": device_name(device), "torch": torch.__version__,
            "transformers": transformers.__version__, "git": git_commit()}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- JSON lines --------------------------------------------------------------------------------
def append_jsonl(path, records: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def emit_line(line: dict, path=None) -> None:
    """Prints a probe's JSON line, and appends it to `path` where one is given."""
    print(json.dumps(line), flush=True)
    if path:
        append_jsonl(path, [line])


def read_jsonl(path) -> list[dict]:
    """A results file's records; a name ending .gz is read through gzip (long step logs)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"results file {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- rendering ---------------------------------------------------------------------------------
def fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:,.{digits}f}"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def grouped_bar_plot(panels: list[dict], series: list[str], path, title: str) -> None:
    """One subplot per panel; in each, one group of bars per x label and one bar per series.

    panel: {"title": str, "ylabel": str, "labels": [str], "values": {series: [float|None]}}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    width = 0.8 / max(len(series), 1)
    for ax, panel in zip(axes[0], panels):
        for i, name in enumerate(series):
            vals = panel["values"].get(name, [None] * len(panel["labels"]))
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(vals))]
            heights = [v or 0.0 for v in vals]
            bars = ax.bar(xs, heights, width, label=name)
            for bar, v in zip(bars, vals):
                if v is not None:
                    ax.annotate(fmt(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                                textcoords="offset points")
        ax.set_xticks(range(len(panel["labels"])), panel["labels"])
        ax.set_title(panel["title"])
        ax.set_ylabel(panel["ylabel"])
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def line_plot(panels: list[dict], path, title: str) -> None:
    """One subplot per panel, one line per series. panel: {"title", "xlabel", "ylabel": str,
    "logx", "logy": bool (log 2 / log 10 axes), "series": {name: [(x, y), ...]},
    "styles": {name: matplotlib plot kwargs} (optional)}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name, points in panel["series"].items():
            points = sorted(p for p in points if p[1] is not None)
            style = {"marker": "o", "markersize": 4, **panel.get("styles", {}).get(name, {})}
            if points:
                ax.plot(*zip(*points), label=name, **style)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plain)
        if panel.get("logy"):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(1, 0.4)))  # 20, 30, ...
        ax.set_title(panel["title"], fontsize=10)
        ax.set(xlabel=panel["xlabel"], ylabel=panel["ylabel"])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latest_by(records: list[dict], bench: str, key: Callable[[dict], tuple]) -> tuple[dict, dict]:
    """({key(line): {system: line}}, last line): the latest line of each key and system, among
    the `bench` lines measured on the same device as the last of them."""
    records = [r for r in records if r.get("bench") == bench]
    if not records:
        raise ValueError(f"no {bench} benchmark lines to render")
    table: dict = {}
    for r in records:
        if r["device"] == records[-1]["device"]:
            table.setdefault(key(r), {})[r["system"]] = r
    return table, records[-1]


# -- specpcg engine helpers ------------------------------------------------------------------
def chain_depth(engine) -> Optional[dict]:
    """The chain depth each bucket picked, its shares and step times (None: the whole chain
    at every batch size)."""
    graphs = (engine.get_server_info()["speculative"] or {}).get("step_graphs") or {}
    return graphs.get("chain_depth")


def generate_ids(engine, ids: list, num_new: int) -> list[dict]:
    """meta_info of each greedy request (EOS ignored), checked to have `num_new` tokens."""
    params = {"max_new_tokens": num_new, "temperature": 0, "ignore_eos": True}
    metas = [o["meta_info"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    short = [m.get("finish_reason") for m in metas if m["completion_tokens"] != num_new]
    assert not short, f"short output: {short[:3]}"
    return metas


def decode_steps(meta: dict) -> int:
    """The decode steps that gave a request its tokens after the first: its verifies and plain
    steps with a draft, one a token without."""
    steps = meta.get("spec_verify_ct", 0) + meta.get("plain_decode_tokens", 0)
    return steps or meta["completion_tokens"] - 1


def batch_decode(metas: list[dict]) -> dict:
    """One batch's decode, its requests submitted together. The scheduler prefills every prompt
    before any decode step, so decoding starts at the batch's last first token: time before it
    is other requests' prefill, which an early request's (e2e - ttft) holds.
    itl_s: seconds per token of the slowest request from there (batch / itl_s: the decode rate
    the batch sees). step_s: seconds per decode step of the request that finished first, all of
    whose steps carried the whole batch (the slowest's last steps run with fewer requests).
    tokens_per_step: that request's tokens per step."""
    start = max(m["ttft"] for m in metas)
    slowest = max(metas, key=lambda m: m["e2e_latency"])
    first = min(metas, key=lambda m: m["e2e_latency"])
    steps = max(decode_steps(first), 1)
    return {"itl_s": (slowest["e2e_latency"] - start) / max(slowest["completion_tokens"] - 1, 1),
            "step_s": (first["e2e_latency"] - start) / steps,
            "tokens_per_step": (first["completion_tokens"] - 1) / steps}


def served_by(engine, mode: str, fn: Callable) -> tuple:
    """(fn(), the set of runners that served `mode` forwards during fn), from forward_stats."""
    def counts():
        return collections.Counter({(s["mode"], s["runner"], s["reason"]): s["count"]
                        for s in engine.get_server_info()["forward_stats"]})

    before = counts()
    result = fn()
    return result, {runner for m, runner, _ in counts() - before if m == mode}


def model_config(model_path: str):
    """The ModelConfig of a checkpoint path or a `shape:` preset, without building the model."""
    from specpcg.models.build import SHAPE_PREFIX, preset_config
    from specpcg.models.loader import load_checkpoint

    if model_path.startswith(SHAPE_PREFIX):
        return preset_config(model_path)
    return load_checkpoint(model_path)[0]


def run_json_worker(script: str, flag: str, spec: dict, code: Optional[str] = None):
    """`python script flag JSON(spec)` in a process of its own (with `code` first on its path
    and as its directory, where given): the JSON its last stdout line holds."""
    code = code or str(REPO_ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, script, flag, json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=code)
    if proc.returncode:
        raise RuntimeError(f"{os.path.basename(script)} worker {spec.get('layout')} at {code}: "
                           f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def column_table(keys: list, columns: list) -> str:
    """Markdown table, a row per key; columns: [(header, key -> cell)]; floats and None: fmt."""
    rows = [[fmt(x) if isinstance(x, float) or x is None else x
             for x in (cell(k) for _, cell in columns)] for k in keys]
    return markdown_table([header for header, _ in columns], rows)


def measure_or_render(p, argv, run_all: Callable, render_table: Callable,
                      render_plot: Callable) -> None:
    """A benchmark's main after its own options (parser `p`, which has --out): adds
    --table-only, measures (run_all(args)) unless it names a results file, then renders the
    table and plot of that file or of --out."""
    p.add_argument("--table-only", metavar="FILE", default=None,
                   help="re-render the table and plot from FILE, measuring nothing")
    args = p.parse_args(argv)
    if not args.table_only:
        run_all(args)
    render_results(args.table_only or args.out, render_table, render_plot)


def render_results(path, render_table: Callable, render_plot: Callable) -> None:
    """Prints the Markdown table of a results file and writes its plot next to it (.png)."""
    records, png = read_jsonl(path), Path(path).with_suffix(".png")
    print(render_table(records))
    render_plot(records, png)
    print(f"\nplot: {png}")
