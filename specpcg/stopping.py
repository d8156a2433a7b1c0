"""When a request is done: max_new_tokens, EOS, stop token ids, stop strings, context length."""

from __future__ import annotations

from specpcg.core import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple, context_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_len = context_len

    def append(self, req: Request, tokens: list) -> None:
        """Appends a run of new tokens (a spec step's accepted drafts and bonus), stopping at
        the first that ends the request. Stop strings cost a detokenization each, so they are
        looked for once, in the tail the run ends; only a run that holds one is walked again
        token by token to find where the request ends."""
        start = len(req.output_ids)
        self._walk(req, tokens, strings=False)
        if not (req.params.stop and self.tokenizer is not None):
            return
        if self._stop_string(req, len(req.output_ids) - start):
            del req.output_ids[start:]
            req.finish_reason = req.matched_stop = None
            self._walk(req, tokens, strings=True)

    def _walk(self, req: Request, tokens: list, strings: bool) -> None:
        if not strings and len(tokens) > 1 and req.params.max_new_tokens > 0:
            clear = self._clear_run(req, tokens)
            req.output_ids.extend(tokens[:clear])
            tokens = tokens[clear:]
        for token in tokens:
            if req.params.max_new_tokens > 0:
                req.output_ids.append(token)
            self.check(req, strings)
            if req.finished:
                return

    def _clear_run(self, req: Request, tokens: list) -> int:
        """How many of a run's leading tokens cannot end the request but by a stop string: those
        before its first stop token, and before its length or the context is reached. They are
        appended at once; the rest go through `check` one by one. NOTE: checked token by token,
        a speculative step's 8 tokens for each of 64 requests took half its host time (a 2-core
        CPU, `probe_spec_host.py`)."""
        params = req.params
        eos = () if params.ignore_eos else self.eos_token_ids
        stops = params.stop_token_ids
        first_stop = next((i for i, t in enumerate(tokens) if t in stops or t in eos),
                          len(tokens))
        return max(min(first_stop, self.tokens_left(req) - 1), 0)

    def tokens_left(self, req: Request) -> int:
        """Tokens the request may still emit before its length or the context ends it (EOS
        and stop tokens may end it sooner)."""
        return min(req.params.max_new_tokens - len(req.output_ids),
                   self.context_len - req.seq_len)

    def check(self, req: Request, strings: bool = True) -> None:
        """Sets req.finish_reason if the last output token ends the request (stop strings
        only when `strings`)."""
        params = req.params
        token = req.output_ids[-1] if req.output_ids else None
        if token is not None and token in params.stop_token_ids:
            req.finish_reason = {"type": "stop", "matched": token}
        elif token is not None and not params.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = {"type": "stop", "matched": token}
        elif strings and params.stop and self.tokenizer is not None and self._stop_string(req):
            req.finish_reason = {"type": "stop", "matched": req.matched_stop}
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        elif req.seq_len >= self.context_len:
            # Clamped: the prompt plus max_new_tokens did not fit; the reason says so.
            req.finish_reason = {"type": "length", "length": len(req.output_ids),
                                 "message": f"context_length {self.context_len} reached before "
                                            f"max_new_tokens {params.max_new_tokens}"}

    def _stop_string(self, req: Request, new_tokens: int = 1) -> bool:
        # Only the tail can hold a new match: decode enough tokens to cover the longest stop
        # string ending in any of the last `new_tokens` tokens.
        longest = max(len(s) for s in req.params.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 7 + new_tokens):],
                                     skip_special_tokens=False)
        for s in req.params.stop:
            if s in tail:
                req.matched_stop = s
                return True
        return False


def trim_stop_string(text: str, req: Request) -> str:
    if isinstance(req.matched_stop, str):
        cut = text.rfind(req.matched_stop)
        if cut >= 0:
            return text[:cut]
    return text
