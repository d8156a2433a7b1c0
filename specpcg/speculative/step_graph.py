"""A whole speculative step in one CUDA graph per batch-size bucket (overlap scheduling).

The graph reads the last step's results from static state buffers and writes this step's
there: the draft's proposal from the last verify's accepted path (a head's catch-up and chain
or tree, a draft model's catch-up and chain: drafts/step_round.py; NGRAM's match on the
device's token history: drafts/ngram_device.py), the target's TARGET_VERIFY forward over the
proposal, the greedy accept, and the new path. So the host's whole share of a step is one
replay and one queued copy of the results: the step before it is read while this one runs.

Padded rows (a bucket larger than the batch) sit on both caches' padding rows, whose slots are
all the sink: their state stays at position 0, length 1. Without CUDA graphs the same body runs
eagerly, so the CPU tests exercise exactly what a graph replays.
"""

from __future__ import annotations

import torch

from kernels.step_commit import StepOutputs, commit_step, path_tokens
from kernels.verify import verify_greedy
from kernels.verify_inputs import verify_inputs
from specpcg.core import ForwardBatch, ForwardMode, ModelOutput
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.graphs.breakable import CaptureCost, warm_and_capture
from specpcg.speculative.accept import simulate_accept, simulate_accept_chain
from specpcg.speculative.depth import ChainDepth, depth_ladder
from specpcg.speculative.overlap import DevicePath


