"""benchmarks/probe_first_look.py: its op-by-op split of the hidden ring's first read returns
what HiddenRing.read returns, so the probe times the read the engine runs."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_first_look  # noqa: E402

from specpcg.hidden_ring import HiddenRing  # noqa: E402


def test_the_split_first_read_returns_the_rings_read(monkeypatch):
    torch.manual_seed(0)
    ring = HiddenRing(rows=4, width=3, dtype=torch.float32, device="cpu", depth=8)
    ring.buf.copy_(torch.randn_like(ring.buf))
    expected = ring.read([2, 1], [6, 3], 5)  # row 2's stretch wraps past the ring's end
    monkeypatch.setattr(HiddenRing, "read", HiddenRing.read)  # put back after the test
    log = []
    probe_first_look.split_first_read(log)
    assert torch.equal(ring.read([2, 1], [6, 3], 5), expected)
    assert [name for name, _ in log] == ["read:to_device", "read:arange", "read:index",
                                         "read:index_select"]
    assert torch.equal(ring.read([2, 1], [6, 3], 5), expected) and len(log) == 4  # later: as is
