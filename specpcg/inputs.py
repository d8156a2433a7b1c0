"""Turns what a user passes to `Engine.generate` into validated Requests, or refuses it whole.

Every check runs before any work: a bad item in a list call refuses the call, naming its index,
and nothing is queued, so requests already in flight are untouched.
"""

from __future__ import annotations

from typing import Optional

from specpcg.core import Request, SamplingParams


def _as_list(value, is_single):
    if value is None:
        return None
    return [value] if is_single(value) else list(value)


def normalize_inputs(prompt, input_ids, messages) -> tuple:
    """Returns (items, single): items are ("text", str) | ("ids", list) | ("chat", list)."""
    given = [n for n, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, input_ids, messages; got {given or 'none'}")
    if prompt is not None:
        single = isinstance(prompt, str)
        items = [("text", p) for p in _as_list(prompt, lambda v: isinstance(v, str))]
    elif input_ids is not None:
        single = len(input_ids) == 0 or not isinstance(input_ids[0], (list, tuple))
        items = [("ids", list(x)) for x in ([input_ids] if single else input_ids)]
    else:
        single = len(messages) == 0 or isinstance(messages[0], dict)
        items = [("chat", m) for m in ([messages] if single else messages)]
    return items, single


def per_item(value, num_items: int, name: str) -> list:
    """Broadcasts one value (or a dict) to every item, or checks a per-item list's length."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_items:
            raise ValueError(f"{name} has {len(value)} entries but there are {num_items} inputs")
        return list(value)
    return [value] * num_items


def tokenize_item(kind: str, value, tokenizer, apply_chat_template: bool) -> list:
    if kind == "ids":
        return list(map(int, value))
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer (shape-only model): pass input_ids")
    if kind == "chat":
        return tokenizer.apply_chat_template(value)
    if not isinstance(value, str):
        raise ValueError(f"prompt must be a string, got {type(value).__name__}")
    if apply_chat_template and tokenizer.has_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": value}])
    return tokenizer.encode(value)


def check_prompt(ids: list, vocab_size: int, context_len: int, total_slots: int) -> None:
    if not ids:
        raise ValueError("prompt is empty (0 tokens)")
    if min(ids) < 0 or max(ids) >= vocab_size:  # two C-level passes, not a Python loop
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"input_ids holds token id {bad} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= context_len:
        raise ValueError(f"prompt has {len(ids)} tokens but context_length is {context_len}; "
                         f"it must leave room for at least one new token")
    if len(ids) + 1 > total_slots:
        raise ValueError(f"prompt needs {len(ids) + 1} KV slots but the KV cache has "
                         f"{total_slots}; raise max_total_tokens")


def build_requests(items, sampling_params, return_logprob, logprob_start_len, tokenizer,
                   apply_chat_template: bool, vocab_size: int, context_len: int,
                   total_slots: int) -> list:
    n = len(items)
    params_list = per_item(sampling_params, n, "sampling_params")
    logprob_list = per_item(return_logprob, n, "return_logprob")
    start_list = per_item(logprob_start_len, n, "logprob_start_len")
    reqs = []
    for i, ((kind, value), sp, lp, start) in enumerate(zip(items, params_list, logprob_list, start_list)):
        try:
            params = SamplingParams.from_dict(sp)
            ids = tokenize_item(kind, value, tokenizer, apply_chat_template)
            check_prompt(ids, vocab_size, context_len, total_slots)
            _check_logprob_start(start)
        except ValueError as e:
            raise ValueError(f"input {i}: {e}" if n > 1 else str(e)) from None
        reqs.append(Request(prompt_ids=ids, params=params, return_logprob=bool(lp),
                            logprob_start_len=-1 if start is None else start))
    return reqs


def _check_logprob_start(start: Optional[int]) -> None:
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < -1):
        raise ValueError(f"logprob_start_len must be an integer >= -1, got {start!r}")
