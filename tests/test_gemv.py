"""The few-row GEMV kernel (kernels/gemv*.py) against its torch twins, its dispatch rule, and
the model's Linear that uses it.

On CPU the kernel runs in the Triton interpreter in fp32 (the interpreter truncates to bf16);
bf16 and graph capture are checked on CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels import fused_ops, gemv  # noqa: E402
from specpcg.models.layers import GatedMLP, Linear  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
# (N, K): K below, at and past a BLOCK_K, not a multiple of it; N not a multiple of BLOCK_N;
# K past one BLOCK_K of 1,024.
SHAPES = [(37, 100), (96, 576), (130, 1000), (300, 2100)]


def _close_fp32(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_matches_f_linear(n, k, bias, rows):
    x, w = torch.randn(rows, k), torch.randn(n, k) / k ** 0.5
    b = torch.randn(n) if bias else None
    _close_fp32(gemv.linear(x, w, b, use_triton=True), gemv.linear_torch(x, w, b))


@needs_interpreter
@pytest.mark.parametrize("n,k", SHAPES[:3])
@pytest.mark.parametrize("rows", [1, 6])
def test_silu_mul_kernel_matches_twin_and_the_plain_kernel(n, k, rows):
    """The fused epilogue rounds each half's sum first, so it is bitwise the SiLU-and-mul
    kernel over the plain GEMV's output."""
    x, w = torch.randn(rows, k), torch.randn(2 * n, k) / k ** 0.5  # sums of order 1
    fused = gemv.linear_silu_mul(x, w, use_triton=True)
    _close_fp32(fused, gemv.linear_silu_mul_torch(x, w))
    plain = gemv.linear(x, w, use_triton=True)
    assert torch.equal(fused, fused_ops.silu_and_mul(plain, use_triton=True))


@needs_interpreter
@pytest.mark.parametrize("block_n", [2, 4])
def test_the_tile_width_never_changes_a_sum(monkeypatch, block_n):
    """BLOCK_K follows K alone and BLOCK_N (which follows N) leaves each output's sum alone:
    a column shard of a weight (tensor parallelism) gives the whole weight's bits."""
    from kernels import gemv_triton

    x, w = torch.randn(1, 1500), torch.randn(40, 1500)
    one_row = gemv.linear(x, w, use_triton=True)
    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (block_n, 1024, 4, 4, 1))
    assert torch.equal(gemv.linear(x, w, use_triton=True), one_row)
    assert torch.equal(gemv.linear(x, w[17:], use_triton=True), one_row[:, 17:])


@needs_interpreter
@pytest.mark.parametrize("block_n", [16, 64])
def test_the_rows_kernel_tile_width_never_changes_a_sum(monkeypatch, block_n):
    """From 2 rows too: BLOCK_N leaves each output's sum alone (a shard's bits)."""
    from kernels import gemv_triton

    x, w = torch.randn(3, 1500), torch.randn(80, 1500)
    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (32, 256, 4, 4, 1))
    whole = gemv.linear(x, w, use_triton=True)
    monkeypatch.setattr(gemv_triton, "tiling",
                        lambda n, k, rows, one_step=True: (block_n, 256, 4, 4, 1))
    assert torch.equal(gemv.linear(x, w, use_triton=True), whole)
    assert torch.equal(gemv.linear(x, w[17:], use_triton=True), whole[:, 17:])


@needs_interpreter
def test_a_row_keeps_its_bits_among_others():
    """From 2 rows up, a row's sums do not depend on the rows beside it (a verify node's
    against the same node in a wider verify), nor on where the rows sit in memory."""
    x, w = torch.randn(7, 1500), torch.randn(40, 1500)
    every = gemv.linear(x, w, use_triton=True)
    for i in range(6):
        assert torch.equal(gemv.linear(x[i:i + 2], w, use_triton=True), every[i:i + 2]), i
    wide = torch.randn(7, 1600)[:, :1500]
    wide.copy_(x)
    assert torch.equal(gemv.linear(wide, w, use_triton=True), every)
    fused = gemv.linear_silu_mul(x[:5], w, use_triton=True)
    assert torch.equal(fused[3:5], gemv.linear_silu_mul(x[3:5], w, use_triton=True))


def test_only_a_few_rows_on_cuda_outside_autograd_take_the_kernel():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert not gemv.gemv_applies(torch.randn(1, 16, dtype=torch.bfloat16), w)  # CPU
    if torch.cuda.is_available():
        wc = w.cuda()
        for rows in (1, 2, gemv.MAX_ROWS):
            x = torch.randn(rows, 16, dtype=torch.bfloat16, device="cuda")
            assert gemv.gemv_applies(x, wc)
        x = torch.randn(gemv.MAX_ROWS + 1, 16, dtype=torch.bfloat16, device="cuda")
        assert not gemv.gemv_applies(x, wc)
        assert not gemv.gemv_applies(torch.randn(1, 16, device="cuda"), wc.float())
        assert not gemv.gemv_applies(torch.randn(1, 16, dtype=torch.bfloat16, device="cuda"),
                                     wc.clone().requires_grad_())


