"""The few-row kernel's tiles and launches (kernels/gemv_triton.py): K split over programs,
programs of 16 rows, the fitted tiling, one-step tiles and the row limit.

On CPU the kernel runs in the Triton interpreter (test_gemv sets it up); split launches in
graphs are checked on CUDA.
"""

import pytest
import torch
from test_gemv import _close_fp32, needs_interpreter  # sets TRITON_INTERPRET first on CPU

from kernels import gemv


@needs_interpreter
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("silu", [False, True])
def test_a_split_launch_matches_its_twin_and_leaves_the_counters_zero(monkeypatch, splits, silu):
    """K split over programs (the last to arrive adds the splits in order): the twin's
    result with or without bias or SiLU-and-mul, a split past K left empty (100 deep in
    64-deep steps over 5 splits), and every arrival counter back at 0 for the next launch."""
    from kernels import gemv_triton

    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (16, 64, 4, 3, splits))
    for rows, (n, k) in ((3, (40, 100)), (8, (37, 300))):
        x, w, b = torch.randn(rows, k), torch.randn(2 * n, k) / k ** 0.5, torch.randn(2 * n)
        if silu:
            _close_fp32(gemv.linear_silu_mul(x, w, use_triton=True),
                        gemv.linear_silu_mul_torch(x, w))
        else:
            _close_fp32(gemv.linear(x, w, b, use_triton=True), gemv.linear_torch(x, w, b))
        assert not gemv_triton.arrival_counters(x.device).any()


@needs_interpreter
def test_a_split_launch_keeps_a_rows_bits_in_a_shard_and_among_other_rows(monkeypatch):
    """The splits follow K, BLOCK_K and SPLITS alone: a column shard (tensor parallelism), a
    wider tile and the rows beside a row leave its bits; the sum order of the splits is fixed
    (the same bits every launch)."""
    from kernels import gemv_triton

    x, w = torch.randn(7, 1500), torch.randn(80, 1500)
    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (16, 256, 4, 3, 3))
    every = gemv.linear(x, w, use_triton=True)
    assert torch.equal(gemv.linear(x, w, use_triton=True), every)
    assert torch.equal(gemv.linear(x, w[17:], use_triton=True), every[:, 17:])
    assert torch.equal(gemv.linear(x[2:4], w, use_triton=True), every[2:4])
    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (32, 256, 4, 3, 3))
    assert torch.equal(gemv.linear(x, w, use_triton=True), every)


@needs_interpreter
@pytest.mark.parametrize("tile", [(16, 64, 4, 1, 3), (32, 128, 4, 1, 1), None])
def test_rows_past_16_run_in_blocks_of_16_with_each_rows_bits(tile):
    """Past 16 rows a launch has a program per 16 rows (and tile, and split): the twin's
    result, and each row the bits it has in a call of its own 16-row block, split or not."""
    from kernels import gemv_triton

    x, w = torch.randn(40, 150), torch.randn(2 * 24, 150) / 150 ** 0.5
    for silu in (False, True):
        n = 24 if silu else 48
        out = gemv_triton.gemv(x, w, None, torch.empty(40, n), silu, tile)
        want = gemv.linear_silu_mul_torch(x, w) if silu else gemv.linear_torch(x, w)
        _close_fp32(out, want)
        for lo in (0, 16, 32):
            rows = x[lo:lo + 16]
            alone = gemv_triton.gemv(rows, w, None, torch.empty(len(rows), n), silu, tile)
            assert torch.equal(out[lo:lo + 16], alone)
    assert not gemv_triton.arrival_counters(x.device).any()


def test_the_row_limit_is_8_unless_set_and_a_bad_setting_is_named(monkeypatch):
    monkeypatch.delenv("SPECPCG_GEMV_MAX_ROWS", raising=False)
    assert gemv._max_rows() == 8
    monkeypatch.setenv("SPECPCG_GEMV_MAX_ROWS", "32")
    assert gemv._max_rows() == 32
    for bad in ("33", "0", "x"):
        monkeypatch.setenv("SPECPCG_GEMV_MAX_ROWS", bad)
        with pytest.raises(ValueError, match=f"SPECPCG_GEMV_MAX_ROWS='{bad}'"):
            gemv._max_rows()


def test_the_fitted_tiling_and_where_cublas_stays():
    from kernels import gemv_triton

    assert gemv_triton.tiling(49152, 576) is None  # the default model's tied LM head
    assert gemv_triton.tiling(49152, 576, 8) is None
    assert gemv_triton.tiling(128256, 4096) == (2, 1024, 4, 4, 1)
    assert gemv_triton.tiling(4096, 14336) == (1, 1024, 4, 4, 1)
    assert gemv_triton.tiling(4096, 14336, gemv.MAX_ROWS + 1) is None
    if gemv.MAX_ROWS >= 17:  # SPECPCG_GEMV_MAX_ROWS
        assert gemv_triton.tiling(960, 576, 17) == gemv_triton.tiling(960, 576, 2)
        assert gemv_triton.tiling(4096, 4096, 17) is None  # deep weights past 16: cuBLAS
    # 2-8 rows: wide tiles on large weights, narrow on small; by K alone
    assert gemv_triton.tiling(4096, 4096, 8) == (64, 256, 4, 4, 1)
    assert gemv_triton.tiling(2048, 4096, 2) == (64, 256, 4, 4, 1)  # a tensor-parallel shard
    # shallow weights in one step, whose weights PDL reads before the wait
    assert gemv_triton.tiling(960, 576, 2) == (32, 1024, 4, 1, 1)
    assert gemv_triton.tiling(64, 40, 8) == (32, 64, 4, 1, 1)
    # deep weights split K over programs: too few tiles of outputs to fill the GPU
    assert gemv_triton.tiling(4096, 14336, 8) == (32, 256, 4, 3, 3)
    assert gemv_triton.tiling(2048, 14336, 8) == (32, 256, 4, 3, 3)
    assert gemv_triton.tiling(576, 1536, 8) == (32, 256, 4, 1, 6)  # 6 one-step splits
    assert gemv_triton.tiling(1024, 3072, 8) == (32, 256, 4, 3, 6)  # two steps a split


