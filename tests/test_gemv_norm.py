"""The few-row kernel with the RMSNorm before it in its launch (kernels/gemv.normed_linear)
against its twin (the norm, then the matmul), its dispatch rule, and a model whose layers take
it: the same greedy tokens as the norm's own kernel, then the matmul.

On CPU the kernel runs in the Triton interpreter in fp32; bf16 and graphs are checked on CUDA.
"""

import torch
from test_gemv import _close_fp32, needs_interpreter  # sets TRITON_INTERPRET first on CPU

import pytest  # noqa: E402

from kernels import gemv  # noqa: E402
from specpcg.models.layers import Linear  # noqa: E402
from tests.tiny_models import save_tiny_checkpoint, tiny_engine  # noqa: E402


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 3, 8, 19])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_the_normed_launch_matches_the_norm_then_the_matmul(rows, with_residual, silu):
    k = 100  # one step deep for one row (1,024) and for several (128)
    x, w = torch.randn(rows, k), torch.randn(48, k) / k ** 0.5
    residual = torch.randn(rows, k) if with_residual else None
    norm_weight, bias = torch.rand(k) + 0.5, None if silu else torch.randn(48)
    kept = x.clone(), None if residual is None else residual.clone()
    out, res = gemv.normed_linear(x, residual, norm_weight, 1e-6, w, bias, silu, use_triton=True)
    want, want_res = gemv.normed_linear_torch(x, residual, norm_weight, 1e-6, w, bias, silu)
    _close_fp32(out, want)
    assert torch.equal(res, want_res)
    assert torch.equal(x, kept[0])  # inputs are read, never written
    if with_residual:
        assert torch.equal(residual, kept[1]) and res.data_ptr() not in (
            x.data_ptr(), residual.data_ptr())
    else:
        assert res is x


@needs_interpreter
def test_a_launch_that_cannot_read_the_whole_depth_at_once_is_refused():
    from kernels import gemv_triton

    x, w = torch.randn(3, 300), torch.randn(16, 300)
    with pytest.raises(ValueError, match="K 300 in steps of 128"):
        gemv_triton.gemv(x, w, None, torch.empty(3, 16), tile=(32, 128, 4, 1, 1),
                         norm=(None, torch.ones(300), 1e-6, None))


def test_cpu_calls_and_other_dtypes_run_the_norm_kernel_first():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert not gemv.norm_fits(x, w, torch.ones(64))
    assert gemv.normed_linear(x, None, torch.ones(64), 1e-6, w) is None
    if torch.cuda.is_available():
        cx, cw = x.cuda().bfloat16(), w.cuda().bfloat16()
        assert gemv.norm_fits(cx, cw, torch.ones(64, device="cuda", dtype=torch.bfloat16))
        assert not gemv.norm_fits(cx, cw, torch.ones(64, device="cuda"))  # fp32 norm weight


def tiny_greedy(tmp_path, prompts: list) -> tuple:
    """A tiny llama's engine on CPU in fp32, and a function that returns its greedy tokens
    (6 a prompt) for `prompts`."""
    save_tiny_checkpoint("llama", tmp_path)
    engine = tiny_engine(str(tmp_path), max_total_tokens=512)

    def run():
        outs = engine.generate(input_ids=prompts,
                               sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                "ignore_eos": True})
        return [o["output_ids"] for o in outs]
    return engine, run


@needs_interpreter
def test_a_model_whose_layers_take_the_norm_in_their_launches_keeps_its_tokens(
        tmp_path, monkeypatch):
    """Greedy tokens of a tiny model, with each layer's norms in its qkv and gate/up launches
    (forced on CPU through the interpreter: prefill and decode), equal those with the norm's
    own kernel first, on the same engine."""
    engine, run = tiny_greedy(tmp_path, [[4, 8, 15, 16, 23, 42], [7, 3, 9]])
    try:
        plain, rows = run(), []

        def forced(self, x, residual, norm, silu_mul=False):
            rows.append(x.shape[0])
            return gemv.normed_linear(x, residual, norm.weight, norm.eps, self.weight,
                                      self.bias, silu_mul, use_triton=True)

        monkeypatch.setattr(Linear, "forward_normed", forced)
        assert run() == plain
        assert 9 in rows and 2 in rows  # the prompts' prefill and the decode steps
    finally:
        engine.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("silu", [False, True])
def test_cuda_the_normed_launch_matches_the_norm_then_the_matmul(rows, silu):
    """bf16 at the default model's shapes (576 deep, one step), eagerly and in a CUDA graph:
    the twin's result within a bf16 rounding of the norm's output, the residual exact, and
    from 2 rows each row's bits whatever rows sit beside it."""
    from kernels import gemv_triton

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    k, n = 576, (3072 if silu else 960)
    x = torch.randn(rows, k, device=dev, dtype=bf)
    residual = torch.randn(rows, k, device=dev, dtype=bf)
    w = (torch.randn(n, k, device=dev) * k ** -0.5).to(bf)
    nw = (torch.rand(k, device=dev) + 0.5).to(bf)
    one_step = rows == 1 or gemv_triton.one_step_fits(x)  # the engine's rule, as the qkv's
    assert gemv.norm_fits(x, w, nw, n // 2 if silu else n) == one_step
    out, res = gemv.normed_linear(x, residual, nw, 1e-5, w, None, silu, use_triton=True)
    want, want_res = gemv.normed_linear_torch(x, residual, nw, 1e-5, w, None, silu)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_res = gemv.normed_linear(x, residual, nw, 1e-5, w, None, silu, use_triton=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_res, res)
    if rows > 1:
        one, _ = gemv.normed_linear(x[1:2].repeat(2, 1), residual[1:2].repeat(2, 1), nw, 1e-5,
                                    w, None, silu, use_triton=True)
        assert torch.equal(one[0], out[1])


@pytest.mark.parametrize("name", ["SPECPCG_NORM_IN_GEMV", "SPECPCG_ROPE_IN_GEMV"])
def test_the_in_gemv_settings_are_0_or_1_and_a_bad_one_is_named(monkeypatch, name):
    monkeypatch.setenv(name, "0")
    assert gemv._flag(name) is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}='yes'"):
        gemv._flag(name)
    monkeypatch.delenv(name)
    assert gemv._flag(name) is True
