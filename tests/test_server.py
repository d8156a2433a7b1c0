"""The HTTP server on CPU: started on 127.0.0.1 on a free port, driven by the official `openai`
client (chat and completion, streamed and not, 32 concurrent streams), disconnects, bad
requests, /metrics and a failed forward. The engine speculates with NGRAM (lossless), so the
speculative metrics move too."""

import asyncio
import socket
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specpcg import Engine  # noqa: E402
from specpcg.serve.app import create_app  # noqa: E402
from tests.cores import cores_per_worker  # noqa: E402

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "Once upon a time",
           "The best way to learn is", "Python is a", "The sun rises in the", "My favourite food"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(min(2, cores_per_worker()))
    # Every step speculative: the spec metrics and details below must see verifies (adaptive
    # speculation prefers plain steps for this model on a CPU).
    engine = Engine(device="cpu", max_total_tokens=8192, max_running_requests=40,
                    speculative_algorithm="NGRAM", show_progress=False,
                    disable_adaptive_speculation=True)
    port = _free_port()
    app = create_app(engine, MODEL)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    base = f"http://127.0.0.1:{port}"
    yield engine, base
    srv.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def _stream_text(stream) -> tuple:
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            parts.append((delta.content or "") if delta is not None else choice.text)
            reasons.append(choice.finish_reason)
    return "".join(parts), [r for r in reasons if r]


def test_completions_streamed_and_not_agree(server):
    _, base = server
    c = _client(base)
    full = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    text, reasons = _stream_text(c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
    assert text == full.choices[0].text and text and reasons == ["length"]


def test_chat_streamed_and_not_agree_and_report_usage(server):
    _, base = server
    c = _client(base)
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_logprobs_and_spec_details(server):
    _, base = server
    r = httpx.post(base + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 1,
        "return_spec_tokens_details": True}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 6 and all(x <= 0 for x in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    d = r["spec_tokens_details"]
    assert d["verify_ct"] >= 1 and sum(d["accept_histogram"]) == d["verify_ct"]
    assert d["accept_length"] == pytest.approx(6 / d["verify_ct"])


def test_32_concurrent_streams_get_their_solo_tokens(server):
    _, base = server
    c = _client(base)
    solo = {p: c.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
            .choices[0].text for p in PROMPTS}

    async def one(client, p):
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=10,
                                                 temperature=0, stream=True)
        return p, "".join([ch.choices[0].text async for ch in stream])

    async def run():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*[one(client, PROMPTS[i % 8]) for i in range(32)])

    results = asyncio.run(run())
    assert len(results) == 32 and all(text == solo[p] for p, text in results)


def _wait_all_free(engine, seconds=20.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if engine.kv_cache.free_slots == engine.kv_cache.total_slots:
            return True
        time.sleep(0.05)
    return False


def test_a_client_leaving_mid_stream_frees_its_slots(server):
    engine, base = server
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0,
            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]  # a few chunks, then hang up
    assert any(line.startswith("data: ") for line in got)
    assert _wait_all_free(engine)
    assert not engine.scheduler.running and not engine.scheduler.waiting


BAD = [
    ({"prompt": "hi", "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "max_tokens": 4, "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10 ** 9}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 4, "n": 2}, "n"),
    ({"prompt": [[1, 2], [3, 4]], "max_tokens": 4}, "prompt"),
    ({"prompt": [10 ** 7], "max_tokens": 4}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 4, "seed": "x"}, "seed"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_get_a_400_naming_the_field(server, body, param):
    _, base = server
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or err["message"])


def test_unknown_models_oversized_bodies_and_broken_json(server):
    engine, base = server
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    big = {"model": MODEL, "prompt": "x" * (5 << 20), "max_tokens": 1}
    assert httpx.post(base + "/v1/completions", json=big, timeout=30).status_code == 413
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert _wait_all_free(engine)
    ok = _client(base).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_models_generate_and_metrics(server):
    engine, base = server
    assert [m.id for m in _client(base).models.list().data] == [MODEL]
    before = _metric(base, "specpcg:spec_verify_calls")
    r = httpx.post(base + "/generate", json={"text": PROMPTS[2], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}}, timeout=60).json()
    assert r["meta_info"]["completion_tokens"] == 8 and r["meta_info"]["spec_verify_ct"] >= 1
    after = _metric(base, "specpcg:spec_verify_calls")
    assert after >= before + r["meta_info"]["spec_verify_ct"]
    assert _metric(base, "specpcg:spec_accept_length") >= 1.0
    assert _metric(base, "specpcg:num_requests") > 0


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (name, name + "_total"):
                total += s.value
    return total


def test_a_failed_forward_fails_only_its_own_request(server, monkeypatch):
    engine, base = server
    marker = engine.tokenizer.encode(" zebra-quux")[-1]
    real = engine.router.forward

    def forward(batch, *a, **kw):
        if (batch.input_ids == marker).any():
            raise RuntimeError("injected fault")
        return real(batch, *a, **kw)

    c = _client(base)
    expected = [c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
                .choices[0].text for p in PROMPTS[:3]]
    monkeypatch.setattr(engine.router, "forward", forward)
    streams = [c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                    stream=True) for p in PROMPTS[:3]]
    firsts = [next(iter(s)).choices[0].text for s in streams]  # all three are decoding now
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        c.completions.create(model=MODEL, prompt="Say zebra-quux", max_tokens=8)
    texts = [f + "".join(ch.choices[0].text for ch in s) for f, s in zip(firsts, streams)]
    assert texts == expected
    assert _wait_all_free(engine)
    monkeypatch.undo()
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_the_serve_command_starts_answers_and_stops():
    """`python -m specpcg serve` as a user runs it, in its own process."""
    import subprocess
    import sys

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specpcg", "serve", "--port", str(port),
                             "--device", "cpu", "--max-total-tokens", "4096",
                             "--served-model-name", "smol", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        reply = openai.OpenAI(base_url=base + "/v1", api_key="none").chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(timeout=30)
