"""Engine outputs as OpenAI (and SGLang native) responses and stream chunks."""

from __future__ import annotations

import time

from specpcg.serve.protocol import finish_reason, spec_details


def usage(meta: dict) -> dict:
    p, c = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _View:
    object_name = chunk_object = prefix = ""

    def __init__(self, model: str, tokenizer, body):
        self.model, self.tokenizer, self.body = model, tokenizer, body
        self.created = int(time.time())

    def _head(self, meta: dict, obj: str) -> dict:
        return {"id": f"{self.prefix}-{meta['id']}", "object": obj, "created": self.created,
                "model": self.model}

    def _extra(self, meta: dict) -> dict:
        if not self.body.return_spec_tokens_details:
            return {}
        return {"spec_tokens_details": spec_details(meta)}

    def usage_chunk(self):
        opts = self.body.stream_options
        if not (opts and opts.include_usage):
            return None
        return lambda chunk: {**self._head(chunk["meta_info"], self.chunk_object),
                              "choices": [], "usage": usage(chunk["meta_info"]),
                              **self._extra(chunk["meta_info"])}

    def _token_logprobs(self, meta: dict) -> list:
        pairs = meta.get("output_token_logprobs") or []
        return [(self.tokenizer.decode([t], False) if self.tokenizer else str(t), lp)
                for lp, t in pairs]


class CompletionView(_View):
    object_name, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def _logprobs(self, meta: dict):
        if self.body.logprobs is None:
            return None
        toks = self._token_logprobs(meta)
        offsets, at = [], 0
        for t, _ in toks:
            offsets.append(at)
            at += len(t)
        return {"tokens": [t for t, _ in toks], "token_logprobs": [lp for _, lp in toks],
                "top_logprobs": [{t: lp} for t, lp in toks], "text_offset": offsets}

    def response(self, out: dict) -> dict:
        meta = out["meta_info"]
        return {**self._head(meta, self.object_name), "choices": [{
            "index": 0, "text": out["text"], "logprobs": self._logprobs(meta),
            "finish_reason": finish_reason(meta["finish_reason"])}], "usage": usage(meta),
            **self._extra(meta)}

    def chunk(self, chunk: dict) -> dict:
        meta = chunk["meta_info"]
        return {**self._head(meta, self.chunk_object), "choices": [{
            "index": 0, "text": chunk["delta"], "logprobs": None,
            "finish_reason": finish_reason(meta.get("finish_reason"))}]}


class ChatView(_View):
    object_name, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, tokenizer, body):
        super().__init__(model, tokenizer, body)
        self.sent_role = False

    def _logprobs(self, meta: dict):
        if not self.body.logprobs:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": t, "logprob": lp,
                                               "bytes": list(t.encode())}]}
                            for t, lp in self._token_logprobs(meta)]}

    def response(self, out: dict) -> dict:
        meta = out["meta_info"]
        return {**self._head(meta, self.object_name), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": out["text"]},
            "logprobs": self._logprobs(meta),
            "finish_reason": finish_reason(meta["finish_reason"])}], "usage": usage(meta),
            **self._extra(meta)}

    def chunk(self, chunk: dict) -> dict:
        meta = chunk["meta_info"]
        delta = {"content": chunk["delta"]}
        if not self.sent_role:
            delta["role"], self.sent_role = "assistant", True
        return {**self._head(meta, self.chunk_object), "choices": [{
            "index": 0, "delta": delta, "logprobs": None,
            "finish_reason": finish_reason(meta.get("finish_reason"))}]}


class NativeView:
    """SGLang's /generate: the engine's output; streamed chunks carry the text so far."""

    def __init__(self, body):
        self.body, self.text, self.ids = body, "", []

    def _extra(self, meta: dict) -> dict:
        return {"spec_tokens_details": spec_details(meta)} \
            if self.body.return_spec_tokens_details else {}

    def response(self, out: dict) -> dict:
        return {**out, **self._extra(out["meta_info"])}

    def chunk(self, chunk: dict) -> dict:
        self.text += chunk["delta"]
        self.ids += chunk["delta_ids"]
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": chunk["meta_info"],
                **self._extra(chunk["meta_info"])}
