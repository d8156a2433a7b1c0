"""Dense causal attention with no KV cache: the draft trainer's backend (autograd runs through it).

Every sequence of a batch (`extend_seq_lens_cpu`, no cached prefix) attends causally over its own
tokens. The packed rows [T, ...] are laid out once per batch as a padded [bs, max_len] block, so one
SDPA call serves the whole batch (training batches hold sequences of similar lengths).

Unrolled training-time test (TTT): inside `backend.unrolled()`, successive forwards are successive
draft steps over the same rows, and step k (1-based) also attends over the K/V that steps 1..k-1
left for the same layer. A query at position p of step k sees

    the step-1 keys at positions j <= p - k + 1, and step i's key at position p - (k - i), i = 2..k

which is what a chain draft's KV cache holds when it runs step k at position p: the catch-up wrote
the step-1 keys up to the root at p - k + 1, then each earlier draft step wrote one key.

Two ways to compute a step k > 1 (`ttt`): "mask" runs one fused SDPA call over all k * L keys with
that mask; "diag" scores the step-1 keys as one shifted-causal [L, L] product and each later step's
single key per query as a row-wise dot product, then takes one softmax over the L + k - 1 columns.
Both give the same attention; "diag" does L * (L + k - 1) work at step k where "mask" does k * L * L,
yet "mask" (the default) ran a training step 7% faster on the H100, its fused kernel against
"diag"'s materialised [L, L] scores (benchmarks/results/train_step.jsonl).

A window (`TTTWindow`, "mask" only) runs steps k > 1 on a suffix of each sequence, positions
p >= start, since the trainer needs those steps only where an answer is drafted: their queries
see the step-1 keys of the whole sequence and the window's own keys of later steps. A row near
the window's start reads an earlier step's output the window did not compute (zeros); only rows
with p - k <= start - 3 depend on it, so every row with p - k >= start - 2 is exact.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specpcg.attention.base import AttentionBackend
from specpcg.core import ForwardBatch, ForwardMode
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.transfer import runs, to_device


# NOTE: not cuDNN's attention: it builds an execution plan per new shape, and training batches
# come in hundreds of lengths (x TTT steps), so bf16 training ran 5x slower through its first
# epoch on the H100 (benchmarks/results/train_step.jsonl). Flash takes the causal forwards, the
# memory-efficient kernel the masked TTT steps.
FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class PaddedLayout:
    """Packed rows [T, ...] <-> padded [bs, max_len, ...] for sequences starting at position 0."""

    def __init__(self, seq_lens: list, device):
        self.batch_size, self.max_len = len(seq_lens), max(seq_lens)
        # The padded row of each packed row, [T], from the host's lengths (a mask's nonzero()
        # would wait for the device at every forward).
        lens = torch.tensor(seq_lens)
        seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)  # each row's sequence
        shift = torch.arange(len(seq_lens)) * self.max_len - (lens.cumsum(0) - lens)
        self.rows = to_device(shift[seq] + torch.arange(int(lens.sum())), device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(self.batch_size * self.max_len, *x.shape[1:])
        return padded.index_copy(0, self.rows, x).view(self.batch_size, self.max_len, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.batch_size * self.max_len, *x.shape[2:])[self.rows]


@lru_cache(maxsize=256)
def shifted_causal(seq_len: int, shift: int, device: torch.device) -> torch.Tensor:
    """[L, L] bool: key j is visible from query p when j <= p - shift."""
    pos = torch.arange(seq_len, device=device)
    return pos[None, :] <= pos[:, None] - shift


def _shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x [bs, h, L, D] read at position p - shift (zeros before the start)."""
    return F.pad(x, (0, 0, shift, 0))[:, :, :x.shape[2]] if shift else x


def ttt_diag_attention(q: torch.Tensor, steps: list, scale: float, group: int) -> torch.Tensor:
    """Step k = len(steps) of an unrolled draft (the module docstring's key set), by "diag".
    q: [bs, H, L, D]; steps[i] = (k, v) [bs, Hkv, L, D] of step i + 1 -> [bs, H, L, D]."""
    expand = (lambda t: t.repeat_interleave(group, dim=1)) if group > 1 else (lambda t: t)
    step, length, device = len(steps), q.shape[2], q.device
    k1, v1 = expand(steps[0][0]), expand(steps[0][1])
    scores = [torch.matmul(q, k1.transpose(-1, -2)).float().masked_fill(
        ~shifted_causal(length, step - 1, device), float("-inf"))]  # [bs, H, L, L]
    values = []
    before = torch.arange(length, device=device)  # query positions, for the shifted keys' start
    for i in range(2, step + 1):  # step i's key sits at p - (step - i)
        shift = step - i
        ki, vi = (_shift(expand(t), shift) for t in steps[i - 1])
        scores.append((q.float() * ki.float()).sum(-1, keepdim=True).masked_fill(
            (before < shift)[:, None], float("-inf")))  # [bs, H, L, 1]
        values.append(vi)
    probs = torch.softmax(torch.cat(scores, dim=-1) * scale, dim=-1)
    # NOTE: one split, not a slice per column block: each slice's backward would allocate and
    # fill a zero tensor of the whole [bs, H, L, L + k - 1] probabilities.
    main, diag = probs.split([length, step - 1], dim=-1)
    out = torch.matmul(main.to(v1.dtype), v1)
    return out + (diag.to(v1.dtype).unsqueeze(-1) * torch.stack(values, dim=3)).sum(3)


