"""Small shared types: forward modes, hidden-capture modes, sampling params, requests, batches."""

from __future__ import annotations

import enum
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill or one chunk of a prompt on top of a cached prefix
    DECODE = 2  # one token per request
    TARGET_VERIFY = 3  # the target scores draft tokens (k + 1 per request)
    DRAFT_EXTEND = 4  # the draft catches up on accepted tokens
    IDLE = 5  # no requests

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


class CaptureHiddenMode(enum.IntEnum):
    """Ordered: a forward that captured FULL can serve a request for LAST or NULL."""

    NULL = 0
    LAST = 1
    FULL = 2


class FinishReason:
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple = ()  # stop strings
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @staticmethod
    def from_dict(d: Optional[dict]) -> "SamplingParams":
        """Builds and validates; every error names the field and the value."""
        d = dict(d or {})
        known = set(SamplingParams.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        for key in ("stop", "stop_token_ids"):
            if d.get(key) is None:
                d.pop(key, None)
            else:
                d[key] = tuple(d[key])
        params = SamplingParams(**d)
        params.validate()
        return params

    def validate(self) -> None:
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {m!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < -1 or k == 0:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {k!r}")
        mp = self.min_p
        if not isinstance(mp, (int, float)) or isinstance(mp, bool) or not 0 <= mp <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {mp!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


_request_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and everything the scheduler tracks for it."""

    prompt_ids: list
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input-token logprobs
    rid: int = field(default_factory=lambda: next(_request_ids))
    output_ids: list = field(default_factory=list)
    # KV bookkeeping: how many tokens of `all_ids` already have KV in the pool.
    req_pool_idx: Optional[int] = None
    num_cached: int = 0
    finish_reason: Optional[str] = None
    matched_stop: object = None
    output_logprobs: list = field(default_factory=list)
    input_logprobs: list = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    num_preemptions: int = 0
    # speculative decoding: verify forwards, accepted drafts, histogram of accepted per verify
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    spec_histogram: Counter = field(default_factory=Counter)
    plain_decode_tokens: int = 0  # tokens from plain steps between speculative ones (adaptive)
    # adaptive speculation's shadow verifies (specpcg/speculative/shadow.py): where the next
    # one judges (0: not started), how many ran, the tokens of the last few and their sum
    shadow_context: int = 0
    shadow_verifies: int = 0
    shadow_recent: Optional[deque] = None
    shadow_tokens: int = 0

    @property
    def all_ids(self) -> list:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        """all_ids[-1], without building all_ids (a step reads it for every request)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def ids_slice(self, start: int, stop: Optional[int] = None) -> list:
        """all_ids[start:stop] for 0 <= start, without building all_ids."""
        p = len(self.prompt_ids)
        stop = self.seq_len if stop is None else min(stop, self.seq_len)
        if start >= p:
            return self.output_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)


@dataclass
class ForwardBatch:
    """What one forward needs. Tensors live on the model's device; `*_cpu` lists on the host."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot each new token writes to
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] total length after this forward
    extend_seq_lens: torch.Tensor  # [bs] new tokens per request (1 each for DECODE)
    seq_lens_cpu: list
    extend_seq_lens_cpu: list
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    aux_hidden_layers: tuple = ()  # layer ids whose outputs are also returned (EAGLE3)
    return_all_logits: bool = False  # logits for every token (input logprobs, verify)
    # [bs, N, K] bool, K >= N: a draft tree's new tokens (rows) against the last K keys of their
    # request (the tree so far); keys before those are the committed prefix, seen by all.
    tree_mask: Optional[torch.Tensor] = None
    input_hidden: Optional[torch.Tensor] = None  # [num_tokens, H]: a draft head's hidden input
    # > 0: request i's tokens sit at rows i*stride .. i*stride + extend_len - 1 and the rows past
    # them are padding (a draft catch-up graph's fixed layout); 0: requests packed back to back.
    req_row_stride: int = 0
    # True: req_to_token lacks the new tokens' slots (extend_many(write=False)); whoever runs
    # the forward writes them first, at columns `positions` (KVCache.write_rows), or a decode
    # graph that writes them itself. Saves a decode step the host's copy and two launches.
    rows_pending: bool = False
    # [5, bs] long when every request has one new token: input ids, positions, slots, request
    # rows and seq lens as one block of the batch's packed copy (a decode graph loads it in one
    # op).
    index_rows: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_prefix_lens_cpu(self) -> list:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_seq_lens_cpu)]

    def to(self, device) -> "ForwardBatch":
        """A copy whose tensors live on `device` (a batch sent to another rank travels on the
        host: pickled CUDA tensors would arrive on the sender's GPU)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        moved["index_rows"] = None  # moved apart, the views are no longer one block
        return replace(self, **moved)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [bs, vocab] float32, each request's last token
    all_logits: Optional[torch.Tensor] = None  # [num_tokens, vocab] when return_all_logits
    hidden_states: Optional[torch.Tensor] = None  # rows per capture_hidden_mode
    aux_hidden_states: Optional[list] = None  # per aux layer, same rows as hidden_states
    # [bs] int64 argmax of `logits` where a decode graph took it; a view of the graph's output,
    # valid until its next replay
    greedy_ids: Optional[torch.Tensor] = None
    # The step wrote the draft's hidden rows to its ring (specpcg/hidden_ring.py), not here.
    hidden_in_ring: bool = False
