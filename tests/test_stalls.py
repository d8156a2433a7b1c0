"""benchmarks/stalls.py: what a timed batch's counts say happened inside it."""

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from stalls import StallWatch  # noqa: E402


@pytest.fixture
def watch():
    w = StallWatch(torch.device("cpu"))
    yield w
    w.close()


def test_counts_full_collections_and_their_seconds(watch):
    gc.disable()  # only the two collections asked for (they still run, and are counted)
    try:
        before = watch.counts()
        junk = [[i] for i in range(200_000)]  # something for the collection to walk
        gc.collect()
        del junk
        gc.collect()
        got = watch.since(before)
    finally:
        gc.enable()
    assert got["gc2"] == 2
    assert got["gc_s"] > 0


def test_since_leaves_out_what_did_not_change(watch):
    gc.disable()  # no collection of its own may land between the two reads
    try:
        assert watch.since(watch.counts()) == {}
    finally:
        gc.enable()


def test_close_takes_the_collector_hook_out():
    w = StallWatch(torch.device("cpu"))
    w.close()
    before = w.counts()
    gc.collect()
    assert w.since(before) == {}
    assert w._on_gc not in gc.callbacks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_counts_graph_captures_and_device_allocations():
    w = StallWatch(torch.device("cuda"))
    try:
        before = w.counts()
        x = torch.zeros(8, device="cuda")
        big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # a fresh cudaMalloc
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            x.add_(1)
        got = w.since(before)
        del big
        assert got["captures"] == 1
        assert got["num_device_alloc"] >= 1
    finally:
        w.close()
