"""The host's work of a head's catch-up in resume graph replays (drafts/resume.py), alone.

`ResumeCatchUp.run` over a batch whose requests each catch up on --lag positions, with a real
KV cache and the engine's runner widths, and runners that load and replay nothing: what is
timed is the host's part of each replay (the slots, the one host copy of the inputs, the hidden
rows' indexed copy), which a GPU waits for at a look's switch. Times are this host's, medians of
--repeats catch-ups after two warm-ups.

    python benchmarks/probe_resume_replays.py [--batches 16 64] [--lag 100] [--hidden 8]
        [--repeats 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

import common

common.add_repo_to_path()

ROUND_WIDTH = 8  # the look runners' widths follow it (ResumeCatchUp.build)


class _Runner:
    """A round runner's face to ResumeCatchUp: its width, batch sizes, buffer; no kernels."""
    runner_name, eager_reason = "draft_round_graph", None

    def __init__(self, width: int, max_bs: int, kv_cache, hidden: int):
        self.width, self.max_bs = width, max_bs
        self.model_runner = SimpleNamespace(kv_cache=kv_cache)
        self.buf = SimpleNamespace(target_hidden=torch.zeros(width * max_bs, hidden))

    def bucket(self, n: int):
        return n if n <= self.max_bs else None

    def load_on_device(self, bs, rows, path) -> None:
        pass

    def catch_up(self, bs, seq_lens, lens) -> None:
        pass


class _Router:
    def count(self, *args) -> None:
        pass


def probe(bs: int, lag: int, hidden: int, repeats: int) -> dict:
    from drafts import resume
    from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool
    from specpcg.speculative.bucket import EXPLORE_EVERY

    positions = lag * (repeats + 2)
    kv = KVCache(KVPool(bs * positions + 1, 1, 1, 4, torch.float32, "cpu"),
                 ReqToTokenPool(bs + 1, positions, "cpu"))
    rows = [kv.new_request() for _ in range(bs)]
    widths = (2 * ROUND_WIDTH, EXPLORE_EVERY + ROUND_WIDTH)  # and the prompt runner's:
    runners = [_Runner(w, bs, kv, hidden) for w in widths]
    runners.append(_Runner(resume.PROMPT_WIDTH, resume.PROMPT_MAX_BS, kv, hidden))
    catch_up = resume.ResumeCatchUp(runners)
    flat = torch.zeros(bs * lag, hidden)
    hidden_rows = resume.HiddenRows(flat, [i * lag for i in range(bs)])
    times = []
    for rep in range(repeats + 2):
        ids = [[(7 * i + j) % 1000 for j in range(lag)] for i in range(bs)]
        start = time.perf_counter()
        catch_up.run(kv, _Router(), rows, [rep * lag] * bs, ids, hidden_rows)
        times.append(time.perf_counter() - start)
    return {"bench": "probe_resume_replays", "batch": bs, "lag": lag, "hidden": hidden,
            "repeats": repeats, "host_ms_median": round(1e3 * common.median(times[2:]), 3),
            "host_ms_min": round(1e3 * min(times[2:]), 3),
            **common.machine_info(torch.device("cpu"))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--lag", type=int, default=100, help="positions each request catches up on")
    p.add_argument("--hidden", type=int, default=8,
                   help="a target row's width (small: on a CPU the row copies are real work)")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lines = [probe(bs, args.lag, args.hidden, args.repeats) for bs in args.batches]
    for line in lines:
        print(f"[probe_resume_replays] bs {line['batch']:3} lag {line['lag']}: "
              f"{line['host_ms_median']:.2f} ms host (median)", flush=True)
    if args.out:
        common.append_jsonl(args.out, lines)


if __name__ == "__main__":
    main()
