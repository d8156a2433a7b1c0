"""Attention backends: the Triton backend matches the torch reference (the factory's rules:
test_attention_factory.py)."""

import importlib.util
import math
import os

import torch

# Without a GPU, Triton kernels run in the interpreter. The flag is read when a kernel is
# decorated, so it must be set before specpcg's triton kernels are first imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from specpcg.attention import create_attention_backend  # noqa: E402
from specpcg.attention.torch_backend import TorchAttnBackend  # noqa: E402
from specpcg.core import ForwardBatch, ForwardMode  # noqa: E402
from specpcg.kv_cache import SINK_SLOT, KVCache, KVPool, ReqToTokenPool  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cpu_triton = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and the interpreter (TRITON_INTERPRET=1) for CPU tensors")
needs_cuda_triton = pytest.mark.skipif(
    not HAS_TRITON or not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton and a CUDA GPU (without the interpreter)")

NUM_HEADS, NUM_KV_HEADS = 4, 2
LAYER = 0


def _make_cache(device, dtype, head_dim, num_kv_heads=NUM_KV_HEADS, total_slots=4096,
                max_context_len=2048):
    pool = KVPool(total_slots, num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  dtype=dtype, device=device)
    return KVCache(pool, ReqToTokenPool(8, max_context_len, device))


def _make_batch(cache, lens, mode, num_pad_tokens=0, seed=0):
    """lens: [(prefix_len, extend_len)]. Fills the prefixes' KV with random values and returns
    the batch; requests' slots interleave so each KV row is scattered through the pool."""
    gen = torch.Generator().manual_seed(seed)
    pool, device = cache.pool, cache.pool.device
    reqs = [cache.new_request() for _ in lens]
    for idx, (prefix_len, _) in zip(reqs, lens):
        slots = torch.tensor(cache.extend(idx, prefix_len), dtype=torch.long)
        shape = (prefix_len, *pool.k_buffers[LAYER].shape[1:])
        pool.k_buffers[LAYER][slots] = torch.randn(shape, generator=gen).to(pool.dtype).to(device)
        pool.v_buffers[LAYER][slots] = torch.randn(shape, generator=gen).to(pool.dtype).to(device)
    new_slots = {idx: cache.extend(idx, ext) for idx, (_, ext) in reversed(list(zip(reqs, lens)))}
    out_cache_loc = sum((new_slots[idx] for idx in reqs), []) + [SINK_SLOT] * num_pad_tokens
    positions = sum((list(range(p, p + e)) for p, e in lens), []) + [0] * num_pad_tokens
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return ForwardBatch(
        forward_mode=mode, input_ids=as_tensor([0] * len(positions)),
        positions=as_tensor(positions), out_cache_loc=as_tensor(out_cache_loc),
        req_pool_indices=as_tensor(reqs), seq_lens=as_tensor([p + e for p, e in lens]),
        extend_seq_lens=as_tensor([e for _, e in lens]),
        seq_lens_cpu=[p + e for p, e in lens], extend_seq_lens_cpu=[e for _, e in lens])


def _random_qkv(batch, head_dim, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = batch.num_tokens
    q = torch.randn(num_tokens, NUM_HEADS * head_dim, generator=gen)  # [T, H * D]
    k = torch.randn(num_tokens, NUM_KV_HEADS * head_dim, generator=gen)  # [T, Hkv * D]
    v = torch.randn(num_tokens, NUM_KV_HEADS * head_dim, generator=gen)  # [T, Hkv * D]
    return [t.to(dtype).to(device) for t in (q, k, v)]


def _random_tree_mask(num_reqs: int, width: int, keys: int, device, seed=3) -> torch.Tensor:
    """[bs, width, keys] over each request's last `keys` keys: query j always sees itself (key
    keys - width + j) and a random subset of the rest, as a draft tree's ancestors would be."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(num_reqs, width, keys, generator=gen) < 0.5
    own = torch.arange(width) + keys - width
    mask[:, torch.arange(width), own] = True
    return mask.to(device)


def _compare(device, dtype, head_dim, lens, mode, atol, num_pad_tokens=0, num_kv_splits=None,
             backend_name="triton", verify_kernel="extend", tree_keys=None):
    """Runs a backend and torch on one batch; returns the max abs difference over the real rows.
    tree_keys: a random tree mask over each request's last tree_keys keys (equal widths)."""
    cache = _make_cache(device, dtype, head_dim)
    batch = _make_batch(cache, lens, mode, num_pad_tokens)
    if tree_keys:
        batch.tree_mask = _random_tree_mask(len(lens), lens[0][1], tree_keys, device)
    q, k, v = _random_qkv(batch, head_dim, dtype, device)
    scale = 1.0 / math.sqrt(head_dim)
    ref_backend = TorchAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, head_dim, scale)
    # The reference attends in fp32 over the same (possibly bf16) pool.
    ref = ref_backend.forward(q.float(), k, v, LAYER, batch)
    if backend_name == "triton":
        from specpcg.attention.triton_backend import TritonAttnBackend

        backend = TritonAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, head_dim, scale,
                                    num_kv_splits=num_kv_splits, verify_kernel=verify_kernel)
    else:
        backend = create_attention_backend(backend_name, device, cache, NUM_HEADS, NUM_KV_HEADS,
                                           head_dim, scale)
    backend.init_forward_metadata(batch)
    if verify_kernel == "split_k" or tree_keys:  # a chain verify or a tree: the decode kernel
        assert backend._verify_width == lens[0][1]
    out = backend.forward(q, k, v, LAYER, batch)
    assert out.shape == q.shape and out.dtype == q.dtype
    num_real = sum(e for _, e in lens)
    assert torch.all(out[num_real:] == 0), "padding rows must come back as zeros"
    diff = (out[:num_real].float() - ref[:num_real]).abs().max().item()
    assert diff < atol, f"max abs diff {diff} >= {atol}"
    return diff


