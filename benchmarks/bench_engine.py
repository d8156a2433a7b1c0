"""Engine speed against Hugging Face transformers on the same GPU and the same weights.

One run measures decode tokens/s (batch 1 and 32; 32-token prompts, 256 new tokens, greedy, EOS
ignored) and time to first token (batch 1; 128/512/2048-token prompts, max_new_tokens=1) for
specpcg, HF `generate` with its dynamic cache ("hf_eager") and with `cache_implementation=
"static"` ("hf_static"); medians of --repeats. Each measurement is one JSON line appended to
--out; a Markdown table is printed and a bar plot saved next to it (engine.png).
Decode time is the time after the first token: specpcg `e2e_latency - ttft` of the batch (its
slowest request), HF generate(N) - generate(1) on the same inputs; tokens/s = batch * (N - 1) /
decode time. Prompts: deterministic ids cut from the GSM8K test questions, the same for all.

    python benchmarks/bench_engine.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_engine.py --quick --out /tmp/engine.jsonl     # CPU smoke run
    python benchmarks/bench_engine.py --table-only benchmarks/results/engine.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass

import torch

import common
import hf_reference

common.add_repo_to_path()

SYSTEMS = {"specpcg_eager": "specpcg eager", "specpcg_graphs": "specpcg graphs",
           "hf_eager": "HF eager", "hf_static": "HF static"}
# (numerator, denominator) pairs shown as ratio columns
RATIOS = (("specpcg_graphs", "hf_static"), ("specpcg_eager", "hf_eager"),
          ("specpcg_graphs", "specpcg_eager"))
METRICS = {"decode_tok_s": "decode tok/s (higher is better)",
           "ttft_ms": "TTFT ms (lower is better)"}


@dataclass(frozen=True)
class Settings:
    decode_batches: tuple = (1, 32)
    decode_prompt_len: int = 32
    new_tokens: int = 256
    ttft_prompt_lens: tuple = (128, 512, 2048)

    def kv_tokens(self) -> int:
        """KV slots the runs need, with room to spare (the engine's default takes most of HBM)."""
        decode = max(self.decode_batches) * (self.decode_prompt_len + self.new_tokens)
        return 2 * max(decode, max(self.ttft_prompt_lens) + 1) + 256


QUICK = Settings(decode_batches=(1, 2), decode_prompt_len=16, new_tokens=8,
                 ttft_prompt_lens=(16, 32))


def gsm8k_token_stream(tokenizer, num_questions: int = 300) -> list[int]:
    from specpcg.gsm8k import load_split

    text = "\n\n".join(q["question"] for q in load_split("test")[:num_questions])
    return tokenizer.encode(text)


def make_prompts(stream: list[int], batch_size: int, prompt_len: int) -> list[list[int]]:
    """`batch_size` distinct rows of `prompt_len` ids, each a window of the (cycled) stream."""
    rows = []
    for row in range(batch_size):
        start = (row * 997) % len(stream)  # 997: prime stride, so rows differ
        rows.append(list(itertools.islice(itertools.cycle(stream), start, start + prompt_len)))
    return rows


# -- systems: decode_s(ids, n) -> seconds after the first token, ttft_s(ids) -> seconds ----------
class SpecpcgRunner:
    def __init__(self, args, settings: Settings, graphs: bool):
        from specpcg import Engine

        self.system = "specpcg_graphs" if graphs else "specpcg_eager"

        self.engine = Engine(model_path=args.model_path, device=args.device, dtype=args.dtype,
                             attention_backend=args.attention_backend,
                             max_total_tokens=settings.kv_tokens(),
                             disable_cuda_graph=not graphs, show_progress=False)
        self.device = self.engine.device
        self.attention_backend = self.engine.attn_backend.name

    def _generate(self, ids, num_new: int) -> list[dict]:
        params = {"max_new_tokens": num_new, "temperature": 0, "ignore_eos": True}
        outs = self.engine.generate(input_ids=ids, sampling_params=params)
        assert all(o["meta_info"]["completion_tokens"] == num_new for o in outs), "short output"
        return outs

    def decode_s(self, ids, num_new: int) -> float:
        metas = [o["meta_info"] for o in self._generate(ids, num_new)]
        return max(m["e2e_latency"] for m in metas) - max(m["ttft"] for m in metas)

    def ttft_s(self, ids) -> float:
        return common.timed(lambda: self._generate(ids, 1), self.device)[1]

    def close(self) -> None:
        self.engine.shutdown()
        self.engine = None


class HFRunner:
    def __init__(self, model, device: torch.device, cache_implementation):
        self.model, self.device, self.cache = model, device, cache_implementation
        self.system = "hf_static" if cache_implementation == "static" else "hf_eager"
        self.attention_backend = f"hf:{model.config._attn_implementation}"
        eos = model.generation_config.eos_token_id
        self.pad_id = (eos[0] if isinstance(eos, list) else eos) or 0

    def _generate(self, ids, num_new: int):
        input_ids = torch.tensor(ids, device=self.device)  # [bs, prompt_len]
        out = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
            max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=self.pad_id,
            cache_implementation=self.cache)
        assert out.shape[1] == input_ids.shape[1] + num_new, "short output"

    def decode_s(self, ids, num_new: int) -> float:
        total = common.timed(lambda: self._generate(ids, num_new), self.device)[1]
        return total - self.ttft_s(ids)

    def ttft_s(self, ids) -> float:
        return common.timed(lambda: self._generate(ids, 1), self.device)[1]

    def close(self) -> None:
        self.model = None


