"""A captured GEMM's cuBLAS workspace after torch drops its cached ones (cuda only): our
graphs allocate theirs in the pool (specpcg/graphs/breakable.py, own_cublas_workspace)."""

import pytest
import torch
import torch.nn.functional as F

from specpcg.graphs import breakable
from specpcg.graphs.breakable import capture_stream

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_graphs_keep_their_cublas_workspace_when_torch_drops_its_own():
    """torch.compile's CUDA graphs drop torch's cached cuBLAS workspaces around each recording.
    A graph whose GEMMs kept the warm-up's workspace then writes memory the allocator hands out
    again, or faults once torch.cuda.graph's empty_cache has returned it to the device. Ours
    allocate theirs in the pool: blocks freed after the drop and filled with a sentinel keep it
    through replays."""
    torch.manual_seed(0)
    # The 8B shape's prefill GEMMs at 256 rows, the shapes whose graph faulted.
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for k, n in shapes]
    xs = [torch.randn(256, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes]
    graph, outs = breakable.warm_and_capture(  # as the model's linear layers call them
        lambda: [F.linear(x, w) for x, w in zip(xs, weights)], torch.cuda.graph_pool_handle())
    torch._C._cuda_clearCublasWorkspaces()
    with torch.cuda.stream(capture_stream()):  # where the warm-up's workspace was cached
        fills = [torch.full((mib << 20,), 77, dtype=torch.uint8, device="cuda")
                 for mib in (32, 32, 8, 4, 4, 1, 1)]
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(bool((f == 77).all()) for f in fills)
    for out, x, w in zip(outs, xs, weights):
        torch.testing.assert_close(out, F.linear(x, w))  # eager may pick another kernel