# (prefix_len, extend_len) per request: no prefix, one new token, ragged mixes, > one block.
EXTEND_CASES = {
    "single_prefill": [(0, 7)],
    "mixed": [(0, 5), (3, 1), (17, 20), (40, 2)],
    "one_token_each": [(0, 1), (9, 1)],
    "long_extend": [(5, 37), (0, 33)],
}
DECODE_CASES = {
    "mixed": [(0, 1), (4, 1), (31, 1), (70, 1)],
    "single_long": [(150, 1)],
}


@needs_cpu_triton
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_triton_extend_matches_torch(case, head_dim):
    _compare("cpu", torch.float32, head_dim, EXTEND_CASES[case], ForwardMode.EXTEND, atol=1e-4)


@needs_cpu_triton
def test_triton_target_verify_uses_extend_path():
    _compare("cpu", torch.float32, 16, [(6, 4), (12, 4)], ForwardMode.TARGET_VERIFY, atol=1e-4)


@needs_cpu_triton
@pytest.mark.parametrize("lens", [[(6, 4), (12, 4)], [(0, 3)], [(150, 8), (3, 8), (40, 8)]])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_triton_split_k_verify_matches_torch(lens, splits):
    """triton_verify_kernel='split_k': node j of each request as a decode query over its first
    prefix + j + 1 positions equals causal attention over the prefix and the nodes."""
    _compare("cpu", torch.float32, 16, lens, ForwardMode.TARGET_VERIFY, atol=1e-4,
             num_kv_splits=splits, verify_kernel="split_k")


@needs_cpu_triton
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND])
@pytest.mark.parametrize("lens,keys", [([(6, 4), (12, 4)], 4), ([(0, 5)], 5),
                                       ([(40, 3), (9, 3), (150, 3)], 9)])