@lru_cache(maxsize=64)
def ttt_mask(seq_len: int, step: int, device: torch.device) -> torch.Tensor:
    """[L, step * L] bool: which keys of steps 1..step a step-`step` query at each position sees
    (key blocks in step order; see the module docstring)."""
    pos = torch.arange(seq_len, device=device)
    blocks = [pos[None, :] <= pos[:, None] - (step - 1)]
    blocks += [pos[None, :] == pos[:, None] - (step - i) for i in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


class TTTWindow:
    """Steps k > 1 of an unrolled batch on each sequence's rows p >= starts[b] (module docstring).
    `batch` is the window's own batch (its rows packed, positions from each start); the step-1
    batch is the whole sequences'."""

    def __init__(self, batch: ForwardBatch, starts: list, full_lens: list):
        device = batch.input_ids.device
        self.batch, self.layout = batch, PaddedLayout(batch.extend_seq_lens_cpu, device)
        self.full_max = max(full_lens)
        self.starts = to_device(starts, device)
        self._masks = {}

    def mask(self, step: int) -> torch.Tensor:
        if step not in self._masks:
            self._masks[step] = self._mask(step)
        return self._masks[step]

    def _mask(self, step: int) -> torch.Tensor:
        """[bs, 1, W, L + (step - 1) * W] bool, keys in step order: step 1 over the whole
        sequence (j <= p - step + 1), then one key of each later step (p - (step - i))."""
        width, device = self.layout.max_len, self.starts.device
        query = torch.arange(width, device=device)
        pos = self.starts[:, None] + query  # [bs, W] each query's position
        full = torch.arange(self.full_max, device=device)
        blocks = [full[None, None, :] <= pos[:, :, None] - (step - 1)]
        diag = [query[None, :] == query[:, None] - (step - i) for i in range(2, step + 1)]
        blocks += [d.expand(len(self.starts), -1, -1) for d in diag]
        return torch.cat(blocks, dim=2)[:, None]


class DenseAttnBackend(AttentionBackend):
    name = "dense"
    paged = False  # no KV cache: forward attends over the k and v it is given

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 compute_dtype=None, ttt: str = "mask"):
        super().__init__(None, num_heads, num_kv_heads, head_dim, scale)
        if ttt not in ("diag", "mask"):
            raise ValueError(f"ttt must be 'diag' or 'mask', got {ttt!r}")
        self.ttt = ttt
        # None: attend in the inputs' dtype. The trainer passes bf16 on CUDA: its fp32 heads
        # would otherwise run the masked TTT attention (keys of every earlier step) in fp32.
        self.compute_dtype = compute_dtype
        self._layout = None  # (batch, PaddedLayout) of the forward in flight
        self._steps = None  # inside unrolled(): layer_id -> [(k, v) padded] of earlier steps
        self._window = None  # inside unrolled(window=...): the TTTWindow of steps k > 1

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if self._layout is not None and self._layout[0] is batch:
            return  # the TTT steps of one batch share its layout
        if self._window is not None and self._window.batch is batch:
            return  # a window's steps: its rows start inside their sequences
        assert all(s == e for s, e in zip(batch.seq_lens_cpu, batch.extend_seq_lens_cpu)), \
            "the dense backend has no KV cache: every sequence must start at position 0"
        self._layout = (batch, PaddedLayout(batch.extend_seq_lens_cpu, batch.input_ids.device))

    @contextmanager
    def unrolled(self, window: "TTTWindow" = None):
        """Forwards inside are TTT steps 1, 2, ... over the same batch rows (steps k > 1 over
        `window.batch`'s rows when a window is given)."""
        assert self._steps is None, "unrolled() does not nest"
        if window is not None and self.ttt != "mask":
            raise ValueError("a TTT window needs ttt='mask'")
        self._steps, self._window = {}, window
        try:
            yield self
        finally:
            self._steps = self._window = None

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        num_tokens, out_dtype = q.shape[0], q.dtype
        if self.compute_dtype is not None:
            q, k, v = (t.to(self.compute_dtype) for t in (q, k, v))
        if self._window is not None and self._window.batch is batch:
            return self._window_forward(q, k, v, layer_id).to(out_dtype)
        owner, layout = self._layout
        assert owner is batch, "init_forward_metadata was not called for this batch"
        q4 = self._heads(layout, q, self.num_heads)  # [bs, H, L, D]
        k4 = self._heads(layout, k, self.num_kv_heads)  # [bs, Hkv, L, D]
        v4 = self._heads(layout, v, self.num_kv_heads)
        group = self.num_heads // self.num_kv_heads
        steps = [(k4, v4)]  # this layer's (k, v) of every step so far, this one last
        if self._steps is not None:
            steps = self._steps.setdefault(layer_id, [])
            steps.append((k4, v4))
        if len(steps) > 1 and self.ttt == "diag":
            out = ttt_diag_attention(q4, steps, self.scale, group)
        else:
            mask = ttt_mask(q4.shape[2], len(steps), q4.device) if len(steps) > 1 else None
            out = self._sdpa(q4, steps, group, mask)
        # Padded rows only ever see keys at or before themselves: finite, then dropped here.
        return layout.unpad(out.transpose(1, 2)).reshape(num_tokens, -1).to(out_dtype)

    def _window_forward(self, q, k, v, layer_id: int) -> torch.Tensor:
        """A step k > 1 on the window's rows: step 1's keys over whole sequences, then the
        window's keys of steps 2..k, under TTTWindow.mask."""
        window, group = self._window, self.num_heads // self.num_kv_heads
        steps = self._steps[layer_id]
        assert steps, "a window step runs after step 1 of the same layer"
        steps.append(tuple(self._heads(window.layout, t, self.num_kv_heads) for t in (k, v)))
        q4 = self._heads(window.layout, q, self.num_heads)
        out = self._sdpa(q4, steps, group, window.mask(len(steps)))  # keys: L + (k - 1) * W
        return window.layout.unpad(out.transpose(1, 2)).reshape(q.shape[0], -1)

    def _sdpa(self, q4: torch.Tensor, steps: list, group: int, mask) -> torch.Tensor:
        """One fused SDPA call over every step's keys (concatenated in step order): causal with
        no mask (step 1), else under `mask`."""
        keys = torch.cat([k for k, _ in steps], dim=2)  # [bs, Hkv, keys of every step, D]
        values = torch.cat([v for _, v in steps], dim=2)
        # NOTE: only flash attention (causal, half precision) takes unequal head counts; with
        # enable_gqa anything else runs SDPA's unfused math path, so repeat the KV heads then.
        gqa = group > 1 and mask is None and q4.dtype in (torch.bfloat16, torch.float16)
        if group > 1 and not gqa:
            keys, values = (t.repeat_interleave(group, dim=1) for t in (keys, values))
        with sdpa_kernel(FUSED_BACKENDS):
            return F.scaled_dot_product_attention(
                q4, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=gqa)  # [bs, H, L, D]

    def _heads(self, layout: PaddedLayout, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[T, heads * D] packed -> [bs, heads, L, D] padded."""
        return layout.pad(x.reshape(x.shape[0], num_heads, self.head_dim)).transpose(1, 2)


def dense_batch(input_ids: torch.Tensor, seq_lens: list) -> ForwardBatch:
    """An EXTEND batch of whole sequences (packed `input_ids`, positions from 0) with no KV."""
    device = input_ids.device
    # Built on the host and copied once: an arange per sequence on the device was a kernel
    # launch each, and training batches hold dozens of sequences. Through pinned memory: a copy
    # from pageable memory waits for the stream to drain (specpcg.transfer).
    positions = to_device(torch.from_numpy(runs([0] * len(seq_lens), seq_lens)), device)
    lens = to_device(seq_lens, device)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=input_ids, positions=positions,
        out_cache_loc=torch.zeros_like(input_ids), req_pool_indices=torch.zeros_like(lens),
        seq_lens=lens, extend_seq_lens=lens, seq_lens_cpu=list(seq_lens),
        extend_seq_lens_cpu=list(seq_lens))


def dense_forward(model, backend: DenseAttnBackend, batch: ForwardBatch, aux_layers: tuple = (),
                  input_hidden=None):
    """`model(batch.input_ids, batch.positions, aux_layers[, input_hidden])` under a forward
    context, as ModelRunner runs it, with grad as the caller has it (no inference_mode)."""
    backend.init_forward_metadata(batch)
    with forward_context(ForwardContext(batch=batch, attn_backend=backend,
                                        num_tokens=batch.num_tokens)):
        if input_hidden is None:
            return model(batch.input_ids, batch.positions, aux_layers)
        return model(batch.input_ids, batch.positions, aux_layers, input_hidden=input_hidden)
