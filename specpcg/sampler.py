"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds; logprobs.

Logprobs are reported from the raw (unscaled) distribution, as SGLang does by default.
"""

from __future__ import annotations

import torch

from kernels.topk import argmax_rows
from specpcg.core import Request, SamplingParams


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies top-k, top-p and min-p to one row of probabilities; renormalises."""
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep a token while the mass strictly before it is below top_p (the top token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) > params.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def target_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) after the filters."""
    return filter_probs(torch.softmax(logits_row.float() / params.temperature, -1), params)


def make_generator(params: SamplingParams, device, engine_seed: int, rid: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    # Unseeded requests still get a reproducible stream from the engine seed and request id.
    gen.manual_seed(params.seed if params.seed is not None else engine_seed * 1_000_003 + rid)
    return gen


def sample(logits: torch.Tensor, reqs: list, greedy_ids: torch.Tensor | None = None
           ) -> torch.Tensor:
    """logits: [bs, vocab] float32, one row per request; returns [bs] int64 token ids. The
    greedy pick is the top-k kernel's on CUDA: torch's argmax took 13 us of a batch-1 decode
    step of the default model (about 560 us on an H200); the kernel's two passes took about 3
    in a batch-1 verify's trace (bf16 rows). greedy_ids: those picks made already (inside a
    decode graph); an all-greedy batch gets them back as they are, and a sampled row is written
    into a copy, never into the graph's output."""
    if greedy_ids is None:
        next_ids = argmax_rows(logits)
    elif all(req.params.is_greedy for req in reqs):
        return greedy_ids
    else:
        next_ids = greedy_ids.clone()
    for i, req in enumerate(reqs):
        if req.params.is_greedy:
            continue
        probs = target_probs(logits[i], req.params)
        next_ids[i] = torch.multinomial(probs, 1, generator=req.generator)[0]
    return next_ids


def record_output_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, reqs: list) -> None:
    rows = [i for i, r in enumerate(reqs) if r.return_logprob]
    if not rows:
        return
    logprobs = torch.log_softmax(logits[rows].float(), -1)
    chosen = logprobs.gather(-1, next_ids[rows][:, None])[:, 0].tolist()
    for row, lp in zip(rows, chosen):
        reqs[row].output_logprobs.append((lp, int(next_ids[row])))


def record_input_logprobs(req: Request, logits: torch.Tensor, first_pos: int) -> None:
    """logits[j] (of the chunk starting at prompt position first_pos) predicts token first_pos+j+1."""
    prompt = req.prompt_ids
    num_rows = logits.shape[0]
    if first_pos == 0 and req.logprob_start_len == 0:
        req.input_logprobs.append((None, prompt[0]))
    targets = [p + 1 for p in range(first_pos, first_pos + num_rows)]
    keep = [j for j, t in enumerate(targets) if req.logprob_start_len <= t < len(prompt)]
    if not keep:
        return
    ids = torch.tensor([prompt[targets[j]] for j in keep], device=logits.device)
    lps = torch.log_softmax(logits[keep].float(), -1).gather(-1, ids[:, None])[:, 0].tolist()
    req.input_logprobs.extend(zip(lps, ids.tolist()))
