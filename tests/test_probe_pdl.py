"""benchmarks/probe_pdl.py: reading its results files back and plotting them (no GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_pdl  # noqa: E402

RESULTS = """# NVIDIA H200, triton 3.6.0, 30 layers, 120 calls a chain
 8 library          3.42 us a call  bits of the first: True
 8 lib-pdl          2.46 us a call  bits of the first: True
 8 lib-pdl          2.48 us a call  bits of the first: True
 8 w64            failed: OutOfResources: out of resource: shared memory
128 cublas          4.75 us a call  bits of the first: True
"""


def test_results_are_read_back_by_rows_and_variant_without_failed_lines(tmp_path):
    path = tmp_path / "probe.txt"
    path.write_text(RESULTS)
    assert probe_pdl.read_results(str(path)) == {
        (8, "library"): [3.42], (8, "lib-pdl"): [2.46, 2.48], (128, "cublas"): [4.75]}


def test_a_plot_takes_each_series_median_from_several_files(tmp_path, monkeypatch):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(RESULTS)
    second.write_text(" 2 one              2.37 us a call  bits of the first: True\n")
    drawn = {}
    monkeypatch.setattr(probe_pdl.common, "line_plot",
                        lambda panels, path, title: drawn.update(panels[0]["series"]))
    probe_pdl.plot(str(tmp_path / "out.png"), [f"kernel={first}:lib-pdl+{second}:one",
                                               f"cuBLAS={first}:cublas"])
    assert drawn == {"kernel": [(8, pytest.approx(2.47)), (2, 2.37)], "cuBLAS": [(128, 4.75)]}


def test_the_roped_qkv_is_the_norm_the_matmul_and_the_rotary_of_the_model():
    """The probe's roped qkv (the launch the model runs from 2 rows) against the model's twin:
    the norm, the matmul, the rotary at each row's position, k and v at each row's slot."""
    import torch

    from kernels.gemv import normed_qkv_rope_torch

    torch.manual_seed(0)
    rows, hidden, qkv = 3, probe_pdl.HIDDEN, probe_pdl.QKV
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    w = torch.randn(qkv, hidden) * hidden ** -0.5
    bufs = {"qkv": torch.empty(rows, qkv), "res": residual, "res2": torch.empty(rows, hidden),
            "nw": torch.rand(hidden) + 0.5, "rope": probe_pdl.rope_buffers(rows, "cpu")}
    twin_rope = tuple(t.clone() if torch.is_tensor(t) else t for t in bufs["rope"])
    probe_pdl.roped_qkv(x, w, bufs, norms=True)
    want, want_res = normed_qkv_rope_torch(x, residual, bufs["nw"], 1e-5, w, None, twin_rope)
    torch.testing.assert_close(bufs["qkv"], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bufs["res2"], want_res)
    slots = bufs["rope"][2]
    for mine, twin in zip(bufs["rope"][3:5], twin_rope[3:5]):  # k and v at the rows' slots
        torch.testing.assert_close(mine[slots].float(), twin[slots].float(), rtol=1e-2,
                                   atol=1e-2)
        assert mine[slots].abs().sum() > 0
