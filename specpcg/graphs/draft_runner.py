"""A draft model's round in two CUDA graphs per batch-size bucket: the catch-up on a verify's
accepted tokens, and every chain draft step after it.

Why not the per-step decode graph: each step would still pay on the host for building a batch,
copying it into static buffers, planning attention and an eager LM head and argmax, about as long
as the step's GPU work. Here step j reads token j-1 (and a head's hidden state) straight from
step j-1 inside the graph; positions, slots and request rows arrive in one packed host-to-device
copy per round.

- Catch-up: request i's accepted tokens sit at rows i*W .. i*W+len_i-1 (W = num_steps + 1, the
  most a chain verify can accept, bonus included; a tree's W is its verify's num_draft_tokens);
  padding rows write their KV to the sink slot, so one capture serves every accept length.
  Returns the last real row's logits and hidden state.
- Chain: num_steps - 1 greedy DECODE steps (sampled requests draw from per-request generators on
  the host, so they take the per-step path); returns the [bs, steps] draft tokens.

Without CUDA graphs (CPU, or graphs off) the same bodies run eagerly, so every test of drafting
exercises the exact code a graph replays.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kernels.round_load import SEGMENTS, load_round, round_inputs
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.graphs.breakable import CaptureCost, warm_and_capture
from specpcg.graphs.buckets import pick_bucket
from specpcg.kv_cache import SINK_SLOT
from specpcg.transfer import to_device


class RoundRow(NamedTuple):
    """One request of a round, as the host knows it."""

    ids: list  # catch-up tokens (empty: the catch-up ran eagerly)
    first_pos: int  # position of ids[0]; with no ids, where the chain's first step sits
    slots: list  # KV slots of ids
    req_pool_idx: int
    verify_row: int  # the request's row in the verify output its hidden states come from
    root: int  # the last committed token: node 0 of the proposal


class DraftRoundBuffers:
    """Static inputs of both graphs, sized for the largest bucket. One int64 host tensor fills
    every integer input: [catch-up ids, positions, slots (bs*W each); the SEGMENTS (bs each);
    chain slots (steps*bs)]."""

    def __init__(self, max_bs: int, width: int, steps: int, hidden_in: int, hidden: int, dtype,
                 device):
        self.max_bs, self.width, self.steps = max_bs, width, steps
        self.ints = torch.zeros(max_bs * self._per_req(), dtype=torch.long, device=device)
        self.target_hidden = (torch.zeros(max_bs * width, hidden_in, dtype=dtype, device=device)
                              if hidden_in else None)
        self.hidden0 = torch.zeros(max_bs, hidden, dtype=dtype, device=device) if hidden else None
        self.token0 = torch.zeros(max_bs, dtype=torch.long, device=device)

    def _per_req(self) -> int:
        return 3 * self.width + len(SEGMENTS) + self.steps

    def views(self, bs: int) -> dict:
        """The integer inputs of a bucket of `bs` requests, as views of `ints`."""
        w, s = self.width, self.steps
        parts = self.ints[:bs * self._per_req()].split(
            [bs * w] * 3 + [bs] * len(SEGMENTS) + [bs * s])
        out = dict(zip(("ids", "positions", "slots") + SEGMENTS + ("chain",), parts))
        out["chain"] = out["chain"].view(s, bs)
        return out

    def pack(self, bs: int, pad_row: int, reqs: list, chain_slots: Optional[list]) -> torch.Tensor:
        """Host int64 tensor for `views(bs)`; reqs: a RoundRow per real request; requests past
        them are padding (pad row, sink slots, length 1)."""
        w, s = self.width, self.steps
        ids, pos, slots = [0] * (bs * w), [0] * (bs * w), [SINK_SLOT] * (bs * w)
        seg = {"rows": [pad_row] * bs, "seq_lens": [1] * bs, "lens": [1] * bs,
               "verify_rows": [0] * bs, "roots": [0] * bs}
        for i, r in enumerate(reqs):
            k = len(r.ids)
            ids[i * w:i * w + k] = r.ids
            pos[i * w:i * w + k] = range(r.first_pos, r.first_pos + k)
            slots[i * w:i * w + k] = r.slots
            for name, value in zip(SEGMENTS, (r.req_pool_idx, r.first_pos + k, k, r.verify_row,
                                               r.root)):
                seg[name][i] = value
        chain = [SINK_SLOT] * (s * bs)
        for i, req_slots in enumerate(chain_slots or []):
            chain[i:s * bs:bs] = req_slots  # step-major: step j's slots are contiguous
        return torch.tensor(ids + pos + slots + sum((seg[n] for n in SEGMENTS), []) + chain)


class DraftGraphRunner:
    def __init__(self, model_runner, buckets: list, num_steps: int, target_hidden_size: int,
                 width: int = 0, pool=None, eager_reason: Optional[str] = None,
                 show_progress: bool = True, round_slots: int = 0):
        """num_steps: the spec's steps (chain DECODE steps = num_steps - 1); target_hidden_size:
        width of the target rows a head reads (0: a model draft, no hidden states); width: the
        catch-up's rows per request (0: num_steps + 1); eager_reason: set when there are no
        CUDA graphs (why): the bodies run eagerly; round_slots: KV slots a request's round
        steps write (0: one per chain step), laid out step-major in views()["chain"]."""
        self.model_runner, self.model = model_runner, model_runner.model
        self.buckets = sorted(buckets)
        self.steps = num_steps - 1
        self.width = width or num_steps + 1
        self.is_head = bool(target_hidden_size)
        self.pool, self.eager_reason, self.show_progress = pool, eager_reason, show_progress
        hidden = self.model.hidden_in_size if self.is_head else 0
        self.buf = DraftRoundBuffers(self.buckets[-1], self.width, round_slots or self.steps,
                                     target_hidden_size, hidden, self.model.head_weight.dtype,
                                     model_runner.device)
        self.graphs: dict = {}  # (kind, bs) -> CUDAGraph
        self.outputs: dict = {}
        self.extra: dict = {}  # kind -> body(bs, seq_lens_cpu): a draft's own round graphs
        self.cost = CaptureCost()

    def add_kind(self, kind: str, body) -> None:
        """A graph of the draft's own per bucket, captured with the others: body(bs,
        seq_lens_cpu) reads the round's buffers (views, hidden0) and returns tensors."""
        if self.graphs:
            raise RuntimeError(f"add the {kind!r} round before capture")
        self.extra[kind] = body

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    @property
    def runner_name(self) -> str:
        """What forward_stats calls a round's forwards (with eager_reason when not graphs)."""
        return "draft_round_eager" if self.eager_reason else "draft_round_graph"

    def bucket(self, n: int) -> Optional[int]:
        """The padded batch size a round of n requests runs at (None: too many requests)."""
        if self.eager_reason:
            return n if n <= self.max_bs else None
        return pick_bucket(self.buckets, n)

    # -- bodies: what a graph captures, or what runs eagerly without graphs --------------------
    def forward(self, batch: ForwardBatch):
        """The draft model's body on `batch` (attention planned here: in a graph, too)."""
        attn = self.model_runner.attn_backend
        attn.init_forward_metadata(batch)
        with forward_context(ForwardContext(batch, attn, batch.num_tokens)):
            return self.model_runner.call_model(batch)

    def catch_up_body(self, bs: int, seq_lens_cpu: list, lens_cpu: list):
        """Returns ([bs, H] the model's output rows, [bs, H] hidden or None) at each request's
        last real row. The output rows, not logits: a greedy chain takes their argmax and a
        tree its K best over the head's own vocabulary (model.greedy_tokens, top_children),
        without a [bs, target vocab] fp32 row; sampling computes logits from them."""
        v, w = self.buf.views(bs), self.width
        hidden = None
        if self.is_head:
            hidden = self.model.project_target_hidden(self.buf.target_hidden[:bs * w])
        batch = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, input_ids=v["ids"], positions=v["positions"],
            out_cache_loc=v["slots"], req_pool_indices=v["rows"], seq_lens=v["seq_lens"],
            extend_seq_lens=v["lens"], seq_lens_cpu=seq_lens_cpu, extend_seq_lens_cpu=lens_cpu,
            capture_hidden_mode=CaptureHiddenMode.FULL, input_hidden=hidden, req_row_stride=w)
        out, aux = self.forward(batch)
        last = torch.arange(bs, device=v["lens"].device) * w + v["lens"] - 1  # [bs]
        return out[last], (aux[0][last] if self.is_head else None)

    def chain_body(self, bs: int, first_seq_lens: list):
        """num_steps - 1 greedy DECODE steps from token0 (and hidden0); returns [bs, steps]."""
        v = self.buf.views(bs)
        token = self.buf.token0[:bs]
        hidden = self.buf.hidden0[:bs] if self.is_head else None
        ones = torch.ones(bs, dtype=torch.long, device=token.device)
        base = v["seq_lens"]  # the catch-up's end: step j sits at position base + j
        tokens = []
        for j in range(self.steps):
            positions = base + j
            batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE, input_ids=token, positions=positions,
                out_cache_loc=v["chain"][j], req_pool_indices=v["rows"], seq_lens=positions + 1,
                extend_seq_lens=ones, seq_lens_cpu=[n + j + 1 for n in first_seq_lens],
                extend_seq_lens_cpu=[1] * bs, capture_hidden_mode=CaptureHiddenMode.LAST,
                input_hidden=hidden)
            out, aux = self.forward(batch)
            token = self.model.greedy_tokens(out)
            hidden = aux[0] if self.is_head else None
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    # -- capture --------------------------------------------------------------------------------
    def capture(self) -> None:
        from tqdm import tqdm

        kinds = ["catch_up"] + (["chain"] if self.steps > 0 else []) + list(self.extra)
        keys = [(k, bs) for bs in sorted(self.buckets, reverse=True) for k in kinds]
        pad_row = self.model_runner.kv_cache.req_pool.pad_row
        with self.cost.measure("draft round graphs", len(keys)):
            for kind, bs in tqdm(keys, desc="capturing draft round graphs",
                                 disable=not self.show_progress):
                host = self.buf.pack(bs, pad_row, [], None)  # all padding: sink slots, pad row
                self.buf.ints[:host.shape[0]].copy_(host)
                self._capture_one(kind, bs)

    def _body(self, kind: str, bs: int, seq_lens_cpu: list, lens_cpu: list):
        if kind == "catch_up":
            return self.catch_up_body(bs, seq_lens_cpu, lens_cpu)
        if kind in self.extra:
            return self.extra[kind](bs, seq_lens_cpu)
        return self.chain_body(bs, seq_lens_cpu)

    def _capture_one(self, kind: str, bs: int) -> None:
        # Host lengths only shape the attention plan (its max extend length): capture the widest.
        seq_lens_cpu, lens_cpu = [self.width] * bs, [self.width] * bs
        graph, self.outputs[(kind, bs)] = warm_and_capture(
            lambda: self._body(kind, bs, seq_lens_cpu, lens_cpu), self.pool)
        self.graphs[(kind, bs)] = graph

    # -- a round ---------------------------------------------------------------------------------
    def load(self, bs: int, reqs: list, chain_slots: Optional[list], verify_hidden=None):
        """Fills the static inputs for a round of len(reqs) <= bs requests (RoundRows; see
        pack); verify_hidden: [B, W, H'] target rows the requests' verify_row index (heads).
        Returns the requests' root tokens [n] on the device (a view: copy before next load)."""
        pad_row = self.model_runner.kv_cache.req_pool.pad_row
        host = self.buf.pack(bs, pad_row, reqs, chain_slots)
        self.buf.ints[:host.shape[0]].copy_(to_device(host, self.buf.ints.device))
        views = self.buf.views(bs)
        if verify_hidden is not None:
            dst = self.buf.target_hidden[:bs * self.width].view(bs, self.width, -1)
            torch.index_select(verify_hidden, 0, views["verify_rows"], out=dst)
        return views["roots"][:len(reqs)]

    def load_on_device(self, bs: int, rows: torch.Tensor, path) -> None:
        """load() from device tensors alone, for overlap scheduling (the host has not read the
        verify the catch-up follows). rows: [n] the requests' KV rows; path: a
        speculative.overlap.DevicePath of n <= bs requests. Slots come from req_to_token, so
        every position the round writes must already hold one (the caller reserves them).
        Fills the same buffers with the same values as load()."""
        n, w = rows.shape[0], self.width
        req_to_token = self.model_runner.kv_cache.req_pool.req_to_token
        steps = self.buf.steps
        if n == bs:  # no padding: one kernel on the GPU (kernels/round_load.py)
            size = bs * (3 * w + len(SEGMENTS) + steps)
            load_round(rows, path.first_pos, path.lens, path.roots, path.ids, req_to_token,
                       steps, SINK_SLOT, self.buf.ints[:size])
        else:
            values = round_inputs(rows, path.first_pos, path.lens, path.roots, path.ids,
                                  req_to_token, steps, SINK_SLOT)
            self._load_padded(self.buf.views(bs), values, n, bs)
        if path.hidden is not None:
            self.buf.target_hidden[:n * w].view(n, w, -1).copy_(path.hidden)

    def _load_padded(self, v: dict, values: dict, n: int, bs: int) -> None:
        """load_on_device's inputs for n < bs requests: the rows past them are padding."""
        pad = {"ids": 0, "positions": 0, "slots": SINK_SLOT, "seq_lens": 1, "lens": 1,
               "verify_rows": 0, "roots": 0, "chain": SINK_SLOT,
               "rows": self.model_runner.kv_cache.req_pool.pad_row}
        for name, value in values.items():
            if name == "chain":  # [steps, bs]: requests are columns
                v[name][:, :n].copy_(value)
                v[name][:, n:].fill_(pad[name])
                continue
            view = v[name].view(bs, -1)
            view[:n].copy_(value.view(n, -1))
            view[n:].fill_(pad[name])

    def catch_up(self, bs: int, seq_lens_cpu: list, lens_cpu: list):
        """After `load`: ([bs, H] output rows, [bs, H] hidden) at each request's last accepted
        row (catch_up_body)."""
        return self._run("catch_up", bs, seq_lens_cpu, lens_cpu)

    def chain(self, bs: int, token0: torch.Tensor, hidden0, first_seq_lens: list) -> torch.Tensor:
        """After `load`: the [bs, steps] greedy draft tokens following token0 (n real rows)."""
        n = token0.shape[0]
        self.buf.token0[:n].copy_(token0)
        if hidden0 is not None:
            self.buf.hidden0[:n].copy_(hidden0)
        return self._run("chain", bs, first_seq_lens + [1] * (bs - n), None)

    def run(self, kind: str, bs: int, seq_lens_cpu: list):
        """After `load`: an added kind's outputs (its graph's buffers: copy what must outlive
        the next replay)."""
        return self._run(kind, bs, seq_lens_cpu, None)

    def _run(self, kind: str, bs: int, seq_lens_cpu: list, lens_cpu):
        graph = self.graphs.get((kind, bs))
        if graph is None:
            return self._body(kind, bs, seq_lens_cpu, lens_cpu)
        graph.replay()
        return self.outputs[(kind, bs)]

    def info(self) -> dict:
        return {"batch_sizes": self.buckets, "chain_steps": self.steps, "catch_up_width": self.width,
                "captured": bool(self.graphs), **self.cost.info()}
