"""A draft's catch-up on new prompts and on the positions plain decode steps passed, as graph
replays.

When adaptive speculation goes back to speculating after plain steps, the draft first catches
up on every position those steps decoded (`catch_up_to_paths`), all but the last, which the
overlapped step's own graph takes. As one eager DRAFT_EXTEND that cost 2.5-5.8 ms on an H200
(a trained EAGLE3 head at batch 1-64, b91a5f5, `probe_switch.py --phases`) against plain
steps of 0.7-1.6 ms: the host launching and planning one forward while the GPU waits. Here
each request's rows go through a captured catch-up graph (the round runner's catch-up body,
specpcg/graphs/draft_runner.py) `width` rows at a time, inputs built on the device from one
host copy; up to MAX_CHUNKS replays. Longer catch-ups stay eager, where one forward takes any
length.

Two widths per batch bucket where speculation pauses: twice the verify's (the warm-up's windows
of a few plain steps) and the first look's window (bucket.EXPLORE_EVERY plain steps plus a
verify's path), so the first looks take one replay and a short one pads few rows. And one more,
pinned or not, for new prompts (PROMPT_WIDTH, up to PROMPT_MAX_BS new requests): the first
speculative step after a prefill catches the draft up on each new prompt the same way.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional

import numpy as np
import torch

from specpcg.transfer import runs, to_device

MAX_CHUNKS = 4  # replays per catch-up before one eager forward is cheaper
# The prompt runner's rows per request, and the most new requests it takes in one replay. NOTE:
# eagerly, a STANDALONE draft's catch-up on one new prompt of 67 tokens took 3.4 ms at batch 1
# and 4.6 ms for 16 prompts (H200, 2dd3f85, `probe_catchup.py --pinned`), with 0.15 ms of
# device kernels: the host launching a 4-layer forward op by op (under cProfile its 21 Triton
# launches took 1.8 of 7.3 ms).
# Pinned speculation's first step after a prefill took 3.9-6.4 ms there, an adaptive engine's,
# whose prompt fit the look runners (MAX_CHUNKS * 36 rows), 1.0-1.2 ms (611c80f). A chat
# prompt is often longer than 144 tokens; 4 replays of 256 rows reach 1,024. Past 16 requests
# a replay's padded rows and its host list of ids grow with the bucket, and a prefill seldom
# brings that many new requests at once.
PROMPT_WIDTH = 256
PROMPT_MAX_BS = 16


class HiddenRows(NamedTuple):
    """A head's target rows for a catch-up: request i's rows are flat[starts[i]:], as many as
    its ids. One tensor for the batch, so a replay gathers its rows in one indexed copy: per
    request slices and a concatenation cost a catch-up at batch 64 about 2 ms of host time
    while the device waited (H200, b91a5f5, `probe_switch.py --phases`)."""
    flat: torch.Tensor  # [rows, H']
    starts: list


def gather_rows(pending: list) -> tuple:
    """(flat, ends, counts) of requests' lists of row tensors: all rows in one tensor (one
    concatenation, where a request at a time cost host time at batch 64 with the device
    idle), request i's rows ending at ends[i], counts[i] of them."""
    pieces = [p for rows in pending for p in rows]
    flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    counts = [sum(p.shape[0] for p in rows) for rows in pending]
    return flat, list(itertools.accumulate(counts)), counts


