"""The routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /generate, /metrics.

Forwards never run on the event loop: requests go to the engine's background thread
(Engine.async_generate) and come back as chunks; tokenizing runs in a worker thread. A client
that disconnects mid-stream stops reading its chunks, which aborts its request and frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specpcg.serve import openai_format as fmt
from specpcg.serve.metrics import ServerMetrics
from specpcg.serve.protocol import (ApiError, ChatRequest, CompletionRequest, GenerateRequest,
                                    param_of, sampling_params)

MAX_BODY_BYTES = 4 << 20


def create_app(engine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="specpcg")
    app.state.engine, app.state.model_name = engine, model_name
    app.state.metrics = ServerMetrics(engine)
    _errors(app, max_body_bytes)
    _routes(app)
    return app


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _errors(app: FastAPI, max_body_bytes: int) -> None:
    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return _error(ApiError(413, f"request body of {size} bytes is over the "
                                        f"{max_body_bytes}-byte limit"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return _error(exc)

    @app.exception_handler(ValueError)
    async def value_error(_, exc: ValueError):
        return _error(ApiError(400, str(exc), param_of(str(exc))))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        field = ".".join(loc) or None
        return _error(ApiError(400, f"{field or 'body'}: {first.get('msg', 'invalid')} "
                                    f"(got {first.get('input')!r})", field))

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail), kind="not_found_error"
                               if exc.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        return _error(ApiError(500, f"{type(exc).__name__}: {exc}", kind="internal_error"))


def _check_model(app: FastAPI, model: str) -> None:
    if model not in (app.state.model_name, app.state.engine.config.model_path):
        raise ApiError(404, f"model {model!r} does not exist (this server serves "
                            f"{app.state.model_name!r})", "model", kind="not_found_error")


async def _encode(engine, prompt=None, messages=None) -> list:
    tok = engine.tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer: send token ids", "prompt")
    if messages is not None:
        if not messages:
            raise ApiError(400, "messages is empty", "messages")
        return await asyncio.to_thread(tok.apply_chat_template, messages)
    return await asyncio.to_thread(tok.encode, prompt)


def _completion_ids(body: CompletionRequest):
    p = body.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return None, p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p, None
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt: n=1, "
                        "no batches)", "prompt")


async def _run(app: FastAPI, ids: list, params: dict, logprobs: bool):
    """The request's chunks (engine validation errors raise here, before any work)."""
    return await app.state.engine.async_generate(input_ids=ids, sampling_params=params,
                                                 return_logprob=logprobs, stream=True)


async def _collect(app: FastAPI, chunks) -> dict:
    last = None
    async for chunk in chunks:
        last = chunk
    meta = last["meta_info"]
    reason = meta.get("finish_reason") or {}
    app.state.metrics.finished(meta, reason.get("type"))
    if reason.get("type") == "error":
        raise ApiError(500, f"the forward carrying this request failed: {reason['message']}",
                       kind="internal_error")
    return last


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(app: FastAPI, chunks, make_chunk, usage_chunk):
    """SSE lines: each chunk, the usage (when asked), then [DONE]. The response's
    cancellation (a client that left) closes `chunks`, which aborts the request."""
    metrics, last_t = app.state.metrics, time.perf_counter()
    try:
        async for chunk in chunks:
            now = time.perf_counter()
            if chunk["delta_ids"] and chunk["meta_info"].get("finish_reason") is None:
                metrics.itl.observe((now - last_t) / len(chunk["delta_ids"]))
            last_t = now
            reason = chunk["meta_info"].get("finish_reason")
            if reason is not None:
                metrics.finished(chunk["meta_info"], reason.get("type"))
                if reason.get("type") == "error":
                    yield _sse(ApiError(500, reason["message"], kind="internal_error").body())
                    break
            yield _sse(make_chunk(chunk))
            if reason is not None and usage_chunk is not None:
                yield _sse(usage_chunk(chunk))
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()


async def _respond(app: FastAPI, chunks, view, stream: bool, usage_chunk):
    """The request's chunks as server-sent events, or its whole response."""
    if stream:
        return StreamingResponse(_stream(app, chunks, view.chunk, usage_chunk),
                                 media_type="text/event-stream")
    return view.response(await _collect(app, chunks))


def _routes(app: FastAPI) -> None:
    engine = app.state.engine

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": app.state.model_name, "object": "model",
                                            "created": 0, "owned_by": "specpcg"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/get_server_info")
    async def server_info():
        return JSONResponse(json.loads(json.dumps(engine.get_server_info(), default=str)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        _check_model(app, body.model)
        ids, text = _completion_ids(body)
        ids = ids if ids is not None else await _encode(engine, prompt=text)
        params = sampling_params(body, body.max_tokens, len(ids), engine.context_len)
        chunks = await _run(app, ids, params, body.logprobs is not None)
        view = fmt.CompletionView(app.state.model_name, engine.tokenizer, body)
        return await _respond(app, chunks, view, body.stream, view.usage_chunk())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        _check_model(app, body.model)
        ids = await _encode(engine, messages=[m.model_dump() for m in body.messages])
        limit = body.max_completion_tokens or body.max_tokens
        params = sampling_params(body, limit, len(ids), engine.context_len)
        chunks = await _run(app, ids, params, body.logprobs)
        view = fmt.ChatView(app.state.model_name, engine.tokenizer, body)
        return await _respond(app, chunks, view, body.stream, view.usage_chunk())

    @app.post("/generate")
    async def generate(body: GenerateRequest):
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "text")
        ids = body.input_ids if body.input_ids is not None else await _encode(
            engine, prompt=body.text)
        chunks = await engine.async_generate(input_ids=ids, sampling_params=body.sampling_params,
                                             return_logprob=body.return_logprob, stream=True)
        return await _respond(app, chunks, fmt.NativeView(body), body.stream, None)
