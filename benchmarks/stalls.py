"""What can stall an engine for tens of milliseconds between two steps, counted around a timed
batch: Python's garbage collections (and the seconds they took), Triton compiles (and theirs),
CUDA graph captures, and the caching allocator's trips to the device (a cudaMalloc, a
cudaFree, or a retry, which frees every cached block after a device-wide sync). A timed round
far below the rounds beside it names its cause in these counts, or rules them out.

    watch = StallWatch(device)
    before = watch.counts()
    ...  # the timed batch
    stalls = watch.since(before)  # only what happened, e.g. {"gc2": 1, "gc_s": 0.21}
"""

from __future__ import annotations

import gc
import time

import torch

ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                  "num_sync_all_streams")


class StallWatch:
    """Counts, from its creation on, what StallWatch's docstring lists. Hooks are process-wide:
    make one per process (a second replaces the first's Triton hooks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.gc_runs = [0, 0, 0]
        self.gc_s = 0.0
        self.compiles: list = []  # {"kernel", "s"} for each Triton compile, in order
        self.captures = 0
        self._gc_started = self._begin = None
        gc.callbacks.append(self._on_gc)
        self._watch_compiles()
        self._watch_captures()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_runs[info["generation"]] += 1
            self.gc_s += time.perf_counter() - self._gc_started
            self._gc_started = None

    def _watch_compiles(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        started = {}

        def before(**kw):
            started[str(kw.get("key"))] = time.perf_counter()
            return False  # compile as usual

        def after(**kw):
            t0 = started.pop(str(kw.get("key")), None)
            self.compiles.append({"kernel": getattr(kw.get("fn"), "name", "?"),
                                  "repr": str(kw.get("repr"))[:400],
                                  "s": None if t0 is None else round(time.perf_counter() - t0, 4)})

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after

    def _watch_captures(self) -> None:
        if self.device.type != "cuda":
            return
        cls, watch = torch.cuda.CUDAGraph, self
        begin = self._begin = cls.capture_begin

        def counted(graph, *args, **kwargs):
            watch.captures += 1
            return begin(graph, *args, **kwargs)

        cls.capture_begin = counted

    def close(self) -> None:
        """Takes the hooks out again (the garbage collector's, Triton's, the graphs')."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._begin is not None:
            torch.cuda.CUDAGraph.capture_begin, self._begin = self._begin, None
        try:
            from triton import knobs
        except ImportError:
            return
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None

    def counts(self) -> dict:
        """Every counter as it stands now."""
        out = {"gc0": self.gc_runs[0], "gc1": self.gc_runs[1], "gc2": self.gc_runs[2],
               "gc_s": self.gc_s, "compiles": len(self.compiles),
               "compile_s": sum(c["s"] or 0.0 for c in self.compiles),
               "captures": self.captures}
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            out.update({k: stats.get(k, 0) for k in ALLOCATOR_KEYS})
        return out

    def since(self, before: dict) -> dict:
        """What changed since `before` (counts()), zeros left out; seconds to 0.1 ms."""
        now, out = self.counts(), {}
        for key, value in now.items():
            change = value - before.get(key, 0)
            if change:
                out[key] = round(change, 4) if isinstance(change, float) else change
        if out.get("compiles"):  # which kernel, and which variant of its arguments
            out["compiled"] = [{"kernel": c["kernel"], "s": c["s"], "repr": c["repr"][:240]}
                               for c in self.compiles[before.get("compiles", 0):]]
        return out
