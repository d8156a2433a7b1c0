"""Self-distillation: the target answers every prompt itself, greedily, turn after turn.

A chat sample's user turns go through the target's chat template one at a time: the target
answers turn 1, its answer joins the conversation, then it answers turn 2, and so on up to
`max_turns`. Every turn gives a sequence a draft trains on: that turn's prompt (earlier answers
included) plus the target's answer to it, so each answer of a chat is trained on as an answer,
and every assistant span is the target's own text. Plain-text samples (the few-shot format) are one
prompt, stopped where the benchmark stops. Token-id prompts (a target with no tokenizer) are
answered once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tqdm import tqdm

from drafts.train_data import Sequences
from specpcg.gsm8k import STOP

GEN_BATCH_CUDA = 512  # concurrent requests (and decode-graph batch) while generating answers
GEN_TOKENS_PER_REQUEST = 1536  # KV room per request: max_prompt_tokens plus an answer
# Admission while generating: prefill 64 new requests at a time in 16k-token chunks, not one
# prefill step per finished answer (4,000 prompts on the H100: 28.1 s against 41.8 s, the
# prefill steps 112 against 1,962; benchmarks/results/probe_distill.jsonl).
GEN_ADMISSION = {"chunked_prefill_size": 16384, "min_prefill_requests": 64}
# An engine whose model only computes features (answers cached): no graphs to capture and no
# generation-sized KV cache, which cost a later draft a minute of its budget.
FEATURES_ONLY = dict(disable_cuda_graph=True, disable_piecewise_cuda_graph=True,
                     max_running_requests=8, max_total_tokens=8192, chunked_prefill_size=4096,
                     min_prefill_requests=1)


def make_engine(target: Optional[str], device: str, **overrides):
    """An engine on `target` sized for generating answers (on CUDA), with `overrides`."""
    from specpcg import Engine
    from specpcg.config import EngineConfig

    kw = dict(model_path=target, device=device, show_progress=False)
    if EngineConfig(device=device).resolve_device().type == "cuda":
        # A bounded KV cache (not a share of free memory): drafts can train side by side.
        # No piecewise graphs: prefills come GEN_ADMISSION's 16,384 tokens at a time, past the
        # graphs' largest size (4,096), so capturing them would only spend the budget.
        kw.update(max_running_requests=GEN_BATCH_CUDA, cuda_graph_max_bs=GEN_BATCH_CUDA,
                  max_total_tokens=GEN_BATCH_CUDA * GEN_TOKENS_PER_REQUEST,
                  disable_piecewise_cuda_graph=True, **GEN_ADMISSION)
    return Engine(**{**kw, **overrides})


@dataclass
class _Conv:
    sample: object  # drafts.data.Sample, or a list of token ids
    messages: list = field(default_factory=list)
    prompt: Optional[list] = None  # the last prompt's ids
    turns: list = field(default_factory=list)  # (prompt ids, answer ids) of every turn
    first: Optional[list] = None  # turn 1's prompt ids, when tokenized ahead (_tokenize_first)


def _next_prompt(conv: _Conv, turn: int, tokenizer, max_prompt_tokens: int):
    """The ids of `conv`'s prompt for `turn` (0-based), or None when it has no such turn or
    the prompt would pass max_prompt_tokens."""
    s = conv.sample
    if isinstance(s, list):
        return s if turn == 0 else None
    ids = conv.first if turn == 0 else None  # tokenized ahead (_tokenize_first), or not
    if not s.is_chat:
        if turn == 0 and ids is None:
            ids = tokenizer.encode(s.text)
    elif turn < len(s.user_turns):
        conv.messages.append({"role": "user", "content": s.user_turns[turn]})
        if ids is None:
            ids = tokenizer.apply_chat_template(conv.messages)
    return ids if ids is not None and len(ids) <= max_prompt_tokens else None


def _tokenize_first(convs: list, tokenizer) -> None:
    """Every conversation's first prompt, tokenized in two batch calls (texts, chats) rather
    than one call each, before the first answer starts (the GPU waits meanwhile): 4,000 of
    the default data's prompts took 0.67 s against 1.24 s on two CPU cores, the same ids;
    the batch spreads over every core."""
    texts = [c for c in convs if not isinstance(c.sample, list) and not c.sample.is_chat]
    chats = [c for c in convs
             if not isinstance(c.sample, list) and c.sample.is_chat and c.sample.user_turns]
    for c, ids in zip(texts, tokenizer.encode_many([c.sample.text for c in texts])):
        c.first = ids
    opening = [[{"role": "user", "content": c.sample.user_turns[0]}] for c in chats]
    for c, ids in zip(chats, tokenizer.apply_chat_template_many(opening) if chats else []):
        c.first = ids


def first_prompts(samples: list, tokenizer, num: int, max_prompt_tokens: int = 1024) -> list:
    """Token ids of the first `num` samples' first prompts that fit max_prompt_tokens."""
    out = []
    for s in samples:
        ids = _next_prompt(_Conv(s), 0, tokenizer, max_prompt_tokens)
        if ids is not None:
            out.append(ids)
        if len(out) == num:
            break
    return out


