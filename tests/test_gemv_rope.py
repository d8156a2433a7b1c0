"""The qkv projection with the norm, the rotary and the K/V cache write in its launch
(kernels/gemv.normed_qkv_rope: one row, and from 2 rows on tensor-core tiles) against its twin,
and models whose steps take it: the same greedy tokens as the norm's, the matmul's and the
rotary's kernels one after another.

On CPU the kernel runs in the Triton interpreter in fp32; bf16 and graphs are checked on CUDA.
"""

import torch
from test_gemv import _close_fp32, needs_interpreter  # sets TRITON_INTERPRET first on CPU
from test_gemv_norm import tiny_greedy

import pytest  # noqa: E402

from kernels import gemv  # noqa: E402
from specpcg.models.layers import Linear, RotaryEmbedding  # noqa: E402
from tests.tiny_models import save_tiny_checkpoint, tiny_engine  # noqa: E402


def _case(heads, kv_heads, head_dim, k, device="cpu", dtype=torch.float32, bias=False, rows=1):
    """Inputs of one decode token: x, residual, norm weight, weight, bias, and a rope tuple
    whose caches hold random rows (the twin's own copies come from `_copy_rope`)."""
    torch.manual_seed(0)
    n = (heads + 2 * kv_heads) * head_dim

    def rand(*shape):
        return torch.randn(*shape, device=device).to(dtype)
    x, residual, w = rand(rows, k), rand(rows, k), (rand(n, k) * k ** -0.5).to(dtype)
    nw = (torch.rand(k, device=device) + 0.5).to(dtype)
    b = rand(n) if bias else None
    cos_sin = RotaryEmbedding(head_dim, 64, 10000.0).cos_sin.to(device)
    positions = torch.arange(37, 37 + rows, device=device)
    slots = torch.arange(5, 5 + rows, device=device).flip(0)  # slots need not follow positions
    caches = rand(30, kv_heads, head_dim), rand(30, kv_heads, head_dim)
    return x, residual, nw, w, b, (positions, cos_sin, slots, *caches, heads, kv_heads, head_dim)


def _copy_rope(rope):
    return rope[:3] + (rope[3].clone(), rope[4].clone()) + rope[5:]


@needs_interpreter
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,head_dim", [(1, 32), (3, 32), (8, 32), (8, 16)])
def test_the_roped_launch_matches_the_norm_the_matmul_and_the_rotary(with_residual, bias, rows,
                                                                     head_dim):
    # from 2 rows a program's tile is 8 outputs of a head's first half and the 8 they pair
    # with: 2 tiles a half at head dim 32, one at 16
    x, residual, nw, w, b, rope = _case(4, 2, head_dim, 48, bias=bias, rows=rows)
    residual = residual if with_residual else None
    want_rope = _copy_rope(rope)
    untouched = rope[3].clone()
    out, res = gemv.normed_qkv_rope(x, residual, nw, 1e-6, w, b, rope, use_triton=True)
    want, want_res = gemv.normed_qkv_rope_torch(x, residual, nw, 1e-6, w, b, want_rope)
    _close_fp32(out, want)
    _close_fp32(rope[3], want_rope[3])  # the caches at the slot: k rotated, and v
    _close_fp32(rope[4], want_rope[4])
    written = torch.zeros(30, dtype=torch.bool)
    written[rope[2]] = True
    assert torch.equal(rope[3][~written], untouched[~written])
    assert torch.equal(res, want_res) if with_residual else res is x


@needs_interpreter
def test_the_roped_launch_refuses_what_it_cannot_pair():
    from kernels.gemv_rope_triton import gemv_rope

    x, residual, nw, w, b, rope = _case(4, 2, 8, 48)
    out = torch.empty(1, w.shape[0])
    with pytest.raises(ValueError, match="qkv weight of 32 \\+ 2 x 16 rows"):
        gemv_rope(x, w[:40], None, out[:, :40], (None, nw, 1e-6, None), rope)
    with pytest.raises(ValueError, match="halves of 8s"):  # head dim 8 past one row
        gemv_rope(x.repeat(2, 1), w, None, out.repeat(2, 1), (None, nw, 1e-6, None), rope)


def test_cpu_calls_and_the_setting_off_run_the_kernels_apart(monkeypatch):
    x, residual, nw, w, b, rope = _case(4, 2, 8, 48)
    assert gemv.normed_qkv_rope(x, residual, nw, 1e-6, w, b, rope) is None  # CPU: no fit
    monkeypatch.setattr(gemv, "ROPE_IN_GEMV", False)
    if torch.cuda.is_available():
        cuda = [t.cuda() if isinstance(t, torch.Tensor) else t for t in rope]
        assert gemv.normed_qkv_rope(x.cuda().bfloat16(), None, nw.cuda().bfloat16(), 1e-6,
                                    w.cuda().bfloat16(), None, tuple(cuda)) is None


