"""Incremental outputs of one request: what is new since the last chunk.

Text deltas never split a character (a token that ends inside a UTF-8 sequence decodes to
U+FFFD until the next token completes it) and never show the start of a stop string that may
still match: those characters wait until the request finishes or they can no longer match.
"""

from __future__ import annotations

from specpcg.stopping import trim_stop_string

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, req):
        self.tokenizer, self.req = tokenizer, req
        self.sent_chars = 0
        self.sent_ids = 0
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1

    def _text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.req.output_ids, self.req.params.skip_special_tokens)

    def next_chunk(self) -> dict:
        """{"delta": new text, "delta_ids": new ids, "finished": bool}; may be empty."""
        req = self.req
        text = self._text()
        if req.finished:
            safe = len(trim_stop_string(text, req))
        else:
            safe = len(text.rstrip(REPLACEMENT)) - self.hold
        delta = text[self.sent_chars:max(safe, self.sent_chars)]
        self.sent_chars += len(delta)
        ids = list(req.output_ids[self.sent_ids:])
        self.sent_ids += len(ids)
        return {"delta": delta, "delta_ids": ids, "finished": req.finished}