@pytest.mark.parametrize("splits", [None, 4])
def test_triton_tree_mask_matches_torch(mode, lens, keys, splits):
    """Draft trees on the Triton backend: verify nodes (keys = width) and a draft step's branches
    (keys > width: earlier steps' nodes too) see the prefix and the keys their mask allows."""
    _compare("cpu", torch.float32, 16, lens, mode, atol=1e-4, num_kv_splits=splits,
             tree_keys=keys)


@needs_cpu_triton
def test_triton_tree_rows_stay_where_graphs_read_them():
    """A tree verify graph reads the node rows' address: the first tree batch sizes a buffer
    that later batches are copied into (same address, this batch's rows); a larger batch runs
    on rows of its own and leaves the buffer where it was."""
    from kernels.tree_rows import tree_path_rows
    from specpcg.attention.triton_backend import TritonAttnBackend

    cache = _make_cache("cpu", torch.float32, 16)
    backend = TritonAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, 16, 0.25)

    def tree_batch(lens, seed):
        batch = _make_batch(cache, lens, ForwardMode.TARGET_VERIFY, seed=seed)
        batch.tree_mask = _random_tree_mask(len(lens), lens[0][1], lens[0][1], "cpu", seed=seed)
        backend.init_forward_metadata(batch)
        want, _ = tree_path_rows(
            cache.req_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
            batch.tree_mask, cache.req_pool.req_to_token.shape[1])
        assert torch.equal(backend._tree_rows, want)
        return backend._tree_rows.data_ptr()

    first = tree_batch([(6, 4), (12, 4)], seed=0)
    assert tree_batch([(20, 4)], seed=1) == first
    assert tree_batch([(3, 4), (5, 4), (7, 4)], seed=2) != first
    assert backend._tree_rows_buf.data_ptr() == first and backend._tree_rows_buf.shape[0] == 8
    assert tree_batch([(9, 4), (2, 4)], seed=3) == first


@needs_cpu_triton
def test_triton_split_k_verify_zeroes_padding_rows():
    _compare("cpu", torch.float32, 16, [(9, 5), (30, 5)], ForwardMode.TARGET_VERIFY, atol=1e-4,
             num_pad_tokens=6, verify_kernel="split_k")


def test_unknown_verify_kernel_is_refused():
    from specpcg.config import EngineConfig

    with pytest.raises(ValueError, match="triton_verify_kernel 'fast' is not one of"):
        EngineConfig(triton_verify_kernel="fast")


@needs_cpu_triton
@pytest.mark.parametrize("head_dim", [16, 24])
def test_triton_extend_with_padded_tokens(head_dim):
    _compare("cpu", torch.float32, head_dim, EXTEND_CASES["mixed"], ForwardMode.EXTEND,
             atol=1e-4, num_pad_tokens=5)


