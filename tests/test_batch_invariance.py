"""Batch invariance of the split-K decode kernel (through the Triton interpreter on CPU): a
query's result is bitwise the same whatever it is batched with and however many programs share
its keys, and a verify node (a chain's, or a tree's under its mask) equals the decode query at
its position. Split boundaries depend on key positions alone (triton_kernels.decode_attention)."""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# Most tests hand CPU tensors to Triton: the interpreter's, which is set above only where no GPU
# is present (the flag is read when kernels are decorated, at import).
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU tensors through Triton need TRITON_INTERPRET=1")

H, HKV, D = 4, 2, 16
ROW = 512  # keys a row can hold


def _world(lens: list, seed: int = 0, kv_heads: int = HKV, dim: int = D, row: int = ROW):
    """Paged KV for one row per request (slots interleaved)."""
    gen = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 1
    k_buf = torch.randn(slots, kv_heads, dim, generator=gen)
    v_buf = torch.randn(slots, kv_heads, dim, generator=gen)
    req_to_token = torch.zeros(len(lens), row, dtype=torch.int32)
    perm = torch.randperm(sum(lens), generator=gen) + 1
    at = 0
    for i, n in enumerate(lens):
        req_to_token[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return k_buf, v_buf, req_to_token


def _decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, programs):
    from specpcg.attention.triton_kernels import decode_attention

    out = torch.zeros_like(q)
    decode_attention(q, k_buf, v_buf, out, req_to_token,
                     torch.tensor(rows, dtype=torch.int32),
                     torch.tensor(seq_lens, dtype=torch.int32), len(rows), programs,
                     D ** -0.5)
    return out


@needs_interpreter
@pytest.mark.parametrize("programs_alone,programs_batched", [(16, 1), (4, 2), (1, 8)])
def test_a_query_is_the_same_alone_and_in_any_batch(programs_alone, programs_batched):
    lens = [300, 7, 129, 64, 250]
    k_buf, v_buf, r2t = _world(lens)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(5))
    batched = _decode(q, k_buf, v_buf, r2t, list(range(len(lens))), lens, programs_batched)
    for i, n in enumerate(lens):
        alone = _decode(q[i:i + 1], k_buf, v_buf, r2t, [i], [n], programs_alone)
        assert torch.equal(alone[0], batched[i]), i


@needs_interpreter
def test_a_chain_verify_node_equals_the_decode_at_its_position():
    lens = [200]
    k_buf, v_buf, r2t = _world(lens)
    width = 4  # the root and three drafts: their keys are the row's last four
    q = torch.randn(width, H, D, generator=torch.Generator().manual_seed(6))
    seq = [lens[0] - width + 1 + j for j in range(width)]
    verify = _decode(q, k_buf, v_buf, r2t, [0] * width, seq, 8)
    for j in range(width):
        decode = _decode(q[j:j + 1], k_buf, v_buf, r2t, [0], [seq[j]], 1)
        assert torch.equal(decode[0], verify[j]), j


def _paths(parents: list) -> list:
    """Each node's path from the root (ancestors first, itself last)."""
    paths = []
    for j, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [j])
    return paths


@needs_interpreter
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2, 1, 4, 3]],
                         ids=["chain", "branching"])
def test_a_tree_node_equals_the_decode_over_its_accepted_path(parents):
    """A tree node (its own row: the prefix, then its path) gives bitwise the decode query at
    its position once its path is accepted, i.e. moved right after the prefix. In the branching
    tree the ancestors of node 6 (0, 2, 4) are not next to each other in the tree's layout."""
    from kernels.tree_rows import tree_path_rows

    n, keys = 97, len(parents)
    k_buf, v_buf, r2t = _world([n])
    q = torch.randn(keys, H, D, generator=torch.Generator().manual_seed(7))
    paths = _paths(parents)
    mask = torch.zeros(1, keys, keys, dtype=torch.bool)
    for j, path in enumerate(paths):
        mask[0, j, path] = True
    one = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    rows, lens = tree_path_rows(r2t, one(0), one(n), mask, n)
    tree = _decode(q, k_buf, v_buf, rows, list(range(keys)), lens.tolist(), 4)
    prefix = n - keys
    for j, path in enumerate(paths):
        accepted = r2t.clone()  # the engine moves the accepted path's slots after the prefix
        accepted[0, prefix:prefix + len(path)] = r2t[0, [prefix + a for a in path]]
        decode = _decode(q[j:j + 1], k_buf, v_buf, accepted, [0], [prefix + len(path)], 2)
        assert torch.equal(decode[0], tree[j]), j