class StepState:
    """The last step's results, row i = request i (a bucket's padding after the batch)."""

    def __init__(self, max_bs: int, width: int, hidden_size: int, dtype, device,
                 widths: tuple = ()):
        z = dict(dtype=torch.long, device=device)
        self.rows = torch.zeros(2, max_bs, **z)  # [target, draft] KV rows
        self.live = torch.zeros(max_bs, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(max_bs, width, **z)  # the verify's nodes, root first
        self.accept_len = torch.zeros(max_bs, **z)
        self.bonus = torch.zeros(max_bs, **z)
        self.prefix = torch.zeros(max_bs, **z)  # where the verify started
        self.hidden = (torch.zeros(max_bs, width, hidden_size, dtype=dtype, device=device)
                       if hidden_size else None)
        # What the host reads: accept length, bonus, the nodes in path order, and the order
        # (node indices: the path first) that a tree's KV was rearranged by; one buffer per
        # verify width a step can run (`widths`), each read whole.
        self.out = {w: torch.zeros(max_bs, 2 + 2 * w, **z) for w in widths or (width,)}

    def path(self, bs: int, cols: torch.Tensor, with_ids: bool = True):
        """The accepted path of the last verify, rows :bs (a DevicePath; its ids None unless
        with_ids: three kernels a step that a draft reading the state itself does without)."""
        m, bonus = self.accept_len[:bs], self.bonus[:bs]
        ids = path_tokens(self.tokens[:bs], m, bonus, cols) if with_ids else None
        hidden = self.hidden[:bs] if self.hidden is not None else None
        return DevicePath(self.prefix[:bs], m + 1, bonus, ids, hidden)

    def seed(self, n: int, bs: int, rows, path, pad_rows: tuple) -> None:
        """Rows :n from a DevicePath (the host's view after a synchronous step), padding
        rows n:bs at position 0."""
        self.rows[:, :n].copy_(rows)
        self.live[:n] = True
        self.prefix[:n].copy_(path.first_pos)
        self.accept_len[:n].copy_(path.lens - 1)
        self.bonus[:n].copy_(path.roots)
        self.tokens[:n, 1:].copy_(path.ids[:, :-1])
        if self.hidden is not None:
            self.hidden[:n].copy_(path.hidden)
        self.pad(n, bs, pad_rows)

    def keep(self, rows: torch.Tensor, bs: int, pad_rows: tuple) -> None:
        """Keeps the state rows `rows` ([n] device indices), in that order, at 0..n - 1."""
        n = rows.shape[0]
        for t in (self.rows[0], self.rows[1], self.tokens, self.accept_len, self.bonus,
                  self.prefix, self.hidden):
            if t is not None:
                t[:n] = t[rows]
        self.pad(n, bs, pad_rows)

    def pad(self, n: int, bs: int, pad_rows: tuple) -> None:
        for i, row in enumerate(pad_rows):
            self.rows[i, n:bs].fill_(row)
        self.live[n:bs] = False
        for t in (self.accept_len, self.bonus, self.prefix):
            t[n:bs].zero_()


class SpecStepGraphs:
    def __init__(self, decoder, target_runner, step_round, pool, show_progress: bool,
                 chain_depth: bool = False):
        """decoder: the SpecDecoder; target_runner: the target's ModelRunner; step_round: the
        draft's part of a step (its `step_round()`: buckets, bucket(n), propose, count);
        chain_depth: a chain also captures its shorter depths, and each bucket picks one
        (specpcg/speculative/depth.py). It is pinned with adaptive speculation, and stays with
        simulated acceptance: its cost model is what that benchmark measures."""
        self.dec, self.draft, self.target = decoder, decoder.draft, target_runner
        self.round = step_round
        self.width = decoder.spec.num_draft_tokens
        self.is_chain = decoder.spec.is_chain
        # Verify widths a step can run, widest first; a tree verifies all its nodes.
        depths = depth_ladder(decoder.spec.num_steps) if chain_depth and self.is_chain else ()
        self.widths = sorted({d + 1 for d in depths} | {self.width}, reverse=True)
        self.buckets = sorted(step_round.buckets)
        self.pool, self.show_progress = pool, show_progress
        device = target_runner.device
        self.state = StepState(self.buckets[-1], self.width, step_round.hidden_size,
                               step_round.hidden_dtype, device, tuple(self.widths))
        self.cols = torch.arange(self.width, device=device)
        target_pad = target_runner.kv_cache.req_pool.pad_row
        self.pad_rows = (target_pad, step_round.pad_row if step_round.pad_row is not None
                         else target_pad)
        self.graphs: dict = {}  # (bucket, width) -> graph
        self.step_seconds: dict = {}  # (bucket, depth) -> a replay's seconds (several widths)
        self.depth = None  # a ChainDepth (captured widths, timed), else the full width
        self.cost = CaptureCost()
        self._constants: dict = {}  # see _constant

    # -- the body ---------------------------------------------------------------------------
    def _body(self, bs: int, n: int) -> None:
        """One step of bs rows verifying n nodes each (a chain cut to its first n - 1 drafts
        when n is below the full width: the draft still proposes all of them)."""
        st = self.state
        path = st.path(bs, self.cols, self.round.path_ids)
        tokens, tree = self.round.propose(st, bs, path)  # [bs, N]; a Tree, None for chains
        if n < tokens.shape[1]:
            tokens = tokens[:, :n].contiguous()
        # the verify's start (0 on padding rows), its nodes' positions, slots and key counts
        inputs = verify_inputs(path.first_pos, path.lens, st.live[:bs], st.rows[0, :bs],
                               self.target.kv_cache.req_pool.req_to_token, n)
        prefix = inputs.prefix
        out_hidden, aux = self._verify(bs, st.rows[0, :bs], inputs, tokens, tree)
        if tree is None:
            tree = self.dec.verify_tree(tokens)
        simulate = self.dec.simulate
        predict = self.target.model.greedy_tokens(out_hidden).view(bs, n)
        if simulate is None:
            result = verify_greedy(tokens, tree.first_child, tree.next_sibling, predict, n - 1)
        elif self.is_chain:  # benchmark only; the default generator, which graphs replay safely
            coins = torch.rand((bs, n), device=tokens.device) < self._constant(
                ("coin limits", n), lambda: torch.tensor([simulate.prob] * (n - 1) + [-1.0],
                                                         device=tokens.device))
            result = simulate_accept_chain(tree, predict, coins)
        else:
            coins = torch.rand((bs, n - 1), device=tokens.device) < simulate.prob
            result = simulate_accept(tree.first_child, tree.depths, predict, coins)
        out = StepOutputs(st.tokens[:bs, :n], st.accept_len[:bs], st.bonus[:bs],
                          st.prefix[:bs], st.out[n][:bs])
        order = commit_step(result.accept_index, result.accept_len, st.live[:bs], tokens,
                            result.bonus, prefix, st.rows[0, :bs],
                            self.target.kv_cache.req_pool.req_to_token, out, not self.is_chain)
        if st.hidden is not None:
            rows = self.draft.target_hidden(ModelOutput(None, hidden_states=out_hidden,
                                                        aux_hidden_states=aux))
            rows = rows.view(bs, n, -1)
            if not self.is_chain:
                rows = rows.gather(1, order[..., None].expand(-1, -1, rows.shape[-1]))
            st.hidden[:bs, :n].copy_(rows)

    def _verify(self, bs: int, rows, inputs, tokens, tree=None):
        """The target's TARGET_VERIFY body over [bs, N] nodes at inputs.prefix.. (metadata
        planned in the body: inside the graph); a tree's node sits at prefix + its depth and
        sees its ancestors, its KV at prefix + its index."""
        n = tokens.shape[1]
        positions = (inputs.positions if tree is None
                     else (inputs.prefix[:, None] + tree.depths).reshape(-1))
        batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, input_ids=tokens.reshape(-1),
            positions=positions, out_cache_loc=inputs.out_cache_loc,
            req_pool_indices=rows, seq_lens=inputs.seq_lens,
            extend_seq_lens=self._constant(("node counts", bs, n), lambda: torch.full(
                (bs,), n, dtype=torch.long, device=rows.device)),
            seq_lens_cpu=[n] * bs, extend_seq_lens_cpu=[n] * bs,  # host lists: shape only
            tree_mask=None if tree is None else tree.tree_mask)
        self.dec.verify_outputs(batch)
        attn = self.target.attn_backend
        attn.init_forward_metadata(batch)
        with forward_context(ForwardContext(batch, attn, bs * n)):
            return self.target.call_model(batch)

    def _constant(self, key: tuple, make):
        """A tensor the body reads and never writes, made on its first call (a warm-up, outside
        any capture): its fill is then no kernel of the step's graph."""
        value = self._constants.get(key)
        if value is None:
            value = self._constants[key] = make()
        return value

    # -- capture and replay -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        from tqdm import tqdm

        # Largest first: the first capture sizes the buffers every later one reads.
        shapes = [(bs, w) for bs in sorted(self.buckets, reverse=True) for w in self.widths]
        with self.cost.measure("speculative step graphs", len(shapes)):
            for bs, w in tqdm(shapes, desc="capturing speculative step graphs",
                              disable=not self.show_progress):
                self.state.pad(0, bs, self.pad_rows)  # all padding: sink slots only
                self.graphs[(bs, w)], _ = warm_and_capture(lambda: self._body(bs, w), self.pool)
        if len(self.widths) > 1:
            self._time_replays(shapes)
            self.depth = ChainDepth(self.dec.depth_hist, self.step_seconds)

    def _time_replays(self, shapes: list, repeats: int = 5) -> None:
        """step_seconds: each graph's median replay on padding rows, what a chain depth's step
        costs in its bucket (the controller compares depths within a bucket only)."""
        for bs, w in shapes:
            self.state.pad(0, bs, self.pad_rows)
            graph, times = self.graphs[(bs, w)], []
            graph.replay()
            for _ in range(repeats):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            self.step_seconds[(bs, w - 1)] = sorted(times)[repeats // 2]

    def bucket(self, n: int):
        return self.round.bucket(n)

    def pick_width(self, bs: int) -> int:
        """The verify width of the next step of bucket bs: the chain depth's pick + 1."""
        return self.width if self.depth is None else self.depth.depth(bs) + 1

    def observe(self, bs: int, width: int, seconds: float) -> None:
        """A step of bucket bs verifying `width` nodes took `seconds` (as run, host included)."""
        if self.depth is not None:
            self.depth.observe(bs, width - 1, seconds)

    @torch.inference_mode()
    def run(self, bs: int, width: int | None = None) -> None:
        width = width or self.width
        graph = self.graphs.get((bs, width))
        if graph is None:
            self._body(bs, width)
        else:
            graph.replay()
        self.round.count(self.runner_name)
        self.dec.router.count("TARGET_VERIFY", self.runner_name)

    @property
    def runner_name(self) -> str:
        return "spec_step_graph" if self.graphs else "spec_step_eager"

    def info(self) -> dict:
        return {"batch_sizes": self.buckets, "captured": bool(self.graphs),
                "widths": self.widths, **self.cost.info(),
                **({"chain_depth": self.depth.info()} if self.depth is not None else {})}