def _params(conv: _Conv, max_new_tokens: int, tokenizer) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    sample = conv.sample
    if tokenizer is not None and not isinstance(sample, list) and not sample.is_chat:
        params["stop"] = STOP  # as the few-shot benchmark stops
    return params


def self_distill(engine, samples: list, max_new_tokens: int, max_turns: int = 1,
                 max_prompt_tokens: int = 1024, show_progress: bool = True) -> Sequences:
    """The target's greedy answers to `samples` (drafts.data.Sample, or token-id lists). Every
    first prompt is queued at once; a chat's next turn is queued as soon as its answer to the
    turn before arrives (no turn waits for the slowest answer of the one before), and the
    engine batches them all continuously. Samples whose first prompt is longer than
    max_prompt_tokens are skipped; a chat ends at its first turn that does not fit."""
    tok = engine.tokenizer
    if tok is None and any(not isinstance(s, list) for s in samples):
        raise ValueError("text and chat samples need the target's tokenizer; pass token-id "
                         "lists as data for a target without one")
    convs = [_Conv(s) for s in samples]
    if tok is not None:
        _tokenize_first(convs, tok)
    in_flight = {}  # request id -> (conversation, turn)

    def ask(conv: _Conv, turn: int) -> None:
        ids = _next_prompt(conv, turn, tok, max_prompt_tokens)
        if ids is not None:
            rid = engine.submit(input_ids=ids, sampling_params=_params(conv, max_new_tokens, tok))
            in_flight[rid], conv.prompt = (conv, turn), ids

    for conv in convs:
        ask(conv, 0)
    bar = tqdm(desc="self-distill", unit="answer", disable=not show_progress)
    while engine.has_unfinished():
        for out in engine.step():
            conv, turn = in_flight.pop(out["meta_info"]["id"])
            conv.turns.append((conv.prompt, out["output_ids"]))
            if conv.messages:
                conv.messages.append({"role": "assistant", "content": out["text"]})
            bar.update(1)
            if turn + 1 < max_turns:
                ask(conv, turn + 1)
    bar.close()
    done = [(c, p, a) for c in convs for p, a in c.turns]
    turns = [t for c in convs for t in range(len(c.turns))]
    if not done:
        raise ValueError(f"no sample fits max_prompt_tokens={max_prompt_tokens}")
    groups = {}
    return Sequences([p + a for _, p, a in done], [len(p) for _, p, a in done],
                     [getattr(c.sample, "source", "ids") for c, _, _ in done],
                     [groups.setdefault(_opening(c.sample), len(groups)) for c, _, _ in done],
                     turns)


def _opening(sample):
    """What identifies a conversation: its first user turn, its text, or its ids."""
    if isinstance(sample, list):
        return tuple(sample)
    return sample.user_turns[0].strip() if sample.is_chat else sample.text
