"""Breakable CUDA graphs: one forward captured as graph segments with eager calls between them.

A function marked `@eager_break` (attention) cannot live inside a graph: it reads per-batch
lengths on the host. Inside `breakable_capture`, calling it ends the segment being captured,
runs the function eagerly once, records a replay closure, and begins the next segment in the same
memory pool. `BreakableGraph.replay()` then runs segment 0, break 0, segment 1, ..., so the dense
work replays from graphs while the break functions run eagerly on the live metadata.

Needs nothing beyond torch (no torch.compile, no cuda-python). Importing this module makes no
CUDA call, so `specpcg.models.llama` (which marks attention) imports on a CPU-only machine.

Usage by a runner (one pool for every bucket, largest bucket first, inputs in static buffers):

    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(capture_stream()):
        model_forward(static_inputs)                     # warm-up: lazy init, autotune
    for n in sorted(buckets, reverse=True):
        graph = BreakableGraph()
        with breakable_capture(graph, pool):
            outputs[n] = model_forward(static_inputs[:n])
    ...
    graph.replay()                                       # outputs[n] now holds the new result

Contract for a break function `fn` (NOTE: a violation gives stale or wrong outputs, not errors):
- Its results must be returned tensors (None, a tensor, or a tuple/list of those): replay calls
  fn again with the SAME argument objects and copies the new result into the tensors returned at
  capture, in place. Or it writes into argument tensors (e.g. a buffer allocated in a segment)
  and returns None.
- Python values it reads from its arguments (ints such as `layer_id`) are frozen at capture;
  values that change between replays must come from tensors or from ambient state it reads
  itself (the forward context).
- Tensors it allocates during capture come from the normal allocator, not the graph pool; the
  closure keeps them (and its arguments) alive for as long as the graph lives.
- It must leave no forked side stream un-joined (ending a segment would fail).
"""

from __future__ import annotations

import contextvars
import functools
import gc
import logging
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


class BreakableGraph:
    """Graph segments with eager break closures between them: break i runs after segment i."""

    def __init__(self):
        self.segments: list = []  # torch.cuda.CUDAGraph, len(breaks) + 1 once captured
        self.breaks: list[Callable[[], None]] = []
        self.break_names: list[str] = []  # the break functions' names, for error messages

    @property
    def captured(self) -> bool:
        return len(self.segments) == len(self.breaks) + 1

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("BreakableGraph has nothing to replay: capture it inside "
                               "breakable_capture() first")
        i, in_break = 0, False
        # Re-raised, never absorbed: the wrapper only adds which step failed. Inference mode:
        # replay records no autograd anyway, and outputs captured under inference_mode (the
        # model runner's forward) accept the in-place copy only inside it.
        try:
            with torch.inference_mode():
                for i, segment in enumerate(self.segments):
                    in_break = False
                    segment.replay()
                    if i < len(self.breaks):
                        in_break = True
                        self.breaks[i]()
        except Exception as exc:
            step = f"break {i} ({self.break_names[i]})" if in_break else f"segment {i}"
            raise RuntimeError(f"breakable graph replay failed in {step} of "
                               f"{len(self.segments)} segments: {exc}") from exc

    def reset(self) -> None:
        """Drops the segments and closures (and the pool blocks and tensors they pin)."""
        self.segments.clear()
        self.breaks.clear()
        self.break_names.clear()


@dataclass
class _CaptureState:
    graph: BreakableGraph
    pool: Any  # a graph_pool_handle(); None until the first segment creates a private pool
    open_segment: Any = None  # the torch.cuda.CUDAGraph being captured; None inside a break
    staging: Any = None  # StagingArena or None
    calls: dict = field(default_factory=dict)  # per_call breaks: times each ran in this capture


_current: contextvars.ContextVar = contextvars.ContextVar("specpcg_breakable_capture", default=None)


def is_capturing() -> bool:
    """True inside `breakable_capture` (also while a break function runs eagerly during it)."""
    return _current.get() is not None


def capture_stream() -> torch.cuda.Stream:
    """The side stream captures run on; warm up on it too.

    It is torch.cuda.graph's own default side stream, created on first use: the caching allocator
    reuses a pool's free blocks only on the stream that allocated them, so every graph meant to
    share one pool (all buckets, and decode graphs captured with torch.cuda.graph) must be
    captured on the same stream.
    """
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


class CaptureCost:
    """What a runner's captures took: wall time and graph memory (its info() reports them)."""

    def __init__(self):
        self.time_s, self.memory_bytes = 0.0, 0

    @contextmanager
    def measure(self, what: str, count: int):
        """Times the captures run inside (synchronized at the end) and logs them."""
        t0, mem0 = time.perf_counter(), torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        self.time_s = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_allocated() - mem0
        logger.info("%s: %d in %.1f s, %.1f MiB", what, count, self.time_s,
                    self.memory_bytes / 2**20)

    def info(self) -> dict:
        return {"capture_time_s": round(self.time_s, 3),
                "capture_memory_mb": round(self.memory_bytes / 2**20, 1)}


