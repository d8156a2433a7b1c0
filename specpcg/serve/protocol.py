"""OpenAI request bodies and what they become for the engine; OpenAI-style errors."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict


class ApiError(Exception):
    """An error the client gets as OpenAI's {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, ...)

    model: str
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Union[str, list, None] = None
    seed: Optional[int] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_spec_tokens_details: bool = False


class CompletionRequest(_Common):
    prompt: Union[str, list]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    logprobs: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


class GenerateRequest(BaseModel):
    """SGLang's native /generate."""

    model_config = ConfigDict(extra="forbid")

    text: Optional[str] = None
    input_ids: Optional[list] = None
    sampling_params: dict = {}
    stream: bool = False
    return_logprob: bool = False
    return_spec_tokens_details: bool = False


def sampling_params(req: _Common, max_tokens: Optional[int], prompt_len_hint: int,
                    context_len: int) -> dict:
    """Engine sampling params; a max_tokens that cannot fit the context is refused (as vLLM
    does), None takes what the context leaves."""
    if req.n != 1:
        raise ApiError(400, f"n={req.n}: only n=1 is supported", "n")
    room = context_len - prompt_len_hint
    if max_tokens is None:
        max_tokens = max(room, 1)
    elif isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}",
                       "max_tokens")
    elif max_tokens > room:
        raise ApiError(400, f"max_tokens={max_tokens} does not fit: the prompt has "
                            f"{prompt_len_hint} tokens and the context length is {context_len}",
                       "max_tokens")
    params = {"max_new_tokens": max_tokens, "temperature": req.temperature,
              "top_p": req.top_p, "seed": req.seed}
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return params


FIELD_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
               "seed": "seed", "stop": "stop", "prompt": "prompt", "input_ids": "prompt",
               "messages": "messages"}


def param_of(message: str) -> Optional[str]:
    """The OpenAI field an engine ValueError names (its first word), if any."""
    first = message.split(" ", 1)[0].split("=", 1)[0]
    return FIELD_NAMES.get(first)


def finish_reason(reason) -> Optional[str]:
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return {"stop": "stop", "length": "length"}.get(kind, kind)


def spec_details(meta: dict) -> Optional[dict]:
    """Per-request speculative figures (SGLang's return_spec_tokens_details)."""
    if "spec_verify_ct" not in meta:
        return None
    return {"accept_length": meta["spec_accept_length"],
            "accept_rate": meta["spec_accept_rate"],
            "verify_ct": meta["spec_verify_ct"],
            "accepted_drafts": meta["spec_accepted_drafts"],
            "accept_histogram": meta["spec_accept_histogram"]}