def test_one_step_tiles_need_pdl_and_the_shared_memory(monkeypatch):
    """Without PDL, or where a 1,024-deep step of gate and up (about 150 KB of shared memory)
    does not fit, shallow weights take 128-deep steps and 1,536-deep splits two steps."""
    from types import SimpleNamespace

    from kernels import gemv_triton

    assert gemv_triton.tiling(960, 576, 8, one_step=False) == (32, 128, 4, 4, 1)
    assert gemv_triton.tiling(576, 1536, 8, one_step=False) == (32, 128, 4, 3, 6)
    assert not gemv_triton.one_step_fits(torch.zeros(2, 8))  # no PDL on a CPU tensor
    x = SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True)
    monkeypatch.setattr(gemv_triton, "pdl", lambda t: {"PDL": True})
    for optin, fits in ((232448, True), (101376, False)):
        gemv_triton._shared_memory.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, o=optin:
                            SimpleNamespace(shared_memory_per_block_optin=o))
        assert gemv_triton.one_step_fits(x) is fits
        monkeypatch.setattr(torch.cuda, "get_device_properties", None)  # asked once
        assert gemv_triton.one_step_fits(x) is fits
    monkeypatch.setattr(gemv_triton, "pdl", lambda t: {"PDL": False})
    assert not gemv_triton.one_step_fits(x)
    gemv_triton._shared_memory.cache_clear()  # not the patched device's answer for later tests


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [2, 4, 6])
def test_cuda_split_launches_equal_the_unsplit_sum_in_graphs_too(monkeypatch, splits):
    """K split over programs on the GPU: close to the unsplit kernel, the same bits on every
    launch (200 back to back, eager and replayed from a graph: the last program of a tile
    always sees the others' sums) and the arrival counters zero afterwards."""
    from kernels import gemv_triton

    x = torch.randn(gemv.MAX_ROWS, 1536, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * 576, 1536, device="cuda") * 0.02).to(torch.bfloat16)
    whole = gemv.linear_silu_mul(x, w, use_triton=True)
    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (16, 128, 4, 3, splits))
    first = gemv.linear_silu_mul(x, w, use_triton=True)
    torch.testing.assert_close(first.float(), whole.float(), atol=2e-2, rtol=1.6e-2)
    outs = [gemv.linear_silu_mul(x, w, use_triton=True) for _ in range(200)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = [gemv.linear_silu_mul(x, w, use_triton=True) for _ in range(50)]
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs + replayed)
    assert not gemv_triton.arrival_counters(x.device).any()


@needs_interpreter
def test_the_arrival_counters_are_never_first_made_inside_a_capture(monkeypatch):
    """Made inside a CUDA graph capture, the counters would live in the graph's pool, zeroed
    only when that graph replays: asking for them first there is an error naming the call that
    makes them beforehand; once made, a capture gets the same tensor."""
    from kernels import gemv_triton

    monkeypatch.setattr(gemv_triton, "_arrived", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"cuda:0.*prepare_capture\(device\)"):
        gemv_triton.arrival_counters(torch.device("cuda", 0))
    assert gemv_triton._arrived == {}
    assert gemv_triton.made_arrival_counters(torch.device("cuda", 0)) is None
    made = torch.zeros(gemv_triton.MAX_TILES, dtype=torch.int32)
    gemv_triton._arrived[("cuda", 0)] = made  # as prepare_capture leaves it, eagerly
    assert gemv_triton.arrival_counters(torch.device("cuda", 0)) is made


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prepare_capture_makes_zeroed_counters_a_capture_then_uses():
    from kernels import gemv_triton

    gemv.prepare_capture(torch.device("cuda"))  # an engine's bare device: the tensors' index
    device = torch.device("cuda", torch.cuda.current_device())
    counters = gemv_triton.made_arrival_counters(device)
    assert counters is not None and not counters.any()
    x = torch.randn(8, 1536, dtype=torch.bfloat16, device=device)
    w = torch.randn(576, 1536, dtype=torch.bfloat16, device=device)
    gemv.linear(x, w, use_triton=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w, use_triton=True)
    graph.replay()
    torch.cuda.synchronize()
    assert gemv_triton.arrival_counters(device) is counters and not counters.any()
    torch.testing.assert_close(out.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-1)