# -- measuring -------------------------------------------------------------------------------
def measure(runner, settings: Settings, stream, repeats: int, info: dict) -> list[dict]:
    def record(metric, batch_size, prompt_len, num_new, value):
        rec = {"bench": "engine", "system": runner.system, "metric": metric,
               "batch_size": batch_size, "prompt_len": prompt_len, "new_tokens": num_new,
               "value": value, **info, "attention_backend": runner.attention_backend,
               "timestamp": common.now_iso()}
        print(f"  {runner.system:10s} {metric:13s} bs={batch_size:<3d} prompt={prompt_len:<5d} "
              f"new={num_new:<4d} {common.fmt(value)}", flush=True)
        return rec

    records, num_new = [], settings.new_tokens
    for bs in settings.decode_batches:
        ids = make_prompts(stream, bs, settings.decode_prompt_len)
        runner.decode_s(ids, num_new)  # warm-up: first use of this shape (autotune, allocator)
        decode_s = common.median(runner.decode_s(ids, num_new) for _ in range(repeats))
        records.append(record("decode_tok_s", bs, settings.decode_prompt_len, num_new,
                              bs * (num_new - 1) / decode_s))
    for prompt_len in settings.ttft_prompt_lens:
        ids = make_prompts(stream, 1, prompt_len)
        runner.ttft_s(ids)  # warm-up
        ttft_s = common.median(runner.ttft_s(ids) for _ in range(repeats))
        records.append(record("ttft_ms", 1, prompt_len, 1, 1000 * ttft_s))
    return records


def run_all(args, settings: Settings) -> None:
    """Measures every system, appending each one's lines to --out as soon as it is done."""
    from specpcg.models.loader import default_model_path
    from specpcg.tokenizer import load_tokenizer

    args.model_path = args.model_path or default_model_path()
    stream = gsm8k_token_stream(load_tokenizer(args.model_path))
    info = None
    for graphs in (False, True) if not args.disable_cuda_graph else (False,):
        runner = SpecpcgRunner(args, settings, graphs)
        device, dtype = runner.device, runner.engine.dtype
        if info is None:
            info = {**common.machine_info(device), "dtype": str(dtype).replace("torch.", "")}
            print(f"device {info['device']}, torch {info['torch']}, transformers "
                  f"{info['transformers']}, git {info['git']}, model {args.model_path}", flush=True)
        ours_info = {**info, "graphs": runner.engine.get_server_info()["cuda_graph"]["enabled"]}
        common.append_jsonl(args.out, measure(runner, settings, stream, args.repeats, ours_info))
        runner.close()
        del runner
        common.free_memory(device)
    if args.skip_hf:
        return
    model = hf_reference.load_hf_model(args.model_path, device, dtype)
    for cache in (None, "static"):
        runner = HFRunner(model, device, cache)
        common.append_jsonl(args.out, measure(runner, settings, stream, args.repeats, info))
        runner.close()
    del model
    common.free_memory(device)