@needs_interpreter
def test_a_model_whose_decode_takes_the_roped_launch_keeps_its_tokens(tmp_path, monkeypatch):
    """Greedy tokens of a tiny model with its one-row qkv launches roped (forced on CPU
    through the interpreter) equal those of the kernels apart, on the same engine."""
    engine, run = tiny_greedy(tmp_path, [[4, 8, 15, 16, 23, 42]])
    try:
        plain, calls = run(), []

        def forced(self, x, residual, norm, rope):
            calls.append(x.shape[0])
            if x.shape[0] != 1:
                return None
            return gemv.normed_qkv_rope(x, residual, norm.weight, norm.eps, self.weight,
                                        self.bias, rope, use_triton=True)

        monkeypatch.setattr(Linear, "forward_normed_rope", forced)
        assert run() == plain
        assert calls.count(1) >= 2 * 5  # two layers, five decode steps at least
    finally:
        engine.shutdown()


@needs_interpreter
def test_prefill_and_verify_rows_through_the_roped_launch_keep_their_tokens(tmp_path,
                                                                           monkeypatch):
    """A tiny llama of 32-wide heads (two of the rows kernel's tiles a half) under NGRAM:
    greedy tokens with every qkv launch roped (forced on CPU through the interpreter: the
    prompts' prefill and the chain verifies of 4 rows, each row at its own position and
    slot) equal those of the kernels apart, and those of plain decoding."""
    save_tiny_checkpoint("llama", tmp_path, heads=(2, 1))
    prompts = [[4, 8, 15, 16, 4, 8, 15, 16, 4, 8], [7, 3, 9, 7, 3]]  # n-grams to draft from
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = tiny_engine(str(tmp_path))
    spec = tiny_engine(str(tmp_path), speculative_algorithm="NGRAM", speculative_num_steps=3,
                       speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                       disable_adaptive_speculation=True)
    try:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
        calls = []

        def forced(self, x, residual, norm, rope):
            calls.append(x.shape[0])
            return gemv.normed_qkv_rope(x, residual, norm.weight, norm.eps, self.weight,
                                        self.bias, rope, use_triton=True)

        monkeypatch.setattr(Linear, "forward_normed_rope", forced)
        for engine in (spec, plain):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert [o["output_ids"] for o in outs] == want
        # the prompts' prefill, the verifies of both requests (2 x 4 rows), plain decode steps
        assert max(calls) > 8 and 8 in calls and 2 in calls
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_cuda_the_roped_launch_has_the_bits_of_the_kernels_apart(with_residual, rows):
    """bf16 at the default model's shapes (9 heads, 3 KV heads of 64, 576 deep), eagerly and
    in a CUDA graph: at one row the GEMV with the norm in its launch, then the rotary-and-store
    kernel, give the same bits as the one launch (the same sums, the same rounding); from 2
    rows the same within a rounding, and a row's bits whatever rows sit beside it."""
    from kernels import fused_ops

    x, residual, nw, w, b, rope = _case(9, 3, 64, 576, "cuda", torch.bfloat16, rows=rows)
    residual = residual if with_residual else None
    apart = _copy_rope(rope)
    qkv, res = gemv.normed_linear(x, residual, nw, 1e-5, w, None, use_triton=True)
    q, k, v = qkv.split([576, 192, 192], dim=-1)
    fused_ops.rotary_embedding_store_(apart[0], q, k, v, apart[1], 64, apart[3], apart[4],
                                      apart[2])
    assert gemv.rope_fits(x, w, nw, 64)
    out, out_res = gemv.normed_qkv_rope(x, residual, nw, 1e-5, w, None, rope)
    assert torch.equal(out_res, res)
    if rows == 1:
        assert torch.equal(out, qkv)
        assert torch.equal(rope[3], apart[3]) and torch.equal(rope[4], apart[4])
    else:  # the norm's sums run in another tile layout: a rounding apart, rows independent
        for got, want in ((out, qkv), (rope[3], apart[3]), (rope[4], apart[4])):
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        first_two = gemv.normed_qkv_rope(x[:2], None if residual is None else residual[:2],
                                         nw, 1e-5, w, None, _copy_rope(rope))[0]
        assert torch.equal(first_two, out[:2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _ = gemv.normed_qkv_rope(x, residual, nw, 1e-5, w, None, rope)
    k_rows = rope[3][rope[2]].clone()
    rope[3][rope[2]] = 0  # the replay writes them again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(rope[3][rope[2]], k_rows)
