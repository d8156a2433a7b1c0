"""specpcg/graphs/setup.py's order on CPU, with the runners and the pool stood in for: the
kernels' process-wide state is made before the first capture, and only when one is made."""

from types import SimpleNamespace

import pytest
import torch

from specpcg.graphs import setup
from specpcg.graphs.policy import GraphDecision


class _Runner:
    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def __call__(self, *args, **kwargs):
        return self

    def capture(self) -> None:
        self.events.append(f"{self.name} capture")

    def info(self) -> dict:
        return {}


@pytest.mark.parametrize("piecewise, decode", [(True, True), (False, True), (True, False),
                                               (False, False)])
def test_the_gemv_counters_are_prepared_before_any_capture(monkeypatch, piecewise, decode):
    import specpcg.graphs.decode_runner as decode_runner
    import specpcg.graphs.piecewise_runner as piecewise_runner

    events = []
    monkeypatch.setattr(setup, "decide_piecewise",
                        lambda cfg, device_type: GraphDecision(piecewise, "test"))
    monkeypatch.setattr(setup, "decide_decode_graph",
                        lambda *a, **k: GraphDecision(decode, "test"))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(setup.gemv, "prepare_capture",
                        lambda device: events.append(f"prepare {device}"))
    monkeypatch.setattr(piecewise_runner, "PiecewiseRunner", _Runner("piecewise", events))
    monkeypatch.setattr(decode_runner, "DecodeGraphRunner", _Runner("decode", events))
    cfg = SimpleNamespace(piecewise_cuda_graph_max_tokens=64, cuda_graph_max_bs=4,
                          max_running_requests=4, show_progress=False, pp_size=1)
    attn = SimpleNamespace(name="triton", supports_cuda_graph=True, decode_graph_only=False)
    runner = SimpleNamespace(device=torch.device("cuda"), attn_backend=attn)
    graphs = setup.build_graphs(cfg, runner, context_len=128)
    captures = [name for name, on in (("piecewise", piecewise), ("decode", decode)) if on]
    assert events == (["prepare cuda"] if captures else []) + [f"{c} capture" for c in captures]
    assert (graphs.piecewise is not None, graphs.decode is not None) == (piecewise, decode)