def _extend(q, k_buf, v_buf, r2t, chunks: list, row: int = 0):
    """Prefill attention for the queries of `chunks` (prefix, extend) of one request row, each
    chunk as its own batch; the queries' outputs in order."""
    from specpcg.attention.triton_extend import extend_attention

    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    outs = []
    for prefix, extend in chunks:
        qs = q[prefix:prefix + extend]
        out = torch.zeros_like(qs)
        extend_attention(qs, k_buf, v_buf, out, r2t, i32([row]), i32([prefix + extend]),
                         i32([extend]), i32([0, extend]), extend, 1, D ** -0.5)
        outs.append(out)
    return torch.cat(outs)


@needs_interpreter
@pytest.mark.parametrize("chunks", [[(0, 37), (37, 63)], [(0, 16), (16, 16), (32, 68)],
                                    [(0, 1), (1, 99)]])
def test_prefill_attention_does_not_depend_on_the_chunk_size(chunks):
    """A prompt's query gives bitwise the same attention whether the prompt is prefilled whole
    or in chunks of any size (key blocks sit at fixed positions; masked keys add exact zeros)."""
    n = 100
    k_buf, v_buf, r2t = _world([n])
    q = torch.randn(n, H, D, generator=torch.Generator().manual_seed(9))
    whole = _extend(q, k_buf, v_buf, r2t, [(0, n)])
    assert torch.equal(_extend(q, k_buf, v_buf, r2t, chunks), whole)


def _softmax_attention(q, k_buf, v_buf, slots):
    """Plain softmax attention of one query [H, D] over the keys in `slots` (the reference)."""
    k = k_buf[slots.long()].repeat_interleave(H // HKV, dim=1)  # [N, H, D]
    v = v_buf[slots.long()].repeat_interleave(H // HKV, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * D ** -0.5, dim=-1)
    return torch.einsum("hn,nhd->hd", w, v)


@needs_interpreter
def test_the_split_result_matches_plain_softmax_attention():
    lens = [333]
    k_buf, v_buf, r2t = _world(lens)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(8))
    got = _decode(q, k_buf, v_buf, r2t, [0], lens, 4)[0]
    torch.testing.assert_close(got, _softmax_attention(q[0], k_buf, v_buf, r2t[0, :lens[0]]),
                               atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("programs", [1, 4, 16])
def test_one_launch_merges_every_split_and_leaves_its_counters_at_zero(programs):
    """The last program of each (request, KV head) merges the splits: a kept counter buffer
    comes back zeroed (a graph replays it), and a second launch on it gives the same bits. A
    padded request (no keys) gets zeros, and counters past the batch are left alone."""
    from specpcg.attention.triton_kernels import arrival_counters, decode_attention

    lens = [300, 0, 129, 31]
    k_buf, v_buf, r2t = _world([n or 1 for n in lens])
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(11))
    arrived = arrival_counters(len(lens) + 2, HKV, "cpu")
    arrived[-HKV:] = 7  # another batch's, not touched
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_buf, v_buf, out, r2t, torch.arange(len(lens), dtype=torch.int32),
                         torch.tensor(lens, dtype=torch.int32), len(lens), programs, D ** -0.5,
                         arrived)
        outs.append(out)
        assert arrived[:-HKV].eq(0).all() and arrived[-HKV:].eq(7).all()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][1], torch.zeros(H, D))
    assert torch.equal(outs[0], _decode(q, k_buf, v_buf, r2t, list(range(len(lens))), lens, 2))
    for i in (0, 2, 3):
        torch.testing.assert_close(outs[0][i],
                                   _softmax_attention(q[i], k_buf, v_buf, r2t[i, :lens[i]]),
                                   atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("unroll", [2, 3, 8])
def test_merging_splits_a_round_at_a_time_keeps_the_plain_loops_bits(unroll, monkeypatch):
    """The merge takes MERGE_UNROLL splits a round; a round past a row's last split (10, 5, 1
    and 0 splits here, 32 keys each on CPU) must leave the sums as the plain loop had them."""
    from specpcg.attention import triton_kernels

    lens = [300, 129, 7, 0, 250]
    k_buf, v_buf, r2t = _world([n or 1 for n in lens])
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(19))
    rows = list(range(len(lens)))
    outs = []
    for rounds in (1, unroll):
        monkeypatch.setattr(triton_kernels, "MERGE_UNROLL", rounds)
        outs.append(_decode(q, k_buf, v_buf, r2t, rows, lens, 1))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][3], torch.zeros(H, D)) and not torch.isnan(outs[1]).any()


