"""Incremental outputs of one request: what is new since the last chunk.

Text deltas never split a character (a token that ends inside a UTF-8 sequence decodes to
U+FFFD until the next token completes it) and never show the start of a stop string that may
still match: those characters wait until the request finishes or they can no longer match.
"""

from __future__ import annotations

from specpcg.stopping import trim_stop_string

REPLACEMENT = "\ufffd"


class TextStream:
    """NOTE: text is decoded incrementally: each step decodes only a window of the last few
    tokens (the ones already shown, for context, then the new ones), so a stream costs O(new
    tokens) per step instead of decoding the whole output again; a request of n tokens used to
    cost O(n^2). The finished text is decoded whole once, so it is exactly generate's."""

    def __init__(self, tokenizer, req):
        self.tokenizer, self.req = tokenizer, req
        self.sent_chars = 0
        self.sent_ids = 0
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1
        self.text = ""  # the decoded text of output_ids[:read_offset]
        self.prefix_offset = self.read_offset = 0  # the window starts at prefix_offset

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, self.req.params.skip_special_tokens)

    def _advance(self) -> str:
        """The decoded text so far: the new tokens are decoded after the window's context
        tokens (so a leading space or a multi-byte character decodes as in the whole text),
        and wait while they end inside a character."""
        if self.tokenizer is None:
            return ""
        ids = self.req.output_ids
        if len(ids) > self.read_offset:
            shown = self._decode(ids[self.prefix_offset:self.read_offset])
            window = self._decode(ids[self.prefix_offset:])
            if len(window) > len(shown) and not window.endswith(REPLACEMENT):
                self.text += window[len(shown):]
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text

    def next_chunk(self) -> dict:
        """{"delta": new text, "delta_ids": new ids, "finished": bool}; may be empty."""
        req = self.req
        if req.finished:
            text = self._decode(req.output_ids) if self.tokenizer is not None else ""
            safe = len(trim_stop_string(text, req))
        else:
            text = self._advance()
            safe = len(text) - self.hold
        delta = text[self.sent_chars:max(safe, self.sent_chars)]
        self.sent_chars += len(delta)
        ids = list(req.output_ids[self.sent_ids:])
        self.sent_ids += len(ids)
        return {"delta": delta, "delta_ids": ids, "finished": req.finished}