class ResumeCatchUp:
    def __init__(self, runners: list):
        self.runners = sorted(runners, key=lambda r: r.width)  # DraftGraphRunners, steps = 0

    @classmethod
    def build(cls, runner, graphs, cfg, round_width: int, target_hidden_size: int = 0):
        """Catch-up-only round runners (captured with the draft's decode graphs): the prompt
        runner, and where speculation pauses (EngineConfig.speculation_pauses) the two widths
        for the positions plain steps passed."""
        from drafts.wiring import build_round_runner
        from specpcg.speculative.bucket import EXPLORE_EVERY

        widths = ({2 * round_width, EXPLORE_EVERY + round_width} if cfg.speculation_pauses
                  else set())
        runners = [build_round_runner(runner, graphs, cfg, 1, target_hidden_size, width=w)
                   for w in sorted(widths - {PROMPT_WIDTH})]
        runners.append(build_round_runner(runner, graphs, cfg, 1, target_hidden_size,
                                          width=PROMPT_WIDTH, max_bs=PROMPT_MAX_BS))
        resume = cls(runners)
        resume.warm()
        return resume

    def warm(self) -> None:
        """Loads each runner's inputs once now (a request of the pad row's, one token long),
        so that its width's loading kernel compiles at startup, not in its first catch-up,
        which can come at any step (see _pack)."""
        for rnd in self.runners:
            bs = rnd.bucket(1)
            if bs is None:  # no batch captured for one request: no catch-up runs here
                continue
            req_pool = rnd.model_runner.kv_cache.req_pool
            part = [(req_pool.pad_row, 0, [0], None)] * bs
            rows, path, _ = _pack(part, rnd.width, req_pool.req_to_token.device, False)
            rnd.load_on_device(bs, rows, path)

    def _usable(self, n: int) -> list:
        """The runners with a captured batch size for n requests, narrowest first."""
        return [r for r in self.runners if r.bucket(n) is not None]

    def fits(self, counts: list) -> bool:
        """Whether catching up `counts` positions per request takes at most MAX_CHUNKS
        replays of a captured batch size."""
        usable = self._usable(len(counts)) if counts else []
        return bool(usable) and max(counts) <= MAX_CHUNKS * usable[-1].width

    def run(self, kv_cache, router, rows: list, first_pos: list, ids: list,
            hidden: Optional[HiddenRows] = None) -> None:
        """Feeds request i the tokens ids[i] at positions first_pos[i].. of KV row rows[i]
        (with their target rows from `hidden`, for a head), allocating their slots. The
        outputs are dropped: the step that follows catches up on the last position."""
        done = [0] * len(rows)
        left = [i for i, x in enumerate(ids) if x]
        while left:
            most = max(len(ids[i]) - done[i] for i in left)
            usable = self._usable(len(left))
            rnd = next((r for r in usable if r.width >= most), usable[-1])
            take = [min(rnd.width, len(ids[i]) - done[i]) for i in left]
            part = [(rows[i], first_pos[i] + done[i], ids[i][done[i]:done[i] + k],
                     None if hidden is None else hidden.starts[i] + done[i])
                    for i, k in zip(left, take)]
            _replay(rnd, kv_cache, part, None if hidden is None else hidden.flat)
            router.count("DRAFT_EXTEND", rnd.runner_name, rnd.eager_reason)
            for i, k in zip(left, take):
                done[i] += k
            left = [i for i in left if done[i] < len(ids[i])]

    def info(self) -> dict:
        return {"widths": [r.width for r in self.runners], "max_chunks": MAX_CHUNKS}


def _pack(part: list, w: int, device, with_hidden: bool) -> tuple:
    """(rows, path, hidden_at) for `part` (as _replay's) from one host copy: rows, first
    positions, lengths, roots (unused), the [n, w] ids, then where each hidden row goes in the
    [n * w] buffer and where it comes from in `flat`: contiguous pieces (the loading kernel
    reads its [n] inputs at unit stride), hidden_at their device tensor ([2, rows], or None).
    Each [n] piece takes an even number of entries, so every piece starts 16-byte aligned:
    Triton specializes a pointer on that alignment, and an odd batch's pieces compiled another
    variant of the loading kernel inside a serving step (68-91 ms, which halved a timed batch
    of 128 tokens; H200, cb98842, bench_adaptive's stalls)."""
    from specpcg.speculative.overlap import DevicePath

    n = len(part)
    m = n + n % 2
    counts = [len(x) for _, _, x, _ in part]
    # NOTE: numpy, not a Python pass per row: at batch 64 a list of every id and hidden index
    # took 340 us of this CPU's time a replay (1,900 at 256 rows a request).
    total, end = sum(counts), 4 * m + n * w
    host = np.zeros(end + (2 * total if with_hidden else 0), dtype=np.int64)
    heads = host[:4 * m].reshape(4, m)
    heads[0, :n] = [row for row, _, _, _ in part]
    heads[1, :n] = [pos for _, pos, _, _ in part]
    heads[2, :n] = counts
    ids = host[4 * m:end].reshape(n, w)
    ids[np.arange(w) < np.asarray(counts)[:, None]] = np.fromiter(
        itertools.chain.from_iterable(x for _, _, x, _ in part), np.int64, total)
    if with_hidden:
        host[end:end + total] = runs(range(0, n * w, w), counts)
        host[end + total:] = runs([src for _, _, _, src in part], counts)
    ints = to_device(torch.from_numpy(host), device)
    rows, first, lens, roots = ints[:4 * m].view(4, m)[:, :n]
    path = DevicePath(first_pos=first, lens=lens, roots=roots,
                      ids=ints[4 * m:end].view(n, w), hidden=None)
    hidden_at = ints[end:].view(2, -1) if with_hidden else None
    return rows, path, hidden_at


def _replay(rnd, kv_cache, part: list, flat: Optional[torch.Tensor]) -> None:
    """One catch-up of each (row, first position, ids, first row in `flat`) in `part`, each
    at most rnd.width long: its slots allocated, its inputs loaded from one host copy."""
    n = len(part)
    bs = rnd.bucket(n)
    counts = [len(x) for _, _, x, _ in part]
    kv_cache.extend_many([row for row, _, _, _ in part], counts)
    rows, path, hidden_at = _pack(part, rnd.width, kv_cache.req_pool.req_to_token.device,
                                  flat is not None)
    rnd.load_on_device(bs, rows, path)
    if flat is not None:
        dst, src = hidden_at
        rnd.buf.target_hidden.index_copy_(0, dst, flat.index_select(0, src))
    pad = bs - n
    rnd.catch_up(bs, [pos + k for (_, pos, _, _), k in zip(part, counts)] + [1] * pad,
                 counts + [1] * pad)
