"""The engine's start-up order of graph captures (CPU, runners stood in for): a speculative
engine captures its target's decode graphs once more after its speculative step graphs, since a
decode graph captured before them replayed slower on an H200 (docs/PERFORMANCE.md)."""

from types import SimpleNamespace

import pytest

from specpcg.graphs.setup import capture_steps_then_decode


def _runners(events: list, step_graphs, with_decode: bool = True):
    """Stand-ins: step graphs whose capture makes `step_graphs` ({}: none made, as without CUDA
    graphs), and the target's decode graphs (or None)."""
    decode = (SimpleNamespace(capture=lambda: events.append("decode graphs"))
              if with_decode else None)
    steps = SimpleNamespace(graphs={})

    def capture():
        events.append("step graphs")
        steps.graphs = step_graphs

    steps.capture = capture
    return steps, decode


def test_decode_graphs_are_captured_again_after_captured_step_graphs():
    events = []
    steps, decode = _runners(events, {(16, 4): "graph"})
    assert capture_steps_then_decode(steps, decode, True) is steps
    assert events == ["step graphs", "decode graphs"]


def test_no_step_graphs_made_captures_nothing_again():
    events = []
    steps, decode = _runners(events, {})
    assert capture_steps_then_decode(steps, decode, True) is steps
    assert events == ["step graphs"]


@pytest.mark.parametrize("captures, with_decode", [(False, True), (True, False)])
def test_nothing_is_captured_without_round_graphs_or_decode_graphs(captures, with_decode):
    events = []
    steps, decode = _runners(events, {(1, 2): "graph"}, with_decode)
    assert capture_steps_then_decode(steps, decode, captures) is steps
    assert events == []