def _strided(batch, tensors, stride: int):
    """The batch with request i's rows moved to i*stride.. (a draft round graph's catch-up
    layout), the rows between them padding that writes KV to the sink slot."""
    lens = batch.extend_seq_lens_cpu
    where = torch.tensor([i * stride + j for i, n in enumerate(lens) for j in range(n)])
    size = stride * len(lens)

    def spread(x, fill):
        out = torch.full((size, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        out[where] = x
        return out

    moved = ForwardBatch(
        forward_mode=batch.forward_mode, input_ids=spread(batch.input_ids, 0),
        positions=spread(batch.positions, 0), out_cache_loc=spread(batch.out_cache_loc, SINK_SLOT),
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
        extend_seq_lens=batch.extend_seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
        extend_seq_lens_cpu=lens, req_row_stride=stride)
    return moved, [spread(t, 0.0) for t in tensors], where


@needs_cpu_triton
@pytest.mark.parametrize("backend_name", ["triton", "torch"])
def test_strided_rows_match_packed(backend_name):
    """req_row_stride: each request's queries at row i*stride give the packed batch's results,
    and the padding rows between requests come back as zeros."""
    lens, head_dim, stride = [(4, 3), (9, 1), (0, 5)], 16, 6
    cache = _make_cache("cpu", torch.float32, head_dim)
    packed = _make_batch(cache, lens, ForwardMode.DRAFT_EXTEND)
    q, k, v = _random_qkv(packed, head_dim, torch.float32, "cpu")
    scale = 1.0 / math.sqrt(head_dim)
    ref = TorchAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, head_dim, scale).forward(
        q, k, v, LAYER, packed)
    batch, (q2, k2, v2), where = _strided(packed, (q, k, v), stride)
    backend = create_attention_backend(backend_name, "cpu", cache, NUM_HEADS, NUM_KV_HEADS,
                                       head_dim, scale)
    assert backend.supports_row_stride
    backend.init_forward_metadata(batch)
    out = backend.forward(q2, k2, v2, LAYER, batch)
    torch.testing.assert_close(out[where], ref, atol=1e-4, rtol=0)
    pad = torch.ones(out.shape[0], dtype=torch.bool)
    pad[where] = False
    assert torch.all(out[pad] == 0)


@needs_cpu_triton
@pytest.mark.parametrize("num_kv_splits", [None, 1, 4, 16])
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_triton_decode_matches_torch(case, head_dim, num_kv_splits):
    _compare("cpu", torch.float32, head_dim, DECODE_CASES[case], ForwardMode.DECODE, atol=1e-4,
             num_kv_splits=num_kv_splits)


@needs_cpu_triton
def test_triton_decode_with_padded_rows():
    _compare("cpu", torch.float32, 16, DECODE_CASES["mixed"], ForwardMode.DECODE, atol=1e-4,
             num_pad_tokens=3)


# ---- GPU: compiled kernels in bf16 against an fp32 reference over the same bf16 pool ----

BF16_ATOL = 2e-2  # bf16 has an 8-bit mantissa: ~4e-3 relative per rounding of q, p and out


@pytest.mark.cuda
@needs_cuda_triton
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("case", list(EXTEND_CASES) + ["big"])
def test_cuda_extend_bf16(case, head_dim):
    lens = [(100, 150), (0, 129), (900, 3)] if case == "big" else EXTEND_CASES[case]
    _compare("cuda", torch.bfloat16, head_dim, lens, ForwardMode.EXTEND, atol=BF16_ATOL,
             num_pad_tokens=7)


@pytest.mark.cuda
@needs_cuda_triton
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("lens", [[(0, 1), (4, 1), (31, 1), (70, 1)], [(1000, 1)], [(200, 1)] * 6])
def test_cuda_decode_bf16(lens, head_dim):
    _compare("cuda", torch.bfloat16, head_dim, lens, ForwardMode.DECODE, atol=BF16_ATOL,
             num_pad_tokens=2)


@pytest.mark.cuda
@needs_cuda_triton
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lens", [[(900, 8)], [(0, 4), (37, 4), (300, 4)], [(1200, 6)] * 3])
def test_cuda_split_k_verify_bf16(lens, head_dim):
    """The default chain verify (split_k), compiled, against causal attention in fp32."""
    _compare("cuda", torch.bfloat16, head_dim, lens, ForwardMode.TARGET_VERIFY, atol=BF16_ATOL,
             num_pad_tokens=5, verify_kernel="split_k")


@pytest.mark.cuda
@needs_cuda_triton
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lens,keys", [([(900, 8)], 8), ([(20, 4), (37, 4), (300, 4)], 12)])
def test_cuda_tree_mask_bf16(lens, keys, head_dim):
    _compare("cuda", torch.bfloat16, head_dim, lens, ForwardMode.TARGET_VERIFY, atol=BF16_ATOL,
             num_pad_tokens=3, tree_keys=keys)


@pytest.mark.cuda
@needs_cuda_triton
def test_cuda_extend_fp32_is_exact_enough():
    # fp32 must use IEEE dots on GPU (not tf32) to stay this close to the reference.
    _compare("cuda", torch.float32, 64, EXTEND_CASES["mixed"], ForwardMode.EXTEND, atol=1e-4)


@pytest.mark.cuda
@needs_cuda_triton
@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
def test_cuda_graph_decode_replays_live_lengths(backend_name):
    """A decode graph captured once reads the next batch's lengths from the metadata buffers
    (flashinfer: its graph-mode wrapper, planned again before the replay)."""
    if backend_name == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer")
    head_dim, dtype = 64, torch.bfloat16
    cache = _make_cache("cuda", dtype, head_dim)
    batch = _make_batch(cache, [(10, 1), (50, 1), (3, 1)], ForwardMode.DECODE)
    q, k, v = _random_qkv(batch, head_dim, dtype, "cuda")
    backend = create_attention_backend(backend_name, "cuda", cache, NUM_HEADS, NUM_KV_HEADS,
                                       head_dim, 0.125)
    backend.init_graph_metadata(batch)
    backend.forward(q, k, v, LAYER, batch)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, LAYER, batch)

    # Next step: every request grew (random KV for the growth), one new token each.
    gen = torch.Generator().manual_seed(5)
    pool = cache.pool
    new_slots = []
    for idx, extra in zip(batch.req_pool_indices.tolist(), [200, 7, 640]):
        slots = torch.tensor(cache.extend(idx, extra), dtype=torch.long)
        for buf in (pool.k_buffers[LAYER], pool.v_buffers[LAYER]):
            buf[slots] = torch.randn((extra, *buf.shape[1:]), generator=gen).to(dtype).cuda()
        new_slots += cache.extend(idx, 1)
    seq_lens_cpu = [cache.num_tokens(i) for i in batch.req_pool_indices.tolist()]
    batch.out_cache_loc.copy_(torch.tensor(new_slots))
    batch.seq_lens.copy_(torch.tensor(seq_lens_cpu))
    batch.seq_lens_cpu = seq_lens_cpu
    for static, fresh in zip((q, k, v), _random_qkv(batch, head_dim, dtype, "cuda", seed=9)):
        static.copy_(fresh)
    backend.init_graph_metadata(batch)
    graph.replay()
    ref = TorchAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, head_dim, 0.125).forward(
        q.float(), k, v, LAYER, batch)
    assert (out.float() - ref).abs().max().item() < BF16_ATOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                    reason="needs flashinfer and a CUDA GPU")
