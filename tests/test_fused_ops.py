"""Fused ops: each Triton kernel matches its torch twin, and each twin matches the model's layers.

On CPU the kernels run in the Triton interpreter, in fp32 only: the interpreter rounds fp32 to
bf16 by truncation, not to nearest as the GPU does, so bf16 is checked on CUDA alone.
"""

import os

import torch

# The interpreter flag is read when a kernel is decorated; kernels.fused_ops imports its Triton
# modules lazily, so setting it here, before the first Triton call, is enough.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels import fused_ops  # noqa: E402
from specpcg.models.layers import GatedMLP, RMSNorm, RotaryEmbedding  # noqa: E402

EPS = 1e-6
MAX_POSITIONS = 4096
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
TOKENS = [0, 1, 7, 33]
# (head_dim, q heads, k heads): GQA groups of 2, 3 (SmolLM2's 9 / 3) and 4.
ROTARY_SHAPES = [(64, 4, 2), (64, 9, 3), (128, 8, 2)]


def _close_fp32(actual, expected):
    # A few ulps of the value as well as an absolute floor: inputs are scaled to reach silu's
    # tails, so outputs reach ~40, where one fp32 ulp is ~4e-6.
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-6)


def _cos_sin(head_dim, device="cpu"):
    return RotaryEmbedding(head_dim, MAX_POSITIONS, theta=10000.0).cos_sin.to(device)


def _qk(layout, num_tokens, head_dim, num_q_heads, num_k_heads, dtype, device):
    """q and k as the model may hand them over: flat [T, H * D], [T, H, D], or slices of qkv."""
    q_size, kv_size = num_q_heads * head_dim, num_k_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views of qkv
    if layout == "qkv_slice":
        return q, k
    q, k = q.contiguous(), k.contiguous()
    if layout == "heads":
        return q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_k_heads, head_dim)
    return q, k


# ---- Triton kernels vs torch twins on CPU (interpreter, fp32) --------------------------------

@needs_interpreter
@pytest.mark.parametrize("hidden_size", [64, 576, 8192])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rms_norm_kernel_matches_twin(num_tokens, hidden_size):
    x = torch.randn(num_tokens, hidden_size) * 3
    weight = torch.randn(hidden_size)
    expected = fused_ops.rms_norm_torch(x, weight, EPS)
    _close_fp32(fused_ops.rms_norm(x, weight, EPS, use_triton=True), expected)
    out = torch.full_like(x, float("nan"))
    assert fused_ops.rms_norm(x, weight, EPS, out=out, use_triton=True) is out
    _close_fp32(out, expected)


@needs_interpreter
@pytest.mark.parametrize("hidden_size", [64, 576])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_fused_add_rms_norm_kernel_matches_twin(num_tokens, hidden_size):
    x, residual = torch.randn(2, num_tokens, hidden_size).unbind(0)
    weight = torch.randn(hidden_size)
    y_ref, residual_ref = fused_ops.fused_add_rms_norm_torch(x, residual, weight, EPS)
    y, new_residual = fused_ops.fused_add_rms_norm(x, residual, weight, EPS, use_triton=True)
    _close_fp32(y, y_ref)
    assert torch.equal(new_residual, residual_ref)  # one fp32 add, rounded the same way
    # In place, as a decode graph would run it: the residual stream updated in its own buffer.
    out = torch.empty_like(x)
    y, new_residual = fused_ops.fused_add_rms_norm(x, residual, weight, EPS, out=out,
                                                   residual_out=residual, use_triton=True)
    assert y is out and new_residual is residual
    _close_fp32(out, y_ref)
    assert torch.equal(residual, residual_ref)


@needs_interpreter
def test_rms_norm_kernel_on_heads_and_strided_rows():
    # Qwen3's q_norm normalises [T, heads, D]; a row of a wider buffer has a row stride.
    x = torch.randn(5, 4, 64)
    weight = torch.randn(64)
    _close_fp32(fused_ops.rms_norm(x, weight, EPS, use_triton=True),
                fused_ops.rms_norm_torch(x, weight, EPS))
    wide = torch.randn(6, 200)
    rows = wide[:, 8:136]  # [6, 128], row stride 200
    _close_fp32(fused_ops.rms_norm(rows, weight.repeat(2), EPS, use_triton=True),
                fused_ops.rms_norm_torch(rows, weight.repeat(2), EPS))


