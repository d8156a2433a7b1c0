"""The engine's start-up order of graph captures (CPU, runners stood in for): a speculative
engine captures its target's decode graphs once more after its speculative step graphs, since a
decode graph captured before them replayed slower on an H200 (docs/PERFORMANCE.md)."""

from types import SimpleNamespace

import pytest

from specpcg.engine import Engine


def _engine(events: list, step_graphs, with_decode: bool = True):
    """A stand-in engine: step_graphs None (no overlapped steps), {} (not captured: no CUDA
    graphs) or a dict of captured graphs."""
    decode = (SimpleNamespace(capture=lambda: events.append("decode graphs"))
              if with_decode else None)
    steps = None if step_graphs is None else SimpleNamespace(graphs=step_graphs)

    def spec_step_graphs():
        events.append("step graphs")
        return steps

    return SimpleNamespace(graphs=SimpleNamespace(decode=decode),
                           _spec_step_graphs=spec_step_graphs), steps


def test_decode_graphs_are_captured_again_after_captured_step_graphs():
    events = []
    fake, steps = _engine(events, {(16, 4): "graph"})
    assert Engine._spec_step_graphs_then_decode(fake) is steps
    assert events == ["step graphs", "decode graphs"]


@pytest.mark.parametrize("step_graphs, with_decode", [(None, True), ({}, True),
                                                      ({(1, 2): "graph"}, False)])
def test_nothing_is_captured_again_without_step_graphs_or_decode_graphs(step_graphs, with_decode):
    events = []
    fake, steps = _engine(events, step_graphs, with_decode)
    assert Engine._spec_step_graphs_then_decode(fake) is steps
    assert events == ["step graphs"]