@pytest.mark.parametrize("mode,lens", [(ForwardMode.EXTEND, EXTEND_CASES["mixed"]),
                                       (ForwardMode.DECODE, DECODE_CASES["mixed"])])
def test_cuda_flashinfer_bf16(mode, lens):
    _compare("cuda", torch.bfloat16, 64, lens, mode, atol=BF16_ATOL, num_pad_tokens=3,
             backend_name="flashinfer")


@needs_cpu_triton
def test_tree_rows_keep_the_pools_width_whatever_the_lengths(monkeypatch):
    """The decode kernel's split count is fixed at compile time from its rows' width: tree
    batches of short and long sequences must hand it rows of one width (no new compile)."""
    from specpcg.attention import triton_kernels

    widths, real = [], triton_kernels.decode_attention

    def spy(q, k_buf, v_buf, out, req_to_token, *args, **kwargs):
        widths.append(req_to_token.shape[1])
        return real(q, k_buf, v_buf, out, req_to_token, *args, **kwargs)

    monkeypatch.setattr(triton_kernels, "decode_attention", spy)
    for lens in ([(6, 4), (12, 4)], [(150, 4)]):
        _compare("cpu", torch.float32, 16, lens, ForwardMode.TARGET_VERIFY, atol=1e-4,
                 tree_keys=4)
    pool_width = _make_cache("cpu", torch.float32, 16).req_pool.req_to_token.shape[1]
    assert widths and set(widths) == {pool_width}