def test_bad_calls_name_the_shape():
    with pytest.raises(ValueError, match=rf"1 to {gemv.MAX_ROWS} rows of activations, got x of shape "
                       rf"\({gemv.MAX_ROWS + 1}, 16\)"):
        gemv.linear(torch.randn(gemv.MAX_ROWS + 1, 16), torch.randn(8, 16), use_triton=True)
    with pytest.raises(ValueError, match=r"even row count, got \(7, 16\)"):
        gemv.linear_silu_mul(torch.randn(1, 16), torch.randn(7, 16))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_model_linear_and_mlp_equal_the_plain_layers(rows):
    lin = Linear(32, 24, bias=True)
    mlp = GatedMLP(32, 40)
    x = torch.randn(rows, 32)
    with torch.no_grad():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        want = mlp.down_proj(fused_ops.silu_and_mul_torch(mlp.gate_up_proj(x)))
        assert torch.equal(mlp(x), want)


def test_training_through_the_model_linear_keeps_gradients():
    lin = Linear(16, 8)
    lin(torch.randn(1, 16)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


# ---- CUDA: bf16 against cuBLAS, graph replay --------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (49152, 576),
                                 (960, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cuda_kernel_matches_cublas(n, k, dtype, rows):
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w.float())
    got = gemv.linear(x, w, use_triton=True).float()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=1.6e-2)
    gate_up = torch.nn.functional.linear(x, torch.cat([w, w.flip(0)]))
    torch.testing.assert_close(gemv.linear_silu_mul(x, torch.cat([w, w.flip(0)]), True).float(),
                               fused_ops.silu_and_mul(gate_up).float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (1536, 4096), (1024, 14336)])
def test_cuda_a_row_does_not_depend_on_the_rows_beside_it(n, k):
    """Compiled, from 2 rows up (one kernel), a row's bits do not depend on how many rows
    the call has or what they hold."""
    x = torch.randn(gemv.MAX_ROWS, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * n, k, device="cuda") * 0.02).to(torch.bfloat16)
    every, fused = gemv.linear(x, w, use_triton=True), gemv.linear_silu_mul(x, w, use_triton=True)
    for m in range(2, gemv.MAX_ROWS + 1):
        assert torch.equal(gemv.linear(x[:m], w, use_triton=True), every[:m]), m
        assert torch.equal(gemv.linear_silu_mul(x[-m:], w, use_triton=True), fused[-m:]), m


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * 1024, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    eager = gemv.linear_silu_mul(x, w)  # compiles: not in the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear_silu_mul(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, gemv.linear_silu_mul(x, w))
    assert not torch.equal(out, eager)


def test_pdl_is_off_for_cpu_tensors():
    from kernels.dispatch import pdl

    assert pdl(torch.zeros(1)) == {"PDL": False}


@needs_interpreter
@pytest.mark.parametrize("split", [1, 3, 6])
def test_the_pdl_forms_read_the_first_weights_early_and_keep_the_bits(monkeypatch, split):
    """The kernels' PDL forms (the first weights read before the wait, summed first), run in
    the interpreter with the wait and the signal as no-ops: the bits of the plain forms, one
    row and several (K split or not, SiLU-and-mul or not; 6 splits of 1,500 make each
    program's depth one 256-deep step, read whole before the wait), and RMSNorm's."""
    import triton.language as tl

    from kernels import gemv_triton, norm

    x, w = torch.randn(8, 1500), torch.randn(80, 1500) / 40
    tiling = gemv_triton.tiling
    monkeypatch.setattr(gemv_triton, "tiling", lambda n, k, rows, one_step=True: (
        (16, 256, 4, 3, split) if rows > 1 else tiling(n, k, rows)))
    h, gain = torch.randn(3, 96), torch.randn(96)

    def run():
        return [gemv.linear(x[:1], w, use_triton=True), gemv.linear(x, w, use_triton=True),
                gemv.linear_silu_mul(x[:1], w, use_triton=True),
                gemv.linear_silu_mul(x[:5], w, use_triton=True),
                norm.rms_norm_triton(h, gain, 1e-5, torch.empty_like(h))]
    plain = run()
    for module in (gemv_triton, norm):
        monkeypatch.setattr(module, "pdl", lambda t: {"PDL": True})
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda *a, **k: None,
                        raising=False)
    for a, b in zip(run(), plain):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_a_pdl_chain_of_layers_has_the_bits_of_one_without(rows):
    """A decode step's chain (norm, linear layers, a fused add + norm) replayed from a CUDA
    graph with programmatic dependent launch, as on Hopper by default: every replay gives the
    bits of the same graph without it (each kernel waits before it reads what the one before
    wrote; a read too early would show)."""
    from kernels import dispatch, norm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    torch.manual_seed(0)
    layers = [[(torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
               for n, k in ((576, 576), (3072, 576), (576, 1536))] for _ in range(12)]
    gain = torch.ones(576, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)

    def step():
        h, res = torch.empty_like(x), x.clone()
        norm.rms_norm_triton(x, gain, 1e-5, h)
        for o, gate_up, down in layers:
            a = gemv.linear(h, o, use_triton=True)
            norm.fused_add_rms_norm_triton(a, res, gain, 1e-5, h, res)
            h = gemv.linear(gemv.linear_silu_mul(h, gate_up, use_triton=True), down,
                            use_triton=True)
        return h

    outs = {}
    index = torch.cuda.current_device()
    try:
        for on in (False, True):
            dispatch._pdl_devices[index] = on
            step()  # compile outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            replays = []
            for _ in range(20):
                graph.replay()
                replays.append(out.clone())
            outs[on] = replays
    finally:
        dispatch._pdl_devices.pop(index, None)
    assert all(torch.equal(r, outs[False][0]) for r in outs[False] + outs[True])
