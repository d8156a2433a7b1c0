"""Why a batch-1 no-spec decode runs at different rates from one engine to the next (CUDA only).

Engines are made one after another in one process, as bench_accept.py part B makes them. For
each: the decode rate of five greedy generates (128 new tokens after a 128-token prompt; the
rate from the first token on), the GPU's clocks then (nvidia-smi), and a traced generate's
steps: the period of a step, the kernels' busy time in it (own times, probe_decode_trace's)
and the idle rest, with the longest gaps between two kernels by the pair around them. Where
the busy time holds and the idle time moves, the device waits on the host. Last, one more
generate untraced, timed whole (its prefill included).

--ab-greedy alternates, in each engine, generates whose greedy pick is the decode graph's with
generates that pick it in the sampler after the replay (the graph still takes its own, unread):
the host's saving, side by side in one engine.

    python benchmarks/probe_engine_swing.py [--engines 6] [--ab-greedy] > out.txt
    python benchmarks/probe_engine_swing.py --plot LABEL=out.txt ... --out plot.png
    python benchmarks/probe_engine_swing.py --plot-ab ab.txt --out plot.png
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import subprocess
import time

import common

common.add_repo_to_path()


def clocks() -> str:
    query = "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate,temperature.gpu"
    try:
        return subprocess.run(["nvidia-smi", query, "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return "no nvidia-smi"


def decode_engine(seed: int, batch_size: int = 1, model_path: str | None = None) -> tuple:
    """(engine, run): a no-spec engine for batch_size requests and a warmed-up greedy generate
    of 129 tokens after random 128-id prompts, returning its requests' meta_info."""
    from specpcg import Engine
    from specpcg.models.loader import default_model_path

    engine = Engine(model_path=model_path or default_model_path(), show_progress=False,
                    skip_tokenizer_init=True,
                    max_total_tokens=batch_size * 2 * (128 + 129 + 20) + 1024,
                    max_running_requests=batch_size, cuda_graph_max_bs=batch_size)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    ids = [[rng.randrange(vocab) for _ in range(128)] for _ in range(batch_size)]
    run = lambda: common.generate_ids(engine, ids, 129)  # noqa: E731
    run()
    return engine, run


def decode_rate(engine, run) -> float:
    """tok/s of one generate's decode, from the batch's last first token on."""
    metas = common.timed(run, engine.device)[0]
    return len(metas) / common.batch_decode(metas)["itl_s"]


@contextlib.contextmanager
def sampler_pick():
    """Overlapped decode steps pick greedy tokens in the sampler, as if the graph took none."""
    import specpcg.overlap as overlap

    real = overlap.sample
    overlap.sample = lambda logits, reqs, greedy_ids=None: real(logits, reqs)
    try:
        yield
    finally:
        overlap.sample = real


def ab_rates(engine, run, rounds: int = 5) -> tuple:
    """(graph-pick rates, sampler-pick rates), alternating generate by generate."""
    graph, host = [], []
    for _ in range(rounds):
        graph.append(decode_rate(engine, run))
        with sampler_pick():
            host.append(decode_rate(engine, run))
    return graph, host


def one_engine(i: int, ab_greedy: bool = False) -> None:
    from bench_accept import close
    from probe_decode_trace import report_window, trace_window

    t0 = time.perf_counter()
    engine, run = decode_engine(i)
    host = None
    if ab_greedy:
        rates, host = ab_rates(engine, run)
    else:
        rates = [decode_rate(engine, run) for _ in range(5)]
    state = clocks()
    events = trace_window(run)
    names = [e[0] for e in events]
    # The step marker: a kernel run once a step (129 in the generate), here the token's copy.
    marker = min(set(names), key=lambda n: (abs(names.count(n) - 129), n))
    print(f"engine {i}: build {time.perf_counter() - t0:.1f}s rates "
          f"{' '.join(f'{r:.0f}' for r in rates)} | {state} | marker {marker[:30]}", flush=True)
    if host:
        print(f"  sampler pick: rates {' '.join(f'{r:.0f}' for r in host)}", flush=True)
    report_window(events, set(names), marker)
    start = time.perf_counter()
    run()
    common.synchronize(engine.device)
    print(f"  untraced again: {128 / (time.perf_counter() - start):.0f} tok/s (incl. prefill)",
          flush=True)
    close(engine)


WINDOW = re.compile(r"# window: \d+ steps, ([\d.]+) us a step, busy ([\d.]+) us")
RATES = re.compile(r"^engine (\d+): .*rates ([\d ]+) \|")


def _median_rates(text: str) -> float:
    return common.median(float(r) for r in text.split())


def _after_rates(path: str, pattern: re.Pattern, read) -> list:
    """read(match) of the first `pattern` line after each engine's rates line, with that
    engine's median rate in front; an engine without such a line is skipped."""
    out, rate = [], None
    for line in open(path):
        if m := RATES.match(line):
            rate = _median_rates(m.group(2))
        elif (m := pattern.match(line)) and rate is not None:
            out.append((rate, *read(m)))
            rate = None
    return out


def read_output(path: str) -> list:
    """(median rate, step us, busy us) of each engine of a probe's text output."""
    return _after_rates(path, WINDOW, lambda m: (float(m.group(1)), float(m.group(2))))


SAMPLER = re.compile(r"^  sampler pick: rates ([\d ]+)")


def read_ab(path: str) -> list:
    """(graph-pick median, sampler-pick median) of each engine of an --ab-greedy output."""
    return _after_rates(path, SAMPLER, lambda m: (_median_rates(m.group(1)),))


def plot(files: list, path: str) -> None:
    panels = []
    for label, file in (f.split("=", 1) for f in files):
        rows = read_output(file)
        labels = [str(i) for i in range(len(rows))]
        panels.append({"title": f"{label}: a traced step, by engine", "ylabel": "us",
                       "labels": labels, "values": {"step": [r[1] for r in rows],
                                                    "kernels busy": [r[2] for r in rows]}})
        panels.append({"title": f"{label}: decode rate, by engine", "ylabel": "tok/s",
                       "labels": labels, "values": {"median of 5": [r[0] for r in rows]}})
    common.grouped_bar_plot(panels, ["step", "kernels busy", "median of 5"], path,
                            "Batch-1 no-spec decode, engine after engine in one process")


def plot_ab(path: str, out: str) -> None:
    rows = read_ab(path)
    panel = {"title": "decode rate by engine, median of 5", "ylabel": "tok/s",
             "labels": [str(i) for i in range(len(rows))],
             "values": {"graph's pick": [r[0] for r in rows],
                        "sampler's pick": [r[1] for r in rows]}}
    common.grouped_bar_plot([panel], ["graph's pick", "sampler's pick"], out,
                            "Batch-1 no-spec decode: the greedy pick in or after the graph")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=6)
    p.add_argument("--ab-greedy", action="store_true",
                   help="alternate the graph's greedy pick with the sampler's in each engine")
    p.add_argument("--plot", nargs="+", metavar="LABEL=FILE", help="plot outputs, run nothing")
    p.add_argument("--plot-ab", metavar="FILE", help="plot an --ab-greedy output, run nothing")
    p.add_argument("--out", default="engine_swing.png")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, args.out)
        return
    if args.plot_ab:
        plot_ab(args.plot_ab, args.out)
        return
    for i in range(args.engines):
        one_engine(i, args.ab_greedy)


if __name__ == "__main__":
    main()