def test_auto_verify_kernel_takes_split_k_where_extend_would_leave_sms_idle():
    from specpcg.attention.triton_backend import TritonAttnBackend

    cache = _make_cache("cpu", torch.float32, 16)
    backend = TritonAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, 16, 0.25, verify_kernel="auto")
    assert backend._split_k_verify(64)  # CPU: always split-K
    backend.device, backend._num_sms = torch.device("cuda"), 132  # an H100's SM count
    assert backend._split_k_verify(132 // NUM_HEADS - 1)
    assert not backend._split_k_verify(-(-132 // NUM_HEADS))
    for kernel, split in (("split_k", True), ("extend", False)):
        backend.verify_kernel = kernel
        assert backend._split_k_verify(1) is split and backend._split_k_verify(64) is split


def test_a_chain_verify_stacks_a_requests_nodes_in_one_program(monkeypatch):
    """A chain's nodes share a row: one kernel program takes all of a request's nodes, its
    splits counted over requests; stack_chain_nodes off gives a program a node again."""
    from specpcg.attention import triton_kernels
    from specpcg.attention.triton_backend import TritonAttnBackend

    cache = _make_cache("cpu", torch.float32, 16)
    backend = TritonAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, 16, 0.25)
    backend._num_sms = 132  # an H100's SM count
    for stack, nodes in ((True, 8), (False, 1)):
        monkeypatch.setattr(TritonAttnBackend, "stack_chain_nodes", stack)
        backend._expand_verify(3, 8, torch.arange(3))
        assert backend._verify_nodes == nodes
        assert backend._verify_splits == triton_kernels.pick_num_kv_splits(
            3 * 8 // nodes, NUM_KV_HEADS, 132)
    backend.device = torch.device("cuda")  # float32 on a GPU: a program a node
    monkeypatch.setattr(TritonAttnBackend, "stack_chain_nodes", True)
    backend._expand_verify(3, 8, torch.arange(3))
    assert backend._verify_nodes == 1


def test_the_deterministic_mode_keeps_verify_on_the_decode_kernel():
    from specpcg.config import EngineConfig

    for deterministic, want in ((True, "split_k"), (False, "auto")):
        cfg = EngineConfig(enable_deterministic_inference=deterministic,
                           triton_verify_kernel="auto")
        assert cfg.resolve_verify_kernel() == want
    assert EngineConfig().resolve_verify_kernel() == "split_k"  # the default: decode queries
    cfg = EngineConfig(enable_deterministic_inference=True, triton_verify_kernel="extend")
    assert cfg.resolve_verify_kernel() == "extend"


def test_a_verify_of_few_requests_splits_their_nodes_into_programs_of_16_rows():
    """Nodes a program: all of them while their rows fit in 16; past that, while the programs
    stay within the SMs, the most that fit and divide the width."""
    from specpcg.attention.triton_backend import TritonAttnBackend

    cache = _make_cache("cpu", torch.float32, 16)
    backend = TritonAttnBackend(cache, 9, 3, 16, 0.25)  # 3 query heads a KV head
    backend._num_sms = 132
    assert backend._nodes_a_program(1, 8) == 4  # 12 rows: two programs a request
    assert backend._nodes_a_program(22, 8) == 4  # 22 x 3 KV heads x 2 = 132 programs
    assert backend._nodes_a_program(23, 8) == 8  # past the SMs: one program a request
    assert backend._nodes_a_program(1, 5) == 5 and backend._nodes_a_program(1, 7) == 7
    assert backend._nodes_a_program(1, 4) == 4  # 12 rows fit
    wide = TritonAttnBackend(cache, 64, 2, 16, 0.25)  # 32 query heads a KV head
    wide._num_sms = 132
    assert wide._nodes_a_program(1, 8) == 8  # not one node fits in 16 rows