def _stacked_against_one_a_program(device, dtype, lens, width, programs, heads=H, kv_heads=HKV,
                                   dim=D, stack=None):
    """A chain verify of `width` nodes per request (node j sees its row up to itself) run with
    one program taking each request's nodes together (or `stack` of them) and with a program
    a node: (stacked, single)."""
    from specpcg.attention.triton_kernels import decode_attention

    k_buf, v_buf, r2t = _world(lens, 13, kv_heads, dim, max(lens))
    k_buf, v_buf = k_buf.to(device, dtype), v_buf.to(device, dtype)
    n = len(lens) * width
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(13)).to(device, dtype)
    rows = torch.arange(len(lens), dtype=torch.int32).repeat_interleave(width)
    seq = torch.tensor([m - width + 1 + j for m in lens for j in range(width)], dtype=torch.int32)
    outs = []
    for nodes in (stack or width, 1):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_buf, v_buf, out, r2t.to(device), rows.to(device), seq.to(device),
                         n, programs, dim ** -0.5, nodes_per_program=nodes)
        outs.append(out)
    return outs


@needs_interpreter
@pytest.mark.parametrize("stack", [8, 4, 2])
def test_a_requests_nodes_in_programs_of_any_size_give_the_same_bits(stack):
    """8 nodes of 3 query heads a KV head: 24 rows a program (its merge one split a round), 12
    (decode's shape: 8 splits a round) or 6, against a program a node."""
    stacked, single = _stacked_against_one_a_program("cpu", torch.float32, [300, 40, 129], 8,
                                                     4, heads=6, kv_heads=2, stack=stack)
    assert torch.equal(stacked, single)
    assert not torch.isnan(stacked).any()


@needs_interpreter
@pytest.mark.parametrize("programs", [1, 4])
def test_a_program_taking_a_requests_nodes_together_gives_the_same_bits(programs):
    """nodes_per_program = the verify's width against a program a node (what the chain verify
    node = decode query guarantee was shown for above). Lengths cross split boundaries (32 keys
    on CPU): a request's first nodes then have a split with none of their keys."""
    stacked, single = _stacked_against_one_a_program("cpu", torch.float32, [200, 33, 130, 97],
                                                     4, programs)
    assert torch.equal(stacked, single)
    assert not torch.isnan(stacked).any()