@needs_interpreter
@pytest.mark.parametrize("layout", ["flat", "heads", "qkv_slice"])
@pytest.mark.parametrize("head_dim,num_q_heads,num_k_heads", ROTARY_SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_kernel_matches_twin(num_tokens, head_dim, num_q_heads, num_k_heads, layout):
    cos_sin = _cos_sin(head_dim)
    positions = torch.randint(0, 4001, (num_tokens,))
    if num_tokens:
        positions[0] = 4000  # the far end of the range, where angles are largest
    q, k = _qk(layout, num_tokens, head_dim, num_q_heads, num_k_heads, torch.float32, "cpu")
    q_ref, k_ref = q.clone(), k.clone()
    fused_ops.rotary_embedding_torch_(positions, q_ref, k_ref, cos_sin, head_dim)
    q_out, k_out = fused_ops.rotary_embedding_(positions, q, k, cos_sin, head_dim,
                                               use_triton=True)
    assert q_out is q and k_out is k
    _close_fp32(q, q_ref)
    _close_fp32(k, k_ref)


def _rotary_store_case(num_tokens, head_dim, num_q_heads, num_k_heads, layout, dtype, device,
                       cache_dtype):
    """Inputs of rotary_embedding_store_, and the twin's q and caches after it."""
    cos_sin = _cos_sin(head_dim, device)
    positions = torch.randint(0, 4001, (num_tokens,), device=device)
    q, k = _qk(layout, num_tokens, head_dim, num_q_heads, num_k_heads, dtype, device)
    v = torch.randn(num_tokens, num_k_heads * head_dim, dtype=dtype, device=device)
    slots = torch.randperm(2 * num_tokens + 3, device=device)[:num_tokens]  # scattered slots
    caches = [torch.randn(2 * num_tokens + 3, num_k_heads, head_dim, device=device).to(cache_dtype)
              for _ in range(2)]
    ref = [q.clone(), k.clone(), v, caches[0].clone(), caches[1].clone()]
    fused_ops.rotary_store_torch_(positions, ref[0], ref[1], ref[2], cos_sin, head_dim,
                                  ref[3], ref[4], slots)
    return (positions, q, k, v, cos_sin, head_dim, caches[0], caches[1], slots), ref


@needs_interpreter
@pytest.mark.parametrize("layout", ["flat", "qkv_slice"])
@pytest.mark.parametrize("head_dim,num_q_heads,num_k_heads", ROTARY_SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_store_kernel_matches_twin(num_tokens, head_dim, num_q_heads, num_k_heads, layout):
    args, (q_ref, _, _, k_cache_ref, v_cache_ref) = _rotary_store_case(
        num_tokens, head_dim, num_q_heads, num_k_heads, layout, torch.float32, "cpu",
        torch.float32)
    fused_ops.rotary_embedding_store_(*args, use_triton=True)
    _close_fp32(args[1], q_ref)
    _close_fp32(args[6], k_cache_ref)  # rotated k, at its slots; other slots untouched
    assert torch.equal(args[7], v_cache_ref)


def test_rotary_store_twin_equals_rotary_then_save():
    rotary = RotaryEmbedding(64, MAX_POSITIONS, theta=10000.0)
    positions = torch.tensor([5, 0, 900])
    q, k, v = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 128)
    k_cache, v_cache = torch.zeros(8, 2, 64), torch.zeros(8, 2, 64)
    slots = torch.tensor([6, 1, 3])
    q_ref, k_ref = rotary(positions, q.clone(), k.clone())
    fused_ops.rotary_embedding_store_(positions, q, k, v, rotary.cos_sin, 64, k_cache, v_cache,
                                      slots)
    assert torch.equal(q, q_ref)
    assert torch.equal(k_cache[slots], k_ref) and torch.equal(v_cache[slots], v.view(3, 2, 64))
    assert not k_cache[[0, 2, 4, 5, 7]].any() and not v_cache[[0, 2, 4, 5, 7]].any()


def test_rotary_store_refuses_mismatched_slots():
    with pytest.raises(ValueError, match="slots must be"):
        fused_ops.rotary_embedding_store_(
            torch.zeros(4, dtype=torch.long), torch.randn(4, 128), torch.randn(4, 64),
            torch.randn(4, 64), _cos_sin(64), 64, torch.zeros(8, 1, 64), torch.zeros(8, 1, 64),
            torch.zeros(3, dtype=torch.long))


@needs_interpreter
@pytest.mark.parametrize("inter_size", [64, 576, 1536])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_silu_and_mul_kernel_matches_twin(num_tokens, inter_size):
    gate_up = torch.randn(num_tokens, 2 * inter_size) * 4  # reach silu's flat negative tail
    expected = fused_ops.silu_and_mul_torch(gate_up)
    _close_fp32(fused_ops.silu_and_mul(gate_up, use_triton=True), expected)
    out = torch.full((num_tokens, inter_size), float("nan"))
    assert fused_ops.silu_and_mul(gate_up, out=out, use_triton=True) is out
    _close_fp32(out, expected)


# ---- dispatch and refusals -------------------------------------------------------------------

def test_cpu_tensors_use_the_twins_by_default():
    x, residual, weight = torch.randn(3, 4, 64).unbind(0)
    weight = weight[0]
    assert torch.equal(fused_ops.rms_norm(x, weight, EPS), fused_ops.rms_norm_torch(x, weight, EPS))
    gate_up = torch.randn(4, 128)
    assert torch.equal(fused_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul_torch(gate_up))
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    y, new_residual = fused_ops.fused_add_rms_norm(x, residual, weight, EPS, out=out,
                                                   residual_out=res_out)
    assert y is out and new_residual is res_out and torch.equal(res_out, x + residual)


def test_use_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fused_ops.silu_and_mul(torch.randn(2, 8), use_triton=True)


def test_bad_shapes_are_refused():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_ops.fused_add_rms_norm(x, torch.randn(4, 32), torch.ones(64), EPS)
    with pytest.raises(ValueError, match="out"):
        fused_ops.rms_norm(x, torch.ones(64), EPS, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="even"):
        fused_ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        fused_ops.rotary_embedding_(torch.zeros(4, dtype=torch.long), torch.randn(4, 128),
                                    torch.randn(4, 64), torch.randn(10, 32), 64)
    with pytest.raises(ValueError, match="packed"):
        fused_ops.rotary_embedding_(torch.zeros(4, dtype=torch.long), torch.randn(4, 64, 2).mT,
                                    torch.randn(4, 64), torch.randn(10, 64), 64)


# ---- torch twins vs the model's layers (exact) -----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_twins_equal_the_model_rmsnorm(dtype):
    norm = RMSNorm(576, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x, residual = (torch.randn(2, 9, 576) * 2).to(dtype).unbind(0)
    with torch.no_grad():
        assert torch.equal(fused_ops.rms_norm_torch(x, norm.weight, EPS), norm(x))
        # The decoder layer's unfused order: add in the stream dtype, then normalise.
        hidden = x + residual
        y, new_residual = fused_ops.fused_add_rms_norm_torch(x, residual, norm.weight, EPS)
        assert torch.equal(new_residual, hidden) and torch.equal(y, norm(hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_q_heads,num_k_heads", ROTARY_SHAPES)
def test_rotary_twin_equals_the_model_rotary(head_dim, num_q_heads, num_k_heads, dtype):
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, theta=10000.0)
    positions = torch.randint(0, 4001, (11,))
    q = torch.randn(11, num_q_heads, head_dim).to(dtype)
    k = torch.randn(11, num_k_heads, head_dim).to(dtype)
    q_flat, k_flat = q.reshape(11, -1).clone(), k.reshape(11, -1).clone()
    q_ref, k_ref = rotary(positions, q, k)  # in place
    fused_ops.rotary_embedding_torch_(positions, q_flat, k_flat, rotary.cos_sin, head_dim)
    assert torch.equal(q_flat.view_as(q), q_ref) and torch.equal(k_flat.view_as(k), k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_twin_equals_the_model_mlp(dtype):
    mlp = GatedMLP(64, 160).to(dtype)
    x = torch.randn(9, 64).to(dtype)
    with torch.no_grad():
        fused = mlp.down_proj(fused_ops.silu_and_mul_torch(mlp.gate_up_proj(x)))
        assert torch.equal(fused, mlp(x))


# ---- CUDA: bf16 and fp32 vs the twins, and graph capture -------------------------------------
# bf16 tolerance: rtol 1.6e-2 (two bf16 ulps) and atol 1e-2. The kernels round at the same
# points as the twins, so differences come only from fp32 summation order and FMA contraction,
# which can flip a rounding by one ulp. fp32: atol = rtol = 1e-5.

def _tol(dtype):
    return dict(atol=1e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens,hidden_size", [(0, 576), (1, 576), (33, 576), (7, 4096),
                                                    (2048, 4096), (3, 8192)])
def test_cuda_norms_match_twins(num_tokens, hidden_size, dtype):
    x, residual = (torch.randn(2, num_tokens, hidden_size, device="cuda") * 2).to(dtype).unbind(0)
    weight = torch.randn(hidden_size, device="cuda").to(dtype)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, EPS),
                               fused_ops.rms_norm_torch(x, weight, EPS), **_tol(dtype))
    y_ref, residual_ref = fused_ops.fused_add_rms_norm_torch(x, residual, weight, EPS)
    y, new_residual = fused_ops.fused_add_rms_norm(x, residual, weight, EPS, residual_out=residual)
    assert torch.equal(new_residual, residual_ref)  # one add, round to nearest in both
    torch.testing.assert_close(y, y_ref, **_tol(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["flat", "qkv_slice"])
@pytest.mark.parametrize("head_dim,num_q_heads,num_k_heads", ROTARY_SHAPES + [(128, 32, 8)])
@pytest.mark.parametrize("num_tokens", [0, 1, 33, 2048])
def test_cuda_rotary_matches_twin(num_tokens, head_dim, num_q_heads, num_k_heads, layout, dtype):
    cos_sin = _cos_sin(head_dim, "cuda")
    positions = torch.randint(0, 4001, (num_tokens,), device="cuda")
    q, k = _qk(layout, num_tokens, head_dim, num_q_heads, num_k_heads, dtype, "cuda")
    q_ref, k_ref = q.clone(), k.clone()
    fused_ops.rotary_embedding_torch_(positions, q_ref, k_ref, cos_sin, head_dim)
    fused_ops.rotary_embedding_(positions, q, k, cos_sin, head_dim)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(k, k_ref, **_tol(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["flat", "qkv_slice"])
@pytest.mark.parametrize("head_dim,num_q_heads,num_k_heads", ROTARY_SHAPES + [(128, 32, 8)])
@pytest.mark.parametrize("num_tokens", [0, 1, 33, 2048])
def test_cuda_rotary_store_matches_twin(num_tokens, head_dim, num_q_heads, num_k_heads, layout,
                                        dtype):
    args, (q_ref, _, _, k_cache_ref, v_cache_ref) = _rotary_store_case(
        num_tokens, head_dim, num_q_heads, num_k_heads, layout, dtype, "cuda", dtype)
    fused_ops.rotary_embedding_store_(*args)
    torch.testing.assert_close(args[1], q_ref, **_tol(dtype))
    torch.testing.assert_close(args[6], k_cache_ref, **_tol(dtype))
    assert torch.equal(args[7], v_cache_ref)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens,inter_size", [(0, 1536), (1, 1536), (33, 1536),
                                                   (2048, 14336)])
def test_cuda_silu_and_mul_matches_twin(num_tokens, inter_size, dtype):
    gate_up = (torch.randn(num_tokens, 2 * inter_size, device="cuda") * 4).to(dtype)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up),
                               fused_ops.silu_and_mul_torch(gate_up), **_tol(dtype))


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager():
    """A decode-layer-shaped sequence captured once, then replayed on fresh inputs."""
    num_tokens, hidden, head_dim, num_q_heads, num_k_heads, inter = 8, 576, 64, 9, 3, 1536
    q_size, kv_size = num_q_heads * head_dim, num_k_heads * head_dim

    def fresh():
        return dict(
            x=torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16),
            residual=torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16),
            positions=torch.randint(0, 4001, (num_tokens,), device="cuda"),
            qkv=torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", dtype=torch.bfloat16),
            gate_up=torch.randn(num_tokens, 2 * inter, device="cuda", dtype=torch.bfloat16))

    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    cos_sin = _cos_sin(head_dim, "cuda")

    def layer(t, normed=None, act=None):
        normed, _ = fused_ops.fused_add_rms_norm(t["x"], t["residual"], weight, EPS, out=normed,
                                                 residual_out=t["residual"])
        q, k = t["qkv"][:, :q_size], t["qkv"][:, q_size:q_size + kv_size]  # strided views
        fused_ops.rotary_embedding_(t["positions"], q, k, cos_sin, head_dim)
        return normed, fused_ops.silu_and_mul(t["gate_up"], out=act)

    static = fresh()
    normed, act = layer({name: v.clone() for name, v in static.items()})  # compile: not in capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(static, normed, act)
    new = fresh()
    for name, value in new.items():
        static[name].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    normed_ref, act_ref = layer(new)  # eager, on the same inputs, updating `new` in place
    assert torch.equal(normed, normed_ref) and torch.equal(act, act_ref)
    for name in ("residual", "qkv"):
        assert torch.equal(static[name], new[name]), name
