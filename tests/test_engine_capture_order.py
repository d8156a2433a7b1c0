"""The engine's start-up order of graph captures (CPU, runners stood in for): a speculative
engine captures its target's decode graphs once more after its speculative step graphs, since a
decode graph captured before them replayed slower on an H200 (docs/PERFORMANCE.md)."""

from types import SimpleNamespace

import pytest

from specpcg.graphs.setup import decode_after_steps


def _runners(events: list, step_graphs, with_decode: bool = True):
    """Stand-ins: step_graphs None (no overlapped steps), {} (not captured: no CUDA graphs) or a
    dict of captured graphs."""
    decode = (SimpleNamespace(capture=lambda: events.append("decode graphs"))
              if with_decode else None)
    steps = None if step_graphs is None else SimpleNamespace(graphs=step_graphs)
    return steps, decode


def test_decode_graphs_are_captured_again_after_captured_step_graphs():
    events = []
    steps, decode = _runners(events, {(16, 4): "graph"})
    assert decode_after_steps(steps, decode) is steps
    assert events == ["decode graphs"]


@pytest.mark.parametrize("step_graphs, with_decode", [(None, True), ({}, True),
                                                      ({(1, 2): "graph"}, False)])
def test_nothing_is_captured_again_without_step_graphs_or_decode_graphs(step_graphs, with_decode):
    events = []
    steps, decode = _runners(events, step_graphs, with_decode)
    assert decode_after_steps(steps, decode) is steps
    assert events == []
