"""The attention factory's rules: which backend a name and a device resolve to, and what it
refuses, naming the field and the value."""

import importlib.util
import os

import torch

# Without a GPU, Triton kernels run in the interpreter (set before they are first imported).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from specpcg.attention import (create_attention_backend,  # noqa: E402
                               resolve_attention_backend_name)
from specpcg.attention.torch_backend import TorchAttnBackend  # noqa: E402
from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cpu_triton = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and the interpreter (TRITON_INTERPRET=1) for CPU tensors")
NUM_HEADS, NUM_KV_HEADS = 4, 2


def _cache() -> KVCache:
    pool = KVPool(64, num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim=16, dtype=torch.float32,
                  device="cpu")
    return KVCache(pool, ReqToTokenPool(2, 64, "cpu"))


@pytest.mark.parametrize("device,expected",
                         [("cpu", "torch"), ("cuda", "triton" if HAS_TRITON else "torch")])
def test_auto_resolves_by_device(device, expected):
    assert resolve_attention_backend_name("auto", device) == expected


def test_explicit_names_resolve(monkeypatch):
    assert resolve_attention_backend_name("torch", "cpu") == "torch"
    assert resolve_attention_backend_name("torch", "cuda") == "torch"
    if HAS_TRITON:
        assert resolve_attention_backend_name("triton", "cuda") == "triton"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_attention_backend_name("triton", "cpu") == "triton"


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match=r"attention_backend='sdpa'.*valid.*'torch'.*'triton'"):
        resolve_attention_backend_name("sdpa", "cpu")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton'.*'cpu'.*TRITON_INTERPRET=1"):
        resolve_attention_backend_name("triton", "cpu")


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None,
                    reason="flashinfer is installed here")
def test_flashinfer_missing_is_refused():
    with pytest.raises(ValueError, match=r"flashinfer is not installed.*pip install flashinfer-python"):
        resolve_attention_backend_name("flashinfer", "cuda")


def test_factory_builds_torch_backend():
    backend = create_attention_backend("auto", "cpu", _cache(), NUM_HEADS, NUM_KV_HEADS, 16, 0.25)
    assert isinstance(backend, TorchAttnBackend) and backend.scale == 0.25


@needs_cpu_triton
def test_factory_builds_triton_backend():
    backend = create_attention_backend("triton", "cpu", _cache(), NUM_HEADS, NUM_KV_HEADS, 16, 0.25)
    assert backend.name == "triton" and backend.supports_cuda_graph
