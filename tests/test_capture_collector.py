"""Graph captures run with Python's garbage collector paused (specpcg/graphs/breakable.py,
`collector_paused`), on CPU with torch's CUDA graph calls stood in for."""

import gc
from contextlib import contextmanager

import pytest
import torch

from specpcg.graphs import breakable
from specpcg.graphs.breakable import BreakableGraph, breakable_capture, eager_break
from tests.test_graphs_breakable import fake_cuda  # noqa: F401


def test_captures_run_with_the_collector_paused(fake_cuda, monkeypatch):
    """A graph freed by the garbage collector mid-capture invalidates the capture: both capture
    paths pause automatic collection inside (no full collection each, which costs ~90 ms a
    capture here) and restore it after, also after an error; a paused collector stays so."""
    monkeypatch.setattr(gc, "collect", lambda *a: fake_cuda.append("collect") or 0)
    seen = []
    with breakable_capture(BreakableGraph(), pool="P"):
        seen.append(gc.isenabled())
        eager_break(lambda x: seen.append(gc.isenabled()) or x)(torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "graph", contextmanager(lambda *a, **k: (yield)))
    monkeypatch.setattr(breakable, "joined_capture_stream", lambda: None)
    breakable.warm_and_capture(lambda: seen.append(gc.isenabled()), pool="P")
    # the warm-up calls run with the collector on, the captured one without
    assert seen == [False, False, True, True, False] and gc.isenabled()
    with pytest.raises(ValueError):
        with breakable_capture(BreakableGraph(), pool="P"):
            raise ValueError("model bug")
    assert gc.isenabled() and "collect" not in fake_cuda
    gc.disable()
    try:
        with breakable.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
