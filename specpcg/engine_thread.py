"""A background thread that steps an Engine for asyncio callers (Engine.async_generate, the
HTTP server): the event loop only submits, aborts and reads chunks; forwards run here.

Each subscribed request gets an asyncio queue on its caller's loop; after every step the thread
puts the request's new chunk there (Engine.stream_chunk), and its last chunk once it finished,
waking each loop once per step. A reader that fell behind gets its waiting chunks merged into
one, so a loaded server sends fewer, larger events instead of falling further behind.
A caller that stops reading (a client that went away) aborts its request, which frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from specpcg.streaming import TextStream

logger = logging.getLogger("specpcg")
_DONE = object()


class EngineThread:
    def __init__(self, engine):
        self.engine = engine
        self._subs: dict = {}  # rid -> (loop, queue, TextStream)
        self._wake = threading.Condition()
        self._stopped = False
        self._aborts: list = []
        self._thread = threading.Thread(target=self._run, name="specpcg-engine", daemon=True)
        self._thread.start()

    async def submit(self, request: dict):
        """Validates and queues one request (ValueError at once for bad input); returns an
        async iterator of its chunks. The engine lock is taken off the event loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = await asyncio.to_thread(self._submit, request, loop, queue)
        return self._chunks(rid, queue)

    def _submit(self, request: dict, loop, queue) -> int:
        eng = self.engine
        with eng._lock:
            reqs, _ = eng._build(request["prompt"], request["sampling_params"],
                                 request["input_ids"], request["messages"],
                                 request["return_logprob"], request["logprob_start_len"],
                                 request["apply_chat_template"], one=True)
            self._subs[reqs[0].rid] = (loop, queue, TextStream(eng.tokenizer, reqs[0]))
            eng._queue(reqs)
        with self._wake:
            self._wake.notify()
        return reqs[0].rid

    def abort(self, rid: int) -> None:
        """Never blocks: the engine thread aborts `rid` before its next step."""
        with self._wake:
            self._aborts.append(rid)
            self._wake.notify()

    async def _chunks(self, rid: int, queue: asyncio.Queue):
        finished = False
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():  # a reader that fell behind gets one merged chunk
                    items.append(queue.get_nowait())
                chunks = [c for c in items if c is not _DONE]
                if chunks:
                    yield merge_chunks(chunks)
                if items[-1] is _DONE:
                    finished = True
                    return
        finally:
            if not finished:  # the reader went away before the end
                self.abort(rid)

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._wake:
                while not (self._stopped or self._aborts or eng.scheduler.has_work()
                           or self._ready()):
                    self._wake.wait(timeout=0.5)
                if self._stopped:
                    return
                aborts, self._aborts = self._aborts, []
            for rid in aborts:
                eng.abort(rid)
            with eng._lock:
                if eng.scheduler.has_work():
                    eng._step_scheduler()
                updates = self._collect()
            by_loop: dict = {}
            for loop, queue, items in updates:
                by_loop.setdefault(loop, []).append((queue, items))
            for loop, deliveries in by_loop.items():  # one wake-up per loop and step
                loop.call_soon_threadsafe(_deliver, deliveries)

    def _ready(self) -> bool:
        """A subscribed request finished (say, aborted) and waits to be delivered."""
        return any(rid in self.engine._finished for rid in self._subs)

    def _collect(self) -> list:
        """Under the engine lock: each subscriber's new chunk, and its end."""
        eng, out = self.engine, []
        for rid in list(self._subs):
            loop, queue, text = self._subs[rid]
            done = eng._finished.pop(rid, None)
            chunk = eng.stream_chunk(text, done)
            items = ([chunk] if chunk is not None else []) + ([_DONE] if done else [])
            if done is not None:
                del self._subs[rid]
            if items:
                out.append((loop, queue, items))
        return out

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)


def _deliver(deliveries: list) -> None:
    for queue, items in deliveries:
        for item in items:
            queue.put_nowait(item)


def merge_chunks(chunks: list) -> dict:
    """Consecutive stream chunks of one request as one: the deltas joined, the rest (the whole
    output once finished) from the last."""
    if len(chunks) == 1:
        return chunks[0]
    return {**chunks[-1], "delta": "".join(c["delta"] for c in chunks),
            "delta_ids": [t for c in chunks for t in c["delta_ids"]]}