def test_nodes_per_program_must_divide_the_queries():
    from specpcg.attention.triton_kernels import decode_attention

    q = torch.zeros(6, H, D)
    with pytest.raises(ValueError, match="nodes_per_program=4 does not divide num_reqs=6"):
        decode_attention(q, torch.zeros(8, HKV, D), torch.zeros(8, HKV, D), q.clone(),
                         torch.zeros(6, ROW, dtype=torch.int32), torch.zeros(6, dtype=torch.int32),
                         torch.ones(6, dtype=torch.int32), 6, 1, 1.0, nodes_per_program=4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("width,programs", [(8, 1), (8, 8), (5, 2), (2, 16)])
def test_cuda_a_program_taking_a_requests_nodes_together_gives_the_same_bits(
        dtype, heads, kv_heads, dim, width, programs):
    """Compiled, in the shapes of SmolLM2-135M and Llama-3-8B: the stacked verify (nodes x
    heads in the dot's rows) is bitwise the verify with a program a node, which is the decode.
    16-bit only: in float32 (no tensor cores) it was not, and a GPU's float32 verify keeps a
    program a node (TritonAttnBackend._stacks_nodes)."""
    stacked, single = _stacked_against_one_a_program(
        "cuda", dtype, [300, 129, 500, 64, 1000, 257], width, programs, heads, kv_heads, dim)
    assert torch.equal(stacked, single)
    assert not torch.isnan(stacked).any()


@needs_interpreter
@pytest.mark.parametrize("k,n,bias", [(96, 80, False), (64, 130, True)])
def test_a_matmul_row_is_the_same_whatever_rows_come_with_it(k, n, bias):
    from kernels.matmul import invariant_linear

    gen = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(70, k, generator=gen)
    full = invariant_linear(x, w, b, use_triton=True)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    for rows in ([0], [3, 4, 5], list(range(65, 70))):
        part = invariant_linear(x[rows], w, b, use_triton=True)
        assert torch.equal(part, full[rows]), rows


@needs_interpreter
@pytest.mark.parametrize("block_n,split_k", [(32, 1), (64, 2), (32, 3)])
def test_every_tiling_keeps_a_row_the_same_whatever_rows_come_with_it(block_n, split_k):
    """Narrow N tiles and split K (what big weights get on a GPU) keep the guarantee: the
    splits are added in one fixed order, whatever M is."""
    from kernels.dispatch import triton_module

    mm = triton_module("matmul_triton")
    tiling = mm.Tiling(block_n=block_n, block_k=32, split_k=split_k, num_stages=1)
    gen = torch.Generator().manual_seed(10)
    w, b = torch.randn(72, 200, generator=gen), torch.randn(72, generator=gen)
    x = torch.randn(67, 200, generator=gen)

    def run(rows):
        out = torch.empty(len(rows), 72)
        mm.matmul(x[rows].contiguous(), w, b, out, tiling)
        return out

    full = run(list(range(67)))
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    for rows in ([0], [3, 4, 5], list(range(64, 67))):
        assert torch.equal(run(rows), full[rows]), rows


@needs_interpreter
@pytest.mark.parametrize("split_k,k,bias", [(2, 200, True), (3, 200, False), (1, 200, True),
                                           (4, 160, False)])  # 4 x 160: the last split is empty
def test_one_program_adding_the_splits_gives_the_workspace_bits(split_k, k, bias):
    """The wide launch (each program sums every K split itself, no fp32 workspace), with
    pointer loads or TMA descriptors, adds the same partial sums in the same order as the split
    kernel and its summing kernel."""
    from kernels.dispatch import triton_module

    mm = triton_module("matmul_triton")
    tiling = mm.Tiling(block_n=32, block_k=32, split_k=split_k, num_stages=1)
    gen = torch.Generator().manual_seed(12)
    w, x = torch.randn(72, k, generator=gen), torch.randn(67, k, generator=gen)
    b = torch.randn(72, generator=gen) if bias else None

    def run(launch):
        out = torch.empty(67, 72)
        mm.matmul(x, w, b, out, tiling, launch)
        return out

    outs = [run(launch) for launch in (mm.Launch(), mm.Launch(fuse_splits=True),
                                       mm.Launch(tma=True))]
    torch.testing.assert_close(outs[0], torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # Wider tiles by pointers and by descriptors: the same bits. (That a tile's shape leaves a
    # row's sum alone holds for the GPU's dot, test_cuda_the_rules_tiling_keeps_rows_alone; the
    # interpreter's dot is numpy's matmul, whose order follows the operands' shapes.)
    wide = mm.Launch(block_m=32, block_n=64)
    assert torch.equal(run(wide), run(mm.Launch(block_m=32, block_n=64, tma=True)))


@needs_interpreter
def test_a_tma_launch_of_unaligned_tensors_takes_pointer_loads(monkeypatch):
    """TMA needs 16-byte aligned rows: a [.., 7] fp32 view has 28-byte rows, so the launch
    falls back to pointer loads with the same tiles (the same bits)."""
    from kernels.dispatch import triton_module

    mm = triton_module("matmul_triton")
    tiling = mm.Tiling(block_n=32, block_k=32, split_k=1, num_stages=1)
    gen = torch.Generator().manual_seed(14)
    w, x = torch.randn(40, 7, generator=gen), torch.randn(9, 7, generator=gen)
    assert not mm.tma_fits(x, w)
    called = []
    monkeypatch.setattr(mm, "_launch_tma", lambda *a: called.append(a))
    out = torch.empty(9, 40)
    mm.matmul(x, w, None, out, tiling, mm.Launch(tma=True))
    assert not called
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_many_rows_take_the_widest_launch_that_fills_the_gpu():
    from kernels.dispatch import triton_module

    mm = triton_module("matmul_triton")
    assert mm.launch_for(4096, 128256, torch.device("cpu")) == mm.Launch()
    assert mm.cuda_launch(mm.WIDE_FROM_ROWS - 1, 128256, 132) == mm.Launch()
    assert mm.cuda_launch(128, 128256, 132) == mm.WIDE_LAUNCHES[0]  # 1 x 1002 programs
    assert mm.cuda_launch(128, 6144, 132) == mm.WIDE_LAUNCHES[1]  # 2 x 48 of 64 x 128
    assert mm.cuda_launch(128, 4096, 132) == mm.WIDE_LAUNCHES[2]  # 2 x 64 of 64 x 64
    assert mm.cuda_launch(512, 576, 132) == mm.Launch()  # 8 x 9 of 64 x 64: too few
    assert all(lc.fuse_splits for lc in mm.WIDE_LAUNCHES)
    assert mm.cuda_launch(256, 4096, 132, tma=True) == mm.WIDE_LAUNCHES_TMA[1]
    assert all(lc.tma for lc in mm.WIDE_LAUNCHES_TMA)


@needs_interpreter
def test_a_wide_launch_the_gpu_cannot_fit_falls_back_to_the_decode_launch(monkeypatch):
    """A GPU with less shared memory than the one the wide launches were fitted on refuses
    them at compile time: the call takes the decode launch (same bits) from then on."""
    import triton

    from kernels.dispatch import triton_module

    mm = triton_module("matmul_triton")
    monkeypatch.setattr(mm, "launch_for", lambda m, n, device: mm.WIDE_LAUNCHES[0])
    monkeypatch.setattr(mm, "_UNFIT", set())
    launched, real = [], mm._launch

    def launch(x, w, b, out, t, lc):
        launched.append(lc)
        if lc.fuse_splits:
            raise triton.runtime.errors.OutOfResources(245760, 232448, "shared memory")
        return real(x, w, b, out, t, lc)

    monkeypatch.setattr(mm, "_launch", launch)
    gen = torch.Generator().manual_seed(13)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(5, 64, generator=gen)
    for _ in range(2):
        out = torch.empty(5, 40)
        mm.matmul(x, w, None, out)
        torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)
    assert launched == [mm.WIDE_LAUNCHES[0], mm.Launch(), mm.Launch()]  # tried once only


def test_big_weights_get_a_full_wave_of_programs_and_small_ones_stay_whole():
    from kernels.dispatch import triton_module

    mm = triton_module("matmul_triton")
    assert mm.tiling_for(4096, 4096, torch.device("cpu")) == mm.Tiling(num_stages=1)
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        t = mm.cuda_tiling(n, k, sms=132)
        assert -(-n // t.block_n) * t.split_k >= 132, (n, k, t)
        assert k // t.split_k >= 512
    assert mm.cuda_tiling(128256, 4096, 132).block_n == 128
    small = mm.cuda_tiling(576, 576, 132)  # too shallow to split: narrow tiles only
    assert (small.block_n, small.split_k) == (32, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (6144, 4096), (960, 576),
                                 (576, 1536), (49152, 576)])
def test_cuda_the_rules_tiling_keeps_rows_alone(n, k):
    """The tiling a real weight gets on this GPU (split K included) in bf16: a row's output is
    bitwise the same alone, in 37 rows, in 200 or in 520 (the last two take the wide launch,
    the first ones the decode launch), and close to cuBLAS."""
    from kernels.matmul import invariant_linear

    gen = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    x = torch.randn(520, k, device="cuda", generator=gen).to(torch.bfloat16)
    full = invariant_linear(x, w)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T), atol=2e-2, rtol=2e-2)
    for rows in ([0], list(range(37)), [5, 150, 199], list(range(200)), [519]):
        assert torch.equal(invariant_linear(x[rows], w), full[rows]), rows