# -- reporting -------------------------------------------------------------------------------
def latest_values(records: list[dict]) -> dict:
    """{(metric, bs, prompt_len, new_tokens): {system: value}} from the latest line of each,
    among the lines measured on the same device as the file's last engine line."""
    records = [r for r in records if r.get("bench") == "engine"]
    if not records:
        raise ValueError("no engine benchmark lines to render")
    device = records[-1]["device"]
    table: dict = {}
    for r in records:
        if r["device"] == device:
            key = (r["metric"], r["batch_size"], r["prompt_len"], r["new_tokens"])
            table.setdefault(key, {})[r["system"]] = r["value"]
    return dict(sorted(table.items()))


def render_table(records: list[dict]) -> str:
    headers = ["metric", "setting", *SYSTEMS.values(),
               *(f"{SYSTEMS[a]} / {SYSTEMS[b]}" for a, b in RATIOS)]
    rows = []
    for (metric, bs, prompt_len, num_new), vals in latest_values(records).items():
        setting = f"bs={bs} prompt={prompt_len}"
        setting += "" if metric == "ttft_ms" else f" new={num_new}"
        ratios = [common.ratio(vals.get(a), vals.get(b)) for a, b in RATIOS]
        rows.append([METRICS.get(metric, metric), setting,
                     *(common.fmt(vals.get(s)) for s in SYSTEMS), *map(common.fmt, ratios)])
    return common.markdown_table(headers, rows)


def render_plot(records: list[dict], path) -> None:
    values, last = latest_values(records), [r for r in records if r.get("bench") == "engine"][-1]
    ours = [r for r in records if r.get("system", "").startswith("specpcg")
            and r["device"] == last["device"]]
    panels = []
    for metric, ylabel in METRICS.items():
        keys = [k for k in values if k[0] == metric]
        if not keys:
            continue
        if metric == "ttft_ms":
            title, labels = "time to first token (batch 1)", [f"prompt {k[2]}" for k in keys]
        else:
            title = f"decode (prompt {keys[0][2]}, {keys[0][3]} new tokens, greedy)"
            labels = [f"batch {k[1]}" for k in keys]
        panels.append({"title": title, "ylabel": ylabel, "labels": labels,
                       "values": {SYSTEMS[s]: [values[k].get(s) for k in keys] for s in SYSTEMS}})
    title = (f"specpcg vs HF transformers on {last['device']} ({last.get('dtype')}; torch "
             f"{last['torch']}, transformers {last['transformers']}, git {last.get('git')}, "
             f"specpcg attention {ours[-1]['attention_backend'] if ours else '-'})")
    common.grouped_bar_plot(panels, list(SYSTEMS.values()), path, title)


def report(records: list[dict], out_path) -> None:
    png = os.path.join(os.path.dirname(os.path.abspath(out_path)), "engine.png")
    print(render_table(records))
    try:
        render_plot(records, png)
    except ImportError as exc:  # the lines and table stand without a plot; --table-only redraws
        print(f"\nno plot ({exc}); pip install matplotlib, then rerun with --table-only")
        return
    print(f"\nplot: {png}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", help="both systems load the weights in this")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="measure specpcg only")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "engine.jsonl"))
    p.add_argument("--table-only", metavar="FILE", default=None,
                   help="re-render the table and plot from an existing JSON-lines file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table_only:
        report(common.read_jsonl(args.table_only), args.table_only)
        return
    run_all(args, QUICK if args.quick else Settings())
    print(f"\nappended to {args.out}\n")
    report(common.read_jsonl(args.out), args.out)


if __name__ == "__main__":
    main()