def joined_capture_stream() -> torch.cuda.Stream:
    """capture_stream(), made to wait for everything queued so far on the current stream.

    Why: static inputs are written (zero fills, copies) on the current stream; a warm-up or
    capture on the side stream that does not wait for them reads whatever the memory held
    before (seen as out-of-range token ids while other processes kept the GPU busy)."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def own_cublas_workspace() -> None:
    """Drops torch's cached cuBLAS workspaces, so the capture about to begin allocates its own
    from the graph's pool. Call it after the warm-up, right before a capture begins.

    Why: a captured cuBLAS kernel keeps the raw address of the workspace torch caches per
    (handle, stream), which the warm-up allocated outside any pool. Whoever clears those caches
    frees that memory while the graph still writes it: torch.compile's CUDA graphs clear them
    around every recording, and an engine's next piecewise prefill of the 8B shape after a
    compiled module ran faulted with an illegal memory access (one H200, 136acb5). A workspace
    allocated inside the capture lies in the graph's pool, whose blocks torch keeps while any
    graph captured in it lives and lends to no allocation outside a capture into that pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


# Whether a graph replays once right after its capture (probe_first_replay.py turns it off to
# time the lazy upload below).
REPLAY_ON_CAPTURE = True


@contextmanager
def collector_paused():
    """No automatic garbage collection inside (as it was before, after). A CUDA graph the
    collector frees during a capture invalidates it, and every capture after it in the process
    failed: a failed test's traceback held the last test's graphs, and four of their segments
    were reset mid-capture (one H100, d6e54e1). A full collection before each capture prevents
    that too (torch.cuda.graph collects only under torch.compiler.config.force_cudagraph_gc),
    but one took 205-209 ms in a default-model engine's process on an H100's host (464,735
    objects, 0de68cd), before each of an engine's 50 piecewise captures; paused, the garbage
    waits for a collection outside the capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def warm_and_capture(fn: Callable, pool):
    """Runs fn() twice on the joined capture stream (lazy init and Triton compilation stay
    outside the capture), then captures a third call into one graph and replays it once;
    returns (graph, output)."""
    stream = joined_capture_stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    own_cublas_workspace()
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    if REPLAY_ON_CAPTURE:
        # CUDA uploads an instantiated graph to the device at its first launch. Replayed here,
        # on the inputs the capture ran (the same work as the warm-up calls above), that
        # upload is paid at start-up, not by the first serving step that needs this graph:
        # 0.04 ms (median; at most 0.32) for each of an EAGLE3 engine's 52 graphs (one H100,
        # 8e39105, probe_first_replay.py).
        with torch.cuda.stream(stream):
            graph.replay()
        torch.cuda.synchronize()
    return graph, out


def _begin_segment(state: _CaptureState) -> None:
    segment = torch.cuda.CUDAGraph()
    segment.capture_begin(pool=state.pool)
    if state.pool is None:
        state.pool = segment.pool()  # later segments must share the first one's pool
    state.open_segment = segment


def _begin_first_segment(state: _CaptureState) -> None:
    own_cublas_workspace()  # the segments' cuBLAS calls then share one inside the pool
    try:
        _begin_segment(state)
    except RuntimeError as exc:
        raise RuntimeError(
            "could not begin a breakable capture. If every graph captured in this pool is gone "
            "(say, after a failed capture), torch refuses its handle: capture with a new "
            "torch.cuda.graph_pool_handle()") from exc


def _end_segment(state: _CaptureState) -> None:
    segment, state.open_segment = state.open_segment, None
    assert segment is not None, "no segment is being captured"
    with warnings.catch_warnings():
        # Two breaks in a row (or a break first/last) leave an empty segment; replaying it is a
        # harmless no-op, so torch's "empty graph" warning would only be noise here.
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        segment.capture_end()
    state.graph.segments.append(segment)


def _abort(state: _CaptureState) -> None:
    """After an exception inside the capture: end the stream capture, leave the graph empty."""
    if state.open_segment is not None:
        segment, state.open_segment = state.open_segment, None
        try:
            segment.capture_end()
        except RuntimeError:
            pass  # an invalidated capture fails to end; the exception in flight is the cause
    state.graph.reset()


@contextmanager
def breakable_capture(graph: BreakableGraph, pool, stream: torch.cuda.Stream | None = None,
                      staging=None):
    """Captures everything run inside into `graph`, split at every `@eager_break` call.

    pool: a `torch.cuda.graph_pool_handle()` shared by every segment of every bucket (capture the
    largest bucket first so smaller ones reuse its blocks); None gives the graph a private pool.
    stream: the side stream to capture on; default `capture_stream()`.
    staging: a `StagingArena` shared by all buckets: breaks then pin no per-bucket tensors.
    On an exception inside, the capture is ended and `graph` left empty; the exception propagates.
    NOTE: if that graph was the pool's only user, torch refuses the handle afterwards (seen on
    torch 2.11): retry with a new `torch.cuda.graph_pool_handle()`.
    """
    if _current.get() is not None:
        raise RuntimeError("breakable_capture is already active: nested captures are not "
                           "supported; finish the outer capture first")
    if graph.segments or graph.breaks:
        raise RuntimeError("this BreakableGraph is already captured; use a new one or reset() it")
    state = _CaptureState(graph=graph, pool=pool, staging=staging)
    stream = capture_stream() if stream is None else stream
    # Inputs may still be written on the current stream; the side stream must see them finished.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # cached blocks go back to the device: the capture has the most
    token = _current.set(state)
    try:
        with collector_paused(), torch.cuda.stream(stream):
            _begin_first_segment(state)
            try:
                yield graph
            except BaseException:
                _abort(state)  # capture_end must run on the capture stream, so before leaving it
                raise
            _end_segment(state)
    finally:
        _current.reset(token)
        torch.cuda.synchronize()


def eager_break(fn: Callable | None = None, *, writes_out: bool = False,
                per_call: bool = False) -> Callable:
    """Marks `fn` as a graph break point; outside a capture it is a plain call (see module doc).

    writes_out: fn takes `out=` (a tensor like its result) and writes its result there. A replay
    then passes the tensor the next segment reads, so the break costs fn's own work alone: no
    allocation and no copy. Used as `@eager_break(writes_out=True)`.
    per_call: each call of fn in a capture stages into buffers of its own (shared by the
    buckets), for a result the forward may read after fn's next call: an all-reduce's result
    becomes the residual stream, which outlives the layer's next all-reduce. Without it the
    calls of fn share one staged output, and the next call overwrites it."""
    if fn is None:
        return functools.partial(eager_break, writes_out=writes_out, per_call=per_call)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        state = _current.get()
        if state is None or state.open_segment is None:
            # Not capturing, or called from inside another break that is already running eagerly.
            return fn(*args, **kwargs)
        return _capture_break(state, fn, args, kwargs, writes_out, per_call)

    return wrapper


def _capture_break(state: _CaptureState, fn: Callable, args: tuple, kwargs: dict,
                   writes_out: bool = False, per_call: bool = False):
    key = _name(fn)
    if per_call:
        state.calls[key] = state.calls.get(key, 0) + 1
        key = f"{key}#{state.calls[key]}"
    if state.staging is not None:
        args = state.staging.stage_args(key, args)  # the copies join the open segment
    _end_segment(state)
    # Eagerly once, so real outputs exist at fixed addresses for the next segment to read.
    out = fn(*args, **kwargs)
    _check_output(fn, out)
    if state.staging is not None:
        out = state.staging.stage_output(key, out)
    if writes_out:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"eager_break(writes_out=True) function {_name(fn)!r} must return "
                            f"one tensor, got {type(out).__name__}")
        kwargs = {**kwargs, "out": out}
    state.graph.breaks.append(_replay_closure(fn, args, dict(kwargs), out))
    state.graph.break_names.append(_name(fn))
    _begin_segment(state)
    return out


def _replay_closure(fn: Callable, args: tuple, kwargs: dict, captured_out) -> Callable[[], None]:
    # Strong references on purpose: the arguments and outputs stay allocated for the graph's life,
    # so nothing captured later can reuse their memory. The cost is memory per bucket (about
    # layers x (q + k + v + out) bytes per token for attention), traded for no weak-ref tricks.
    def replay() -> None:
        _copy_into(captured_out, fn(*args, **kwargs), fn)

    return replay


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _check_output(fn: Callable, out) -> None:
    if out is None or isinstance(out, torch.Tensor):
        return
    if isinstance(out, (tuple, list)):
        for item in out:
            _check_output(fn, item)
        return
    raise TypeError(f"eager_break function {_name(fn)!r} returned "
                    f"{type(out).__name__} during capture; a break may return only None, tensors, "
                    "or tuples/lists of them (other values would be frozen into the graph)")


def _copy_into(dst, src, fn: Callable) -> None:
    """Copies a replay's result into the tensors returned at capture, which later segments read."""
    if dst is src:
        return  # fn returned its (in-place written) argument again
    if isinstance(dst, torch.Tensor):
        # By element count, not shape: models may return attention output as [T, H, D] or
        # [T, H * D]; what must hold is that the same elements land in the captured buffer.
        if not isinstance(src, torch.Tensor) or src.numel() != dst.numel():
            got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
            raise RuntimeError(f"{_name(fn)} returned {got} on replay but "
                               f"{tuple(dst.shape)} at capture; a break must keep its element count")
        dst.copy_(src.reshape(dst.shape))
    elif isinstance(dst, (tuple, list)):
        if not isinstance(src, (tuple, list)) or len(src) != len(dst):
            raise RuntimeError(f"{_name(fn)} changed the structure of its output on replay")
        for d, s in zip(dst, src):
            _copy_into(d, s, fn)
    elif src is not None:
        raise RuntimeError(f"{_name(fn)} returned None at capture but a value on replay")