@needs_interpreter
def test_deterministic_mode_swaps_every_linear_and_keeps_the_tokens(tmp_path):
    """On CPU the swapped layers run the torch twin (the interpreter is too slow for a whole
    model): tokens stay the same; with the Triton kernel forced on for the LM head they still
    match."""
    from kernels.matmul import invariant_linear
    from specpcg import Engine
    from specpcg.models.deterministic import InvariantLinear
    from test_train import _tiny_target

    kw = dict(model_path=_tiny_target(tmp_path / "t"), skip_tokenizer_init=True, device="cpu",
              dtype="float32", max_total_tokens=2048, show_progress=False)
    plain = Engine(**kw)
    det = Engine(enable_deterministic_inference=True, **kw)
    assert det.get_server_info()["enable_deterministic_inference"] is True
    linears = [m for m in det.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is InvariantLinear for m in linears)
    params = {"max_new_tokens": 12, "temperature": 0}
    ids = [[5, 9, 2, 7], [11, 3]]
    want = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=params)]
    assert [o["output_ids"] for o in det.generate(input_ids=ids, sampling_params=params)] == want
    det.model.head_linear = lambda x, w: invariant_linear(x, w, use_triton=True)
    assert [o["output_ids"] for o in det.generate(input_ids=ids, sampling_params=params)] == want
